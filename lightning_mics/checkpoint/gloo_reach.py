"""Whether the background-save group's gloo transport can reach across hosts, checked before it exists.

Background saves (:class:`~lightning_mics.checkpoint.saving.AsyncCheckpointSaver`) run their
collectives in a gloo group of their own, whatever the job's backend. Gloo binds each rank to the
interfaces ``GLOO_SOCKET_IFNAME`` names, or else to the first address the machine's hostname resolves
to -- falling back to loopback where it resolves to nothing (torch's ``ProcessGroupGloo::createDefaultDevice``).
Many images map the hostname to ``127.0.1.1`` in ``/etc/hosts``: each rank's gloo then listens on
loopback, peers on other hosts cannot connect, and the first background save hangs until its timeout.
A NCCL job does not notice before that (NCCL picks its own interfaces; a gloo job's default group
would already have failed at start-up).

Why an error and not a repair: ``dist.new_group(backend="gloo")`` takes no device options (torch 2.11 -
2.13 build gloo's device from the environment alone), and the address the job's NCCL traffic uses is
not exposed. So every rank checks -- with the others' answers, so that all raise together instead of
some waiting in the group's rendezvous -- and the error names the fix.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"


@dataclass(frozen=True)
class HostAddress:
    """What one rank's gloo would bind to: its host, the hostname's first address, the interfaces set."""

    hostname: str
    address: Optional[str]  #: ``None``: the hostname resolves to nothing (gloo then takes loopback)
    ifname: Optional[str]  #: ``GLOO_SOCKET_IFNAME`` in this rank's environment

    @property
    def loopback(self) -> bool:
        """Whether gloo would listen on a loopback address only."""
        if self.ifname:
            return False
        return self.address is None or ipaddress.ip_address(self.address.split("%")[0]).is_loopback


def first_address(hostname: str) -> Optional[str]:
    """The first address ``hostname`` resolves to for a TCP socket, as gloo asks; ``None`` if none."""
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return str(infos[0][4][0]) if infos else None


def local_host_address(
    hostname: Optional[str] = None,
    resolve: Callable[[str], Optional[str]] = first_address,
    env: Mapping[str, str] = os.environ,
) -> HostAddress:
    """This rank's :class:`HostAddress` (``resolve`` and ``env`` are injectable for tests)."""
    hostname = hostname if hostname is not None else socket.gethostname()
    return HostAddress(hostname, resolve(hostname), env.get(GLOO_SOCKET_IFNAME) or None)


def check_reachable(hosts: Sequence[HostAddress], master_addr: Optional[str] = None) -> None:
    """Raise if the ranks span several hosts and a rank's gloo would listen on loopback only.

    Hosts are told apart by hostname; one host, whatever its addresses, is fine: loopback reaches it."""
    if len({host.hostname for host in hosts}) < 2:
        return
    stuck = sorted({host.hostname: host for host in hosts if host.loopback}.values(), key=lambda h: h.hostname)
    if not stuck:
        return
    where = ", ".join(f"{h.hostname} ({h.address or 'unresolved, loopback fallback'})" for h in stuck[:8])
    route = f"`ip route get {master_addr}`" if master_addr else "`ip route`"
    raise RuntimeError(
        f"async_save: the background-save worker's gloo group would listen on a loopback address on {where}, "
        f"while the job spans {len({h.hostname for h in hosts})} hosts: ranks on other hosts could not "
        f"connect and the first background save would hang. Set {GLOO_SOCKET_IFNAME}=<interface> in every "
        f"rank's environment (the network interface the hosts reach each other on, e.g. the one {route} "
        "shows), or map the hostname to a routable address in /etc/hosts, or save in the foreground "
        "(async_save=False)."
    )


def _gather_over_world(local: HostAddress) -> list[HostAddress]:
    """Every rank's :class:`HostAddress`, over the job's default group (a collective)."""
    gathered: list[Optional[HostAddress]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return [host for host in gathered if host is not None]


def ensure_gloo_reachable() -> None:
    """Check, on every rank together, that a new gloo group can connect (see the module docstring)."""
    check_reachable(_gather_over_world(local_host_address()), os.environ.get("MASTER_ADDR"))
