"""CPUs of their own for the emulated cluster's nodes: one cpu cgroup per node, capped at (host cores / nodes).

Why: the emulated nodes are network namespaces on one host, and namespaces share the host's cores. Without a cap
a node that is lost lends its CPU to the survivors (they step as fast as the whole cluster did, although they read
its samples too), a node that starts imports on the cores the others train on, and a node that waits on the
network leaves its cores to the others instead of idle. A real node has its own CPUs and nothing else. So each
node's processes run in a cgroup of their own whose CFS bandwidth quota is the node's share of the host:

* cgroup v1 (``/sys/fs/cgroup/cpu/<name>/cpu.cfs_quota_us`` and ``cpu.cfs_period_us``) where the ``cpu``
  controller is mounted there, else cgroup v2 (``/sys/fs/cgroup/<name>/cpu.max``) where ``cpu`` is among the
  root's controllers;
* the period is short (:data:`PERIOD_US`, 20 ms), so that a node's CPU reads as a slower continuous CPU and not as
  a full one that stops for most of every 100 ms (the kernel's default period), which would hold every collective
  of the other nodes in turn;
* a process joins its node's cgroup before it runs anything (:func:`join`, from the child right after the fork),
  so its imports, threads and children are all billed to the node;
* :meth:`NodeCpuQuotas.teardown` moves what is left back to the root and removes the groups (it runs with the
  namespaces' teardown, also on errors and Ctrl-C).

Where the groups cannot be created (not root, no cpu controller, a read-only cgroup file system),
:func:`NodeCpuQuotas.create` raises :class:`CpuQuotaUnavailable` with the reason, and the benchmarks go on without
quotas and say so -- on the terminal and in their JSON (``settings.cpu_quota_per_node`` is then ``null`` and
``settings.cpu_quota_unavailable`` the reason).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: CFS bandwidth period of every node's group (microseconds): 20 ms, a fifth of the kernel's default.
PERIOD_US = 20_000
#: The kernel refuses quotas below 1 ms.
MIN_QUOTA_US = 1_000


class CpuQuotaUnavailable(RuntimeError):
    """The host cannot give the emulated nodes CPU quotas; the message says why and what would."""


def host_cores() -> int:
    """The cores this process may run on (its affinity mask), which the nodes split among themselves."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CgroupLayout:
    """Where cpu cgroups live on this host and how a quota is written there."""

    version: int  #: 1 or 2
    base: Path  #: the directory the node groups are created in

    @staticmethod
    def detect(root: Path = CGROUP_ROOT) -> CgroupLayout:
        """cgroup v1's ``cpu`` hierarchy where it is mounted, else v2 with the ``cpu`` controller; otherwise
        :class:`CpuQuotaUnavailable` naming what is missing."""
        v1 = root / "cpu"
        if (v1 / "cpu.cfs_quota_us").exists():
            return CgroupLayout(1, v1)
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            return CgroupLayout(2, root)
        raise CpuQuotaUnavailable(
            f"no cpu cgroup controller under {root}: neither cgroup v1's {v1}/cpu.cfs_quota_us nor cgroup v2's "
            f"'cpu' in {controllers} (mount the cpu controller, e.g. `mount -t cgroup -o cpu cgroup {v1}`)"
        )

    def write_quota(self, group: Path, quota_us: int, period_us: int) -> None:
        if self.version == 1:
            (group / "cpu.cfs_period_us").write_text(str(period_us))
            (group / "cpu.cfs_quota_us").write_text(str(quota_us))
        else:
            (group / "cpu.max").write_text(f"{quota_us} {period_us}")

    def enable_controller(self) -> None:
        """cgroup v2 gives a child group the cpu controller only once its parent delegates it."""
        if self.version == 2:
            control = self.base / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")


def join(group: Optional[str]) -> None:
    """Move the calling process into the cgroup directory ``group`` (``None``: stay). Called in a child between its
    fork and anything it runs, so that everything it does is billed to its node."""
    if group is not None:
        Path(group, "cgroup.procs").write_text("0")  # "0": the writing process itself (v1 and v2)


class NodeCpuQuotas:
    """One cpu cgroup per emulated node, each allowed ``cores_per_node`` cores (default: host cores / nodes)."""

    def __init__(self, prefix: str, num_nodes: int, cores_per_node: Optional[float] = None,
                 root: Path = CGROUP_ROOT) -> None:
        cores = host_cores() / num_nodes if cores_per_node is None else cores_per_node
        if cores <= 0:
            raise ValueError(f"cores_per_node must be positive, got {cores}")
        self.prefix = prefix
        self.num_nodes = num_nodes
        self.cores_per_node = cores
        self.root = root
        self._layout: Optional[CgroupLayout] = None

    @property
    def quota_us(self) -> int:
        return max(MIN_QUOTA_US, round(self.cores_per_node * PERIOD_US))

    @property
    def active(self) -> bool:
        return self._layout is not None

    def _path(self, layout: CgroupLayout, node: int) -> Path:
        return layout.base / f"{self.prefix}-node{node}"

    def group(self, node: int) -> Optional[str]:
        """Node ``node``'s cgroup directory (what :func:`join` takes), ``None`` until :meth:`create` succeeded."""
        if self._layout is None:
            return None
        return str(self._path(self._layout, node))

    def create(self) -> None:
        """Create (or take over from a killed run) every node's group and write its quota; on any failure remove
        what was made and raise :class:`CpuQuotaUnavailable` with the reason."""
        layout = CgroupLayout.detect(self.root)
        try:
            layout.enable_controller()
            for node in range(self.num_nodes):
                path = self._path(layout, node)
                path.mkdir(exist_ok=True)
                layout.write_quota(path, self.quota_us, PERIOD_US)
        except OSError as error:
            self._layout = layout
            self.teardown()
            raise CpuQuotaUnavailable(
                f"cannot write a cpu cgroup quota under {layout.base} ({error.strerror or error}): run as root on a "
                "host whose cgroup file system is writable"
            ) from error
        self._layout = layout

    def remove_stale(self, is_stale: Callable[[str], bool]) -> list[str]:
        """Remove the empty cpu cgroups beside this cluster's whose name ``is_stale`` (left by a run killed hard);
        return their names. A group that still holds processes stays."""
        try:
            base = CgroupLayout.detect(self.root).base
        except CpuQuotaUnavailable:
            return []
        removed = []
        for path in base.iterdir():
            if path.is_dir() and is_stale(path.name) and not (path / "cgroup.procs").read_text().strip():
                try:
                    path.rmdir()
                    removed.append(path.name)
                except OSError:
                    pass
        return removed

    def throttled_seconds(self, node: int) -> Optional[float]:
        """How long node ``node``'s group was held back by its quota so far."""
        group = self.group(node)
        if group is None:
            return None
        for line in Path(group, "cpu.stat").read_text().splitlines():
            name, value = line.split()
            if name == "throttled_time":  # v1, nanoseconds
                return int(value) / 1e9
            if name == "throttled_usec":  # v2
                return int(value) / 1e6
        return None

    def teardown(self, timeout_s: float = 5.0) -> None:
        """Move every process still in a node group to the root group, then remove the groups. Safe to repeat."""
        layout, self._layout = self._layout, None
        if layout is None:
            return
        for node in range(self.num_nodes):
            path = self._path(layout, node)
            if not path.exists():
                continue
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    for pid in (path / "cgroup.procs").read_text().split():
                        try:
                            (layout.base / "cgroup.procs").write_text(pid)
                        except OSError:  # it exited meanwhile
                            pass
                    path.rmdir()
                    break
                except OSError as error:
                    if time.monotonic() > deadline:
                        print(f"warning: could not remove the cgroup {path} ({error}); `rmdir {path}` once its "
                              "processes have ended", file=sys.stderr)
                        break
                    time.sleep(0.05)
