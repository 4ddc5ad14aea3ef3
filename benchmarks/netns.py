"""An emulated cloud cluster on one Linux host: network namespaces as nodes, a bridge as the switch,
``tc tbf`` as the NICs' line rate -- and, with ``nodes_per_region``, regions joined by slower links of their own.

Layout (N nodes, one region)::

    <prefix>-node0                 <prefix>-switch                 <prefix>-node1
    lo (ranks of node 0 talk here) br0                              lo
    uplink 198.18.0.1/24 ==veth==  port0 ─┤br0├─ port1  ==veth==   uplink 198.18.0.2/24
           tbf (egress)                   tbf (egress, toward the node)

With regions (``nodes_per_region=2``, 4 nodes; :mod:`benchmarks.netns_regions`)::

    node0, node1 ==veth== port0, port1 ─┤rbr0├─ rlink0 ==veth== rcore0 ─┐
                                                tbf (region 0 sends)    tbf (region 0 receives)
                                                                        ├─ br0 (core bridge)
    node2, node3 ==veth== port2, port3 ─┤rbr1├─ rlink1 ==veth== rcore1 ─┘

  the nodes of one region share their region's bridge, so traffic between them crosses only their own node links;
  traffic between regions crosses the node links and both regions' links, each shaped at its own rate
  (:meth:`EmulatedCluster.shape`, :meth:`EmulatedCluster.shape_regions`) and counted
  (:meth:`EmulatedCluster.region_link_bytes`; the ranks read the same counters through
  :attr:`EmulatedCluster.region_counter_file`).

* Every address comes from the benchmarking range 198.18.0.0/15 (RFC 2544) and lives only inside
  namespaces created here; the switch sits in its own namespace, so the host's network namespace,
  interfaces and routes are never touched. The region bridges and links live in the switch namespace too.
* Ranks on one node reach each other through their namespace's ``lo`` (the kernel delivers
  traffic to a local address locally), so only inter-node traffic crosses -- and is shaped and
  counted on -- the ``uplink`` veth.
* Both directions of every node link are shaped: the node side limits what the node sends, the
  switch side what it receives. The same holds for every region link.
* Every node has CPUs of its own: its processes run in a cpu cgroup capped at (host cores / nodes)
  (:mod:`benchmarks.cpu_quota`), so a lost node's CPU is not lent to the survivors and a starting node
  imports on its own budget. Where the host cannot give quotas the cluster runs without them and says so
  (:attr:`EmulatedCluster.cpu_quota_unavailable`).
"""

from __future__ import annotations

import functools
import ipaddress
import re
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional, Union

from benchmarks.cpu_quota import CpuQuotaUnavailable, NodeCpuQuotas, join
from benchmarks.fork_server import PRELOAD, ForkedProcess, ForkServer
from benchmarks.netns_regions import RegionLayout, region_layout, region_link

REPO_ROOT = Path(__file__).resolve().parent.parent
#: RFC 2544 benchmarking range; the nodes take the first addresses of its first /24.
BENCHMARK_NETWORK = ipaddress.ip_network("198.18.0.0/15")
NODE_SUBNET = ipaddress.ip_network("198.18.0.0/24")
UPLINK = "uplink"
BRIDGE = "br0"
#: Names of a benchmark's namespaces and cgroups: this prefix and the orchestrator's process id (two benchmarks on
#: one host do not touch each other's), then ``-node<i>`` / ``-switch``.
DEFAULT_PREFIX = "micsbench"
_OWNED_NAME = re.compile(rf"^{DEFAULT_PREFIX}(\d+)-(node\d+|switch)$")
#: A process the cluster started: spawned, or forked from its fork server (the same ``pid``/``poll``/``wait``).
RankProcess = Union[subprocess.Popen, ForkedProcess]


class PrerequisiteError(RuntimeError):
    """The host cannot run the emulation (not root, missing tools); the message says what to do."""


def prepare_host(check: Callable[[], None]) -> bool:
    """A benchmark's start: ``check`` the host (what is missing goes to stderr as one line; ``False`` then),
    and let SIGTERM/SIGHUP unwind like Ctrl-C, so that the benchmark's teardown (namespaces, processes)
    runs whichever way it is stopped."""
    try:
        check()
    except PrerequisiteError as error:
        print(f"error: {error}", file=sys.stderr)
        return False
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    return True


def _raise_on_signal(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def check_prerequisites(euid: Optional[int] = None, which=shutil.which) -> None:  # noqa: ANN001 (injectable)
    """Refuse early, with one clear message, when namespaces and shaping cannot be set up."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise PrerequisiteError(
            "The emulated cluster creates network namespaces, veth links and tc qdiscs, which needs root. "
            "Run it as root with this environment's Python, e.g. "
            "`sudo \"$(command -v python)\" benchmarks/emulated_cluster.py`."
        )
    missing = [tool for tool in ("ip", "tc") if which(tool) is None]
    if missing:
        raise PrerequisiteError(
            f"Missing {' and '.join(missing)} on PATH: the emulated cluster needs iproute2's `ip` and `tc` "
            "(Debian/Ubuntu: `apt-get install iproute2`)."
        )


@dataclass(frozen=True)
class LinkShape:
    """A token-bucket line rate for one direction of a node link."""

    rate_bytes_per_s: float
    #: Queue bound in ms: how long a packet may wait for tokens before being dropped.
    latency_ms: float = 50.0

    @property
    def burst_bytes(self) -> int:
        """Bucket size: 5 ms of line rate (a few timer ticks, so tbf is not timer-bound), at least
        128 KiB so GSO super-packets from the 9000-byte-MTU veths always fit."""
        return max(128 * 1024, int(self.rate_bytes_per_s * 0.005))

    def tbf_args(self) -> list[str]:
        return [
            "tbf",
            "rate", f"{int(self.rate_bytes_per_s * 8)}bit",
            "burst", str(self.burst_bytes),
            "latency", f"{self.latency_ms:g}ms",
        ]


def rank_environment(**variables: str) -> dict[str, str]:
    """A rank's environment: this process's, with the repository importable, one OpenMP thread (the ranks share
    the host's cores) and warnings off -- plus ``variables``. The fork server starts with it too: it holds the
    variables only a new interpreter reads (``fork_server.STARTUP_VARIABLES``)."""
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
            **variables}


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


class EmulatedCluster:
    """Create, shape, use and tear down the namespaces. Use it as a context manager: teardown runs
    on normal exit, on errors and on Ctrl-C, and also removes the processes started through
    :meth:`spawn` (by their process ids)."""

    def __init__(self, num_nodes: int, mtu: int = 9000, prefix: str | None = None,
                 cpu_quota: bool = True, nodes_per_region: int | None = None) -> None:
        if num_nodes < 2:
            raise ValueError(f"An emulated cluster needs at least 2 nodes, got {num_nodes}.")
        if num_nodes > NODE_SUBNET.num_addresses - 2:
            raise ValueError(f"At most {NODE_SUBNET.num_addresses - 2} nodes fit the node subnet {NODE_SUBNET}.")
        if not 1280 <= mtu <= 65535:
            raise ValueError(f"--mtu must lie between 1280 and 65535, got {mtu}.")
        self.num_nodes = num_nodes
        self.mtu = mtu
        #: the region level (``None``: one region, every node on the one bridge)
        self.regions: RegionLayout | None = region_layout(num_nodes, nodes_per_region)
        self._region_holder: subprocess.Popen[bytes] | None = None
        self.prefix = prefix if prefix is not None else f"{DEFAULT_PREFIX}{os.getpid()}"
        self._processes: list[RankProcess] = []
        self._created = False
        self._fork_server: ForkServer | None = None
        #: each node's cpu cgroup (``cpu_quota=False``: none, the nodes share the host's cores)
        self.cpu_quotas: NodeCpuQuotas | None = NodeCpuQuotas(self.prefix, num_nodes) if cpu_quota else None
        #: why the nodes run without CPU quotas although they were asked for (``None``: they have them, or
        #: ``cpu_quota=False``)
        self.cpu_quota_unavailable: str | None = None

    # ------------------------------------------------------------------ names and addresses
    def node_namespace(self, node: int) -> str:
        return f"{self.prefix}-node{node}"

    @property
    def switch_namespace(self) -> str:
        return f"{self.prefix}-switch"

    @property
    def namespaces(self) -> list[str]:
        return [self.node_namespace(i) for i in range(self.num_nodes)] + [self.switch_namespace]

    def node_address(self, node: int) -> str:
        address = NODE_SUBNET.network_address + node + 1
        assert address in BENCHMARK_NETWORK
        return str(address)

    @property
    def cpu_quota_per_node(self) -> float | None:
        """Cores each node's processes may use together (``None``: no quota, they share the host's)."""
        quotas = self.cpu_quotas
        return quotas.cores_per_node if quotas is not None and quotas.active else None

    def node_cgroup(self, node: int) -> str | None:
        """Node ``node``'s cgroup directory, which its processes join before they run (``None``: no quotas)."""
        return self.cpu_quotas.group(node) if self.cpu_quotas is not None else None

    def throttled_seconds(self) -> list[float | None] | None:
        """Per node, how long its quota has held its processes back so far (``None``: no quotas)."""
        quotas = self.cpu_quotas
        if quotas is None or not quotas.active:
            return None
        return [quotas.throttled_seconds(node) for node in range(self.num_nodes)]

    def cpu_settings(self) -> dict[str, Any]:
        """What a benchmark's JSON records of the nodes' CPUs (call it before the teardown): the quota each node ran
        under (``None``: none), why there was none where one was asked for, and how long each node's quota held it
        back."""
        return {"cpu_quota_per_node": self.cpu_quota_per_node, "cpu_quota_unavailable": self.cpu_quota_unavailable,
                "cpu_throttled_seconds_per_node": self.throttled_seconds()}

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> EmulatedCluster:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _existing_namespaces(self) -> list[str]:
        listed = _run(["ip", "netns", "list"], check=False).stdout.split()
        return [name for name in self.namespaces if name in listed]

    def _stale_namespaces(self) -> list[str]:
        """Ours by name from an earlier run that was killed hard (SIGKILL): this prefix, or the default prefix with
        the process id of an orchestrator that no longer runs (a benchmark still running keeps its own)."""
        listed = _run(["ip", "netns", "list"], check=False).stdout.split()
        stale = [name for name in self.namespaces if name in listed]
        stale += [name for name in listed if name not in stale and self._is_stale_name(name)]
        return stale

    def _is_stale_name(self, name: str) -> bool:
        match = _OWNED_NAME.match(name)
        return match is not None and not _process_alive(int(match[1]))

    def create(self) -> None:
        stale = self._stale_namespaces()
        if stale:
            print(f"removing stale namespaces from an earlier run: {', '.join(stale)}", file=sys.stderr)
            for name in stale:
                _run(["ip", "netns", "del", name], check=False)
        self._created = True  # from here on, teardown has something to remove
        if self.cpu_quotas is not None:
            self.cpu_quotas.remove_stale(self._is_stale_name)
            try:
                self.cpu_quotas.create()
                print(f"emulated nodes: {self.cpu_quotas.cores_per_node:.3g} cores each (cpu cgroup quota)",
                      file=sys.stderr)
            except CpuQuotaUnavailable as error:
                self.cpu_quota_unavailable = str(error)
                print(f"warning: the emulated nodes run WITHOUT CPU quotas of their own -- {error}; every node "
                      "shares the host's cores, so a lost node's CPU goes to the survivors", file=sys.stderr)
        sw = self.switch_namespace
        for name in self.namespaces:
            _run(["ip", "netns", "add", name])
        if self.regions is None:
            _run(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"])
            _run(["ip", "-n", sw, "link", "set", BRIDGE, "up"])
        else:  # a bridge per region, joined to the core bridge by one link per region
            for command in self.regions.switch_commands(sw, self.mtu):
                _run(command)
        for node in range(self.num_nodes):
            ns, port = self.node_namespace(node), f"port{node}"
            # Both ends are created directly inside their namespaces: nothing appears on the host.
            _run(["ip", "link", "add", "name", UPLINK, "netns", ns, "mtu", str(self.mtu),
                  "type", "veth", "peer", "name", port, "netns", sw, "mtu", str(self.mtu)])
            bridge = BRIDGE if self.regions is None else self.regions.port_bridge(node)
            _run(["ip", "-n", sw, "link", "set", port, "master", bridge])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.node_address(node)}/{NODE_SUBNET.prefixlen}", "dev", UPLINK])
            _run(["ip", "-n", ns, "link", "set", UPLINK, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        self._wait_until_reachable()

    def _wait_until_reachable(self, timeout_s: float = 10.0) -> None:
        """The bridge forwards once its ports leave the listening state; wait for a ping (to node 1, and with
        regions to the last node too: across the region links)."""
        deadline = time.monotonic() + timeout_s
        for target_node in sorted({1, self.num_nodes - 1} if self.regions is not None else {1}):
            self._wait_for(self.node_address(target_node), deadline)

    def _wait_for(self, target: str, deadline: float) -> None:
        while True:
            probe = _run(["ip", "netns", "exec", self.node_namespace(0), sys.executable, "-c",
                          f"import socket; s = socket.socket(); s.settimeout(0.5); "
                          f"r = s.connect_ex(('{target}', 9)); print(r)"], check=False)
            # ECONNREFUSED (111) means the peer's kernel answered: the path works.
            if probe.stdout.strip() == "111":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"node 0 cannot reach {target} through the bridges: {probe.stdout!r}")
            time.sleep(0.2)

    def shape(self, shape: LinkShape) -> None:
        """Apply the line rate to both directions of every node link."""
        for node in range(self.num_nodes):
            _run(["tc", "-n", self.node_namespace(node), "qdisc", "replace", "dev", UPLINK, "root", *shape.tbf_args()])
            _run(["tc", "-n", self.switch_namespace, "qdisc", "replace", "dev", f"port{node}", "root",
                  *shape.tbf_args()])

    def shape_regions(self, shape: LinkShape) -> None:
        """Apply the line rate to both directions of every region link (what a region sends to the others, and
        what it receives from them)."""
        if self.regions is None:
            raise ValueError("shape_regions: this cluster has one region (pass nodes_per_region).")
        for device in self.regions.shaped_devices():
            _run(["tc", "-n", self.switch_namespace, "qdisc", "replace", "dev", device, "root", *shape.tbf_args()])

    def region_link_bytes(self, region: int) -> dict[str, int]:
        """The kernel's byte counters of region ``region``'s link: ``tx_bytes`` what it sent to the other regions,
        ``rx_bytes`` what it received from them."""
        if self.regions is None or not 0 <= region < self.regions.regions:
            raise ValueError(f"region {region} is not one of this cluster's regions.")
        device = region_link(region)
        out = _run(["ip", "netns", "exec", self.switch_namespace, "cat",
                    f"/sys/class/net/{device}/statistics/tx_bytes",
                    f"/sys/class/net/{device}/statistics/rx_bytes"]).stdout.split()
        return {"tx_bytes": int(out[0]), "rx_bytes": int(out[1])}

    @property
    def region_counter_file(self) -> str | None:
        """Where a rank reads the region links' counters (``benchmarks.netns_regions.region_counters``):
        ``/proc/<pid>/net/dev`` of a process this cluster keeps asleep in the switch namespace (started on first
        use, stopped at teardown). ``None`` without regions."""
        if self.regions is None:
            return None
        if self._region_holder is None or self._region_holder.poll() is not None:
            self._region_holder = self.spawn_in(self.switch_namespace, ["sleep", "infinity"],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            path = Path(f"/proc/{self._region_holder.pid}/net/dev")
            deadline = time.monotonic() + 10
            while region_link(0) not in path.read_text():  # until `ip netns exec` has entered the namespace
                if time.monotonic() > deadline:
                    raise RuntimeError("the switch namespace's counter holder did not start")
                time.sleep(0.02)
        return f"/proc/{self._region_holder.pid}/net/dev"

    def teardown(self) -> None:
        """Stop the processes started here, then delete the namespaces (which removes the veths,
        the bridge and the qdiscs with them). Safe to call more than once."""
        server = self._fork_server
        self._fork_server = None
        ranks = [proc for proc in self._processes if server is None or proc is not server.process]
        _terminate_sessions(ranks)  # the fork server last: it reports its children's exits until they are gone
        if server is not None:
            _terminate_sessions([server.process])
            shutil.rmtree(server.socket_path.parent, ignore_errors=True)
        self._processes.clear()
        self._region_holder = None
        if self._created:
            for name in self._existing_namespaces():
                _run(["ip", "netns", "del", name], check=False)
            if self.cpu_quotas is not None:
                self.cpu_quotas.teardown()
            self._created = False

    # ------------------------------------------------------------------ processes
    def start_fork_server(self, preload: Sequence[str] = PRELOAD, environment: dict[str, str] | None = None) -> None:
        """From now on :meth:`spawn_rank` forks its ranks from one server that imported ``preload`` (torch,
        Lightning and this library) once (``benchmarks/fork_server.py``): a node is up in a second, faster than a
        real one -- for smoke runs, which check a path and measure nothing. It imports while the caller goes on
        (outside every node's cgroup); the ranks' environments must agree with ``environment`` (default
        :func:`rank_environment`) on what only a new interpreter reads. Each forked rank joins its node's cgroup."""
        if self._fork_server is None:
            socket_dir = Path(tempfile.mkdtemp(prefix="micsfork-"))
            self._fork_server = ForkServer(socket_dir / "socket", environment or rank_environment(), preload)
            self._processes.append(self._fork_server.process)

    def spawn_rank(
        self, node: int, module_argv: Sequence[str], env: dict[str, str], log: IO[bytes], hostname: str | None = None,
    ) -> RankProcess:
        """Start a rank, ``[python, "-m", module, *args]``, in node ``node``'s namespace with stdout and stderr to
        ``log``, in the node's cgroup: forked from the fork server once one runs (:meth:`start_fork_server`), else
        a fresh process that imports on the node's own CPU.
        ``hostname``: the rank gets a UTS namespace of its own with this name (the namespaces share the host's
        name otherwise, which resolves to 127.0.0.1)."""
        if self._fork_server is not None:
            proc: RankProcess = self._fork_server.start(module_argv, env, REPO_ROOT, log.fileno(),
                                                        namespace=self.node_namespace(node), hostname=hostname,
                                                        cgroup=self.node_cgroup(node))
            self._processes.append(proc)
            return proc
        argv = list(module_argv)
        if hostname is not None:
            argv = ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *argv]
        return self.spawn(node, argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def spawn(
        self, node: int, argv: Sequence[str], env: Optional[dict[str, str]] = None, stdout=None, stderr=None  # noqa: ANN001
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside node ``node``'s namespace, in a session of its own (so Ctrl-C on the
        terminal reaches only the orchestrator, which then stops it here)."""
        return self.spawn_in(self.node_namespace(node), argv, env=env, stdout=stdout, stderr=stderr)

    def spawn_in(
        self,
        namespace: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        stdout: int | IO[bytes] | None = None,
        stderr: int | IO[bytes] | None = None,
    ) -> subprocess.Popen[bytes]:
        """:meth:`spawn` in any of this cluster's namespaces (e.g. :attr:`switch_namespace`, with
        :meth:`add_switch_address`): a service that belongs to no node. A node's process runs in its cgroup."""
        if namespace not in self.namespaces:
            raise ValueError(f"{namespace!r} is not one of this cluster's namespaces: {self.namespaces}")
        nodes = [node for node in range(self.num_nodes) if self.node_namespace(node) == namespace]
        group = self.node_cgroup(nodes[0]) if nodes else None
        proc = subprocess.Popen(
            ["ip", "netns", "exec", namespace, *argv],
            env=env, cwd=REPO_ROOT, stdout=stdout, stderr=stderr, start_new_session=True,
            preexec_fn=None if group is None else functools.partial(join, group),
        )
        self._processes.append(proc)
        return proc

    def add_switch_address(self) -> str:
        """Give the switch's bridge the node subnet's last address and return it: a host on the switch that
        every node reaches over its own (shaped) link, and that no node's failure takes down."""
        address = str(NODE_SUBNET.broadcast_address - 1)
        assert ipaddress.ip_address(address) in BENCHMARK_NETWORK
        _run(["ip", "-n", self.switch_namespace, "addr", "replace", f"{address}/{NODE_SUBNET.prefixlen}", "dev", BRIDGE])
        return address

    def forget(self, proc: RankProcess) -> None:
        """Stop tracking a process that has exited."""
        if proc in self._processes:
            self._processes.remove(proc)

    def stop(self, proc: RankProcess) -> None:
        self.stop_all([proc])

    def stop_all(self, procs: Sequence[RankProcess]) -> None:
        """Stop several processes at once: one grace period for all of them, not one after another (the ranks
        of a job, whose survivors may wait seconds in a collective for a rank that is already gone)."""
        _terminate_sessions(procs)
        for proc in procs:
            self.forget(proc)

    # ------------------------------------------------------------------ measurements
    def interface_bytes(self, node: int, ifname: str = UPLINK) -> dict[str, int]:
        """The kernel's byte counters of an interface inside node ``node``."""
        ns = self.node_namespace(node)
        out = _run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{ifname}/statistics/tx_bytes",
                    f"/sys/class/net/{ifname}/statistics/rx_bytes"]).stdout.split()
        return {"tx_bytes": int(out[0]), "rx_bytes": int(out[1])}

    def measure_throughput(self, flows: Sequence[tuple[int, int]], seconds: float, base_port: int = 47000) -> list[float]:
        """Run one TCP stream per ``(sender_node, receiver_node)`` flow, all at once, for ``seconds``;
        return each flow's receive rate in bytes/s. A flow with sender == receiver stays on ``lo``."""
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        servers: list[subprocess.Popen[bytes]] = []
        senders: list[subprocess.Popen[bytes]] = []
        with tempfile.TemporaryDirectory(prefix="micsbench-probe-") as tmp:
            try:
                for i, (_, receiver) in enumerate(flows):
                    ready = Path(tmp) / f"ready{i}"
                    servers.append(self.spawn(receiver, [sys.executable, "-m", "benchmarks.netprobe", "serve",
                                                         self.node_address(receiver), str(base_port + i),
                                                         "--ready-file", str(ready)],
                                              env=env, stdout=subprocess.PIPE))
                deadline = time.monotonic() + 30
                while not all((Path(tmp) / f"ready{i}").exists() for i in range(len(flows))):
                    if time.monotonic() > deadline:
                        raise RuntimeError("throughput probe servers did not start within 30 s")
                    time.sleep(0.05)
                for i, (sender, receiver) in enumerate(flows):
                    senders.append(self.spawn(sender, [sys.executable, "-m", "benchmarks.netprobe", "send",
                                                       self.node_address(receiver), str(base_port + i),
                                                       "--seconds", str(seconds)], env=env))
                rates = []
                for proc in senders:
                    proc.wait(timeout=seconds + 60)
                for proc in servers:
                    out, _ = proc.communicate(timeout=60)
                    result = json.loads(out.decode().strip().splitlines()[-1])
                    rates.append(result["bytes"] / max(result["seconds"], 1e-9))
                return rates
            finally:
                for proc in servers + senders:
                    self.stop(proc)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _terminate_sessions(procs: Sequence[RankProcess], grace_s: float = 5.0) -> None:
    """SIGTERM every process's session (each started with ``start_new_session``) at once, wait at most ``grace_s``
    for all of them together, then SIGKILL the sessions still running and reap them."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        running = [proc for proc in procs if proc.poll() is None]
        for proc in running:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
