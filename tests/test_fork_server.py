"""``benchmarks/fork_server.py``: a rank forked from the server behaves as a spawned one would -- its module runs as
``__main__`` with its own arguments, environment, working directory and log, in a session of its own, its exit code
reported as ``Popen`` does; a request it cannot honour is refused naming why; as root, the cgroup and the network
and UTS namespaces asked for are entered.

A forked rank's session is killed with ``os.killpg``. The server preloads only ``json`` here: the mechanics, not the
imports."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.fork_server import ForkedProcess, ForkServer

PROBE = '''
import json, os, socket, sys
mode = sys.argv[1]
if mode == "hang":
    open(sys.argv[2], "w").close()
    import time
    time.sleep(600)
if mode == "raise":
    raise ValueError("the probe failed on purpose")
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "value": os.environ.get("PROBE_VALUE"),
                  "own_session": os.getsid(0) == os.getpid(), "hostname": socket.gethostname(),
                  "interfaces": sorted(name for _, name in socket.if_nameindex()), "main": __name__,
                  "sys_class_net": sorted(os.listdir("/sys/class/net"))}))
sys.exit(int(mode))
'''


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[ForkServer, dict[str, str], Path]]:
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "fork_probe.py").write_text(PROBE)
    repo = Path(__file__).resolve().parents[1]
    environment = {**os.environ, "PYTHONPATH": f"{modules}{os.pathsep}{repo}", "OMP_NUM_THREADS": "1",
                   "PYTHONWARNINGS": "ignore"}
    started = ForkServer(tmp_path / "socket", environment, preload=["json"])
    try:
        started.wait_until_ready(timeout=60)
        yield started, environment, tmp_path
    finally:
        started.process.terminate()
        started.process.wait(timeout=30)


def _start(server: ForkServer, environment: dict[str, str], log: Path, *args: str, **where: Any) -> ForkedProcess:
    with log.open("wb") as handle:
        return server.start([sys.executable, "-m", "fork_probe", *args], environment, log.parent, handle.fileno(),
                            **where)


def test_a_forked_rank_runs_its_module_as_main_with_its_own_arguments_environment_and_exit_code(server) -> None:
    fork_server, environment, tmp = server
    work = tmp / "work"
    work.mkdir()
    log = work / "rank.log"
    proc = _start(fork_server, {**environment, "PROBE_VALUE": "seven"}, log, "3")
    assert proc.wait(timeout=60) == 3 and proc.poll() == 3
    record = json.loads(log.read_text().splitlines()[-1])
    assert record["argv"][1:] == ["3"] and record["main"] == "__main__"
    assert record["value"] == "seven" and record["cwd"] == str(work) and record["own_session"]
    assert record["hostname"] == socket.gethostname()  # no hostname asked: the server's


def test_an_exception_ends_the_rank_with_code_1_and_its_traceback_in_the_log(server) -> None:
    fork_server, environment, tmp = server
    proc = _start(fork_server, environment, tmp / "raise.log", "raise")
    assert proc.wait(timeout=60) == 1
    assert "ValueError: the probe failed on purpose" in (tmp / "raise.log").read_text()


def test_a_rank_killed_through_its_session_reports_the_signal_and_the_server_serves_on(server) -> None:
    fork_server, environment, tmp = server
    ready = tmp / "hanging"
    proc = _start(fork_server, environment, tmp / "hang.log", "hang", str(ready))
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert _start(fork_server, environment, tmp / "after.log", "0").wait(timeout=60) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="joining a cgroup needs root")
def test_a_forked_rank_joins_the_cgroup_its_request_names_before_it_runs(server) -> None:
    """A forked rank is billed to its node's CPU quota from its first instruction: it joins the cgroup its request
    names before its module runs (the emulated nodes' CPUs of their own, benchmarks/cpu_quota.py)."""
    from benchmarks.cpu_quota import CpuQuotaUnavailable, NodeCpuQuotas

    fork_server, environment, tmp = server
    quotas = NodeCpuQuotas(f"micsforktest-{uuid.uuid4().hex[:8]}", 1, cores_per_node=0.5)
    try:
        quotas.create()
    except CpuQuotaUnavailable as error:
        pytest.skip(str(error))
    try:
        group = quotas.group(0)
        assert group is not None
        proc = _start(fork_server, environment, tmp / "hang.log", "hang", str(tmp / "started"), cgroup=group)
        deadline = time.monotonic() + 30
        while not (tmp / "started").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        assert str(proc.pid) in Path(group, "cgroup.procs").read_text().split()
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        quotas.teardown()
    assert not Path(group).exists()


def test_a_request_whose_startup_variables_differ_is_refused_with_the_names(server) -> None:
    fork_server, environment, tmp = server
    with pytest.raises(RuntimeError, match="OMP_NUM_THREADS differ from the fork server's"):
        _start(fork_server, {**environment, "OMP_NUM_THREADS": "4"}, tmp / "refused.log", "0")
    with pytest.raises(RuntimeError, match="no network namespace 'micsfork-none'"):
        _start(fork_server, environment, tmp / "refused.log", "0", namespace="micsfork-none")
    with pytest.raises(ValueError, match="runs modules"):
        fork_server.start([sys.executable, "script.py"], environment, tmp, 1)


def test_the_server_refuses_to_start_once_an_import_started_a_thread(tmp_path: Path) -> None:
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-m", "benchmarks.fork_server", "serve", "--socket",
                             str(tmp_path / "socket"), "--preload", "starts_a_thread"],
                            env={**os.environ, "PYTHONPATH": f"{modules}{os.pathsep}{repo}"},
                            capture_output=True, text=True, timeout=60, cwd=repo)
    assert result.returncode == 1 and "2 threads after importing starts_a_thread" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="entering namespaces needs root")
def test_a_rank_enters_the_network_namespace_and_gets_the_hostname_it_asks_for(server) -> None:
    fork_server, environment, tmp = server
    namespace = f"micsfork-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        proc = _start(fork_server, environment, tmp / "ns.log", "0", namespace=namespace, hostname="198.18.0.9")
        assert proc.wait(timeout=60) == 0
        record = json.loads((tmp / "ns.log").read_text().splitlines()[-1])
        assert record["interfaces"] == ["lo"]  # a fresh namespace has only its loopback
        assert record["sys_class_net"] == ["lo"]  # and /sys shows it, as under `ip netns exec`
        assert "lo" in os.listdir("/sys/class/net") and len(os.listdir("/sys/class/net")) > 1  # the host's untouched
        assert record["hostname"] == "198.18.0.9"
        assert socket.gethostname() != "198.18.0.9"  # the test's own (and the server's) name is untouched
    finally:
        subprocess.run(["ip", "netns", "del", namespace], check=False)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and iproute2")
def test_an_emulated_cluster_starts_a_rank_alike_fresh_or_forked_and_its_teardown_stops_both(tmp_path: Path) -> None:
    """``EmulatedCluster.spawn_rank``: a fresh rank (``ip netns exec`` + ``unshare --uts``) and a forked one see the
    same node -- its interfaces, the hostname asked for; the teardown stops a forked rank still running and then
    the server, leaving no process and no socket directory."""
    from benchmarks.netns import REPO_ROOT, EmulatedCluster, rank_environment

    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "fork_probe.py").write_text(PROBE)
    environment = rank_environment(PYTHONPATH=f"{modules}{os.pathsep}{REPO_ROOT}")
    records = {}
    with EmulatedCluster(2, prefix=f"mf{uuid.uuid4().hex[:6]}") as cluster:
        address = cluster.node_address(1)
        for how in ("fresh", "forked"):
            if how == "forked":
                cluster.start_fork_server(preload=["json"], environment=environment)
            with (tmp_path / f"{how}.log").open("wb") as log:
                proc = cluster.spawn_rank(1, [sys.executable, "-m", "fork_probe", "0"], environment, log,
                                          hostname=address)
            assert proc.wait(timeout=60) == 0, (tmp_path / f"{how}.log").read_text()
            records[how] = json.loads((tmp_path / f"{how}.log").read_text().splitlines()[-1])
        server = cluster._fork_server
        assert server is not None
        ready = tmp_path / "hanging"
        with (tmp_path / "hang.log").open("wb") as log:
            hanging = cluster.spawn_rank(0, [sys.executable, "-m", "fork_probe", "hang", str(ready)], environment, log)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and hanging.poll() is None
            time.sleep(0.02)
    for how, record in records.items():
        assert record["hostname"] == address and record["sys_class_net"] == ["lo", "uplink"], (how, record)
    assert records["fresh"]["interfaces"] == records["forked"]["interfaces"]
    assert hanging.poll() is not None and server.process.poll() is not None
    assert not server.socket_path.parent.exists()
