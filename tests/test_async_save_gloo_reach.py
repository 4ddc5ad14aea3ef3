"""The background-save worker's gloo group across hosts: a rank whose hostname resolves to loopback
(and no GLOO_SOCKET_IFNAME) in a job spanning several hosts is refused with one error naming the fix,
before the group is created -- instead of the first async save hanging. Unit level: the resolver, the
environment and the other ranks' answers are injected."""

from __future__ import annotations

import pytest

import lightning_mics.checkpoint as ckpt
from lightning_mics.checkpoint import coordination, gloo_reach
from lightning_mics.checkpoint.gloo_reach import HostAddress, check_reachable, local_host_address


def test_loopback_hostnames_are_refused_only_across_hosts() -> None:
    loopback, routable = HostAddress("node-a", "127.0.1.1", None), HostAddress("node-b", "10.0.0.2", None)
    check_reachable([loopback, loopback])  # one host: loopback reaches every rank
    check_reachable([routable, HostAddress("node-c", "10.0.0.3", None)])
    with pytest.raises(RuntimeError, match=r"node-a \(127\.0\.1\.1\).*GLOO_SOCKET_IFNAME=<interface>.*ip route get 10"):
        check_reachable([loopback, routable], master_addr="10.0.0.2")
    unresolved = HostAddress("node-a", None, None)  # gloo falls back to loopback
    with pytest.raises(RuntimeError, match="unresolved, loopback fallback"):
        check_reachable([unresolved, routable])
    check_reachable([HostAddress("node-a", "127.0.1.1", "eth0"), routable])  # the interface is named: fine
    check_reachable([HostAddress("node-a", "::1", None)])
    with pytest.raises(RuntimeError, match="node-a"):
        check_reachable([HostAddress("node-a", "::1", None), routable])


def test_this_ranks_address_comes_from_its_hostname_and_environment() -> None:
    host = local_host_address("node-a", resolve=lambda name: "127.0.1.1", env={})
    assert host == HostAddress("node-a", "127.0.1.1", None) and host.loopback
    named = local_host_address("node-a", resolve=lambda name: "127.0.1.1", env={"GLOO_SOCKET_IFNAME": "ens5"})
    assert named.ifname == "ens5" and not named.loopback
    assert gloo_reach.first_address("localhost") in ("127.0.0.1", "::1")


def test_the_saver_refuses_before_creating_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank sees all ranks' answers, so all raise together; no gloo group is attempted."""
    monkeypatch.setattr(coordination, "distributed", lambda: True)
    monkeypatch.setattr(gloo_reach, "local_host_address", lambda: HostAddress("node-a", "127.0.1.1", None))
    monkeypatch.setattr(
        gloo_reach, "_gather_over_world", lambda local: [local, HostAddress("node-b", "10.0.0.2", None)]
    )

    def new_group(**kwargs: object) -> None:
        raise AssertionError("the gloo group must not be created")

    monkeypatch.setattr(ckpt.saving.dist, "new_group", new_group)
    with pytest.raises(RuntimeError, match="GLOO_SOCKET_IFNAME"):
        ckpt.AsyncCheckpointSaver().group()
