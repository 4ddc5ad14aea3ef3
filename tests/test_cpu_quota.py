"""``benchmarks/cpu_quota.py``: the emulated nodes' CPUs of their own. A node's cgroup caps what its processes use
at its share of the host, so a lost node's CPU is not lent to the survivors; a host without writable cgroups is
told so in one message; teardown leaves no group behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from benchmarks.cpu_quota import PERIOD_US, CgroupLayout, CpuQuotaUnavailable, NodeCpuQuotas, host_cores, join

#: spins for ``seconds``
SPINNER = """
import sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
"""


def test_a_host_without_a_cpu_controller_is_refused_with_what_to_mount(tmp_path: Path) -> None:
    with pytest.raises(CpuQuotaUnavailable, match=r"no cpu cgroup controller .*cpu.cfs_quota_us.*mount"):
        CgroupLayout.detect(tmp_path)
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    with pytest.raises(CpuQuotaUnavailable, match="cgroup v2's 'cpu'"):
        CgroupLayout.detect(tmp_path)
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    assert CgroupLayout.detect(tmp_path) == CgroupLayout(2, tmp_path)


def test_the_quota_is_the_nodes_share_of_the_host() -> None:
    quotas = NodeCpuQuotas("x", 3)
    assert quotas.cores_per_node == pytest.approx(host_cores() / 3)
    assert quotas.quota_us == round(host_cores() / 3 * PERIOD_US)
    assert quotas.group(0) is None and not quotas.active  # nothing before create()
    with pytest.raises(ValueError, match="cores_per_node must be positive"):
        NodeCpuQuotas("x", 2, cores_per_node=0)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` used so far (``/proc/<pid>/stat``, clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups need root")
def test_a_lost_nodes_cpu_is_not_lent_to_the_survivors(tmp_path: Path) -> None:
    """Three CPU-bound 'nodes' on the host's cores; one is killed. Sharing the cores, each survivor would get about
    3/2 of the CPU time it had on 2 cores; under the per-node quota it gets what it had. CPU time, not work done,
    is what is lent (two spinners on sibling hyperthreads do less work per CPU second than one alone). The quotas
    are a fraction of the host's share (0.2 cores each), so that they, not other tenants' load, bound the spinners
    before the kill too."""
    quotas = NodeCpuQuotas(f"micsquotatest-{uuid.uuid4().hex[:8]}", 3, cores_per_node=0.2)
    try:
        quotas.create()
    except CpuQuotaUnavailable as error:
        pytest.skip(str(error))
    script = tmp_path / "spin.py"
    script.write_text(SPINNER)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for node in range(3):
            group = quotas.group(node)
            procs.append(subprocess.Popen([sys.executable, str(script), "6"], start_new_session=True,
                                          preexec_fn=lambda g=group: join(g)))
        time.sleep(0.5)
        for node, proc in enumerate(procs):
            assert str(proc.pid) in Path(quotas.group(node), "cgroup.procs").read_text().split()

        def shares(seconds: float) -> list[float]:  # each survivor's CPU seconds per second over ``seconds``
            before, began = [_cpu_seconds(p.pid) for p in procs[:2]], time.monotonic()
            time.sleep(seconds)
            elapsed = time.monotonic() - began
            return [(_cpu_seconds(p.pid) - b) / elapsed for p, b in zip(procs[:2], before)]

        with_three = shares(2.0)
        os.killpg(procs[2].pid, signal.SIGKILL)
        procs[2].wait(timeout=30)
        time.sleep(0.2)
        with_two = shares(2.0)
        for before, after in zip(with_three, with_two):
            assert after <= 0.2 * 1.15 and after / before < 1.2, (with_three, with_two)  # 1.5 with shared cores
        throttled = quotas.throttled_seconds(0)
        assert throttled is not None and throttled > 0  # the quota did hold the node back
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        groups = [quotas.group(node) for node in range(3)]
        quotas.teardown()
    assert not any(Path(group).exists() for group in groups)
    quotas.teardown()  # twice is harmless
