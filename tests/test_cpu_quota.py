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

#: counts loop iterations for ``seconds``, printing the count every 0.25 s
SPINNER = """
import sys, time
counts = 0
end = time.monotonic() + float(sys.argv[1])
mark = time.monotonic() + 0.25
while time.monotonic() < end:
    counts += 1
    if time.monotonic() >= mark:
        print(time.monotonic(), counts, flush=True)
        mark += 0.25
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


def _rates(lines: list[str], start: float, end: float) -> float:
    """Loop iterations per second between ``start`` and ``end`` (monotonic seconds) from a spinner's output."""
    points = [(float(t), int(c)) for t, c in (line.split() for line in lines)]
    inside = [p for p in points if start <= p[0] <= end]
    (t0, c0), (t1, c1) = inside[0], inside[-1]
    return (c1 - c0) / (t1 - t0)


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups need root")
def test_a_lost_nodes_cpu_is_not_lent_to_the_survivors(tmp_path: Path) -> None:
    """Three CPU-bound 'nodes' on the host's cores; one is killed. Sharing the cores, each survivor would speed up
    by about 3/2 on 2 cores; under the per-node quota its rate stays where it was. The quotas are a fraction of the
    host's share (0.2 cores each), so that they, not other tenants' load, bound the rates before the kill too."""
    quotas = NodeCpuQuotas(f"micsquotatest-{uuid.uuid4().hex[:8]}", 3, cores_per_node=0.2)
    try:
        quotas.create()
    except CpuQuotaUnavailable as error:
        pytest.skip(str(error))
    script = tmp_path / "spin.py"
    script.write_text(SPINNER)
    procs: list[subprocess.Popen[str]] = []
    try:
        for node in range(3):
            group = quotas.group(node)
            procs.append(subprocess.Popen([sys.executable, str(script), "4.5"], stdout=subprocess.PIPE, text=True,
                                          start_new_session=True, preexec_fn=lambda g=group: join(g)))
        time.sleep(0.3)
        for node, proc in enumerate(procs):
            assert str(proc.pid) in Path(quotas.group(node), "cgroup.procs").read_text().split()
        began = time.monotonic()
        time.sleep(2.0)
        os.killpg(procs[2].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        outputs = [proc.communicate(timeout=30)[0].splitlines() for proc in procs[:2]]
        procs[2].wait(timeout=30)
        for lines in outputs:
            before = _rates(lines, began + 0.5, killed_at)
            after = _rates(lines, killed_at + 0.3, killed_at + 2.2)
            assert after / before < 1.2, (before, after)  # 1.5 with the cores shared (2 cores), 3 with one
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
