"""The region level of the emulated cluster (:class:`benchmarks.netns.EmulatedCluster` with ``nodes_per_region``):
which node belongs to which region, the names of the region bridges and links, the ``ip`` commands that build them
in the switch namespace, and how a rank reads the region links' byte counters.

Why a level of its own: a job that spans regions (zones, data centres) has two inter-node rates -- the nodes of one
region share a fast network, the regions are joined by a slower link that every crossing byte of a region shares.
Two-level DiLoCo (``diloco_worker_size="region"``) is built for exactly that, so the emulation needs both rates,
each shaped and counted on its own. Layout (two regions of two nodes)::

    <prefix>-switch
      rbr0 (region 0's bridge): port0, port1, rlink0 ==veth== rcore0 ┐
      rbr1 (region 1's bridge): port2, port3, rlink1 ==veth== rcore1 ┴ br0 (the core bridge)

Each ``rlink<r>``/``rcore<r>`` pair is region ``r``'s link: tbf on ``rlink<r>`` limits what the region sends, on
``rcore<r>`` what it receives (the node links keep their own tbf on ``uplink``/``port<i>``). A byte from a node to
a node of another region enters the receiving region's link once and its node's uplink once, so the bytes inside a
region across nodes are what the node uplinks received less what the region links received. (Received, not sent:
a packet the slower region link's tbf drops was sent on a node uplink but never arrives, and its retransmission is
sent again -- counting sent bytes would book every drop at the region link as traffic inside a region.)

Everything here is pure (names, commands, parsing): the tests check the layout without root.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

#: The core bridge of a cluster with regions has the one-bridge cluster's name, so that the switch's own address
#: (:meth:`~benchmarks.netns.EmulatedCluster.add_switch_address`) sits where every region reaches it.
CORE_BRIDGE = "br0"
#: Environment variable that tells a rank where to read the region links' counters: ``/proc/<pid>/net/dev`` of a
#: process in the switch namespace (``/proc`` is the host's in every namespace; ``/sys`` is not).
REGION_COUNTERS_ENV = "MICS_BENCH_REGION_COUNTERS"


def region_bridge(region: int) -> str:
    return f"rbr{region}"


def region_link(region: int) -> str:
    """Region ``region``'s end of its link (on its bridge): its tx is what the region sends to the others."""
    return f"rlink{region}"


def core_port(region: int) -> str:
    """The core bridge's end of region ``region``'s link: its tx is what the region receives."""
    return f"rcore{region}"


@dataclass(frozen=True)
class RegionLayout:
    """``num_nodes`` nodes in regions of ``nodes_per_region`` consecutive nodes (node ``i`` in region
    ``i // nodes_per_region``, as ranks tile nodes)."""

    num_nodes: int
    nodes_per_region: int

    def __post_init__(self) -> None:
        per = self.nodes_per_region
        if isinstance(per, bool) or not isinstance(per, int) or per < 1 or self.num_nodes % per:
            raise ValueError(
                f"nodes_per_region={per!r} must be a positive int dividing the {self.num_nodes} nodes: every region "
                "holds the same number of whole nodes."
            )
        if per == self.num_nodes:
            raise ValueError(f"nodes_per_region={per} puts all {self.num_nodes} nodes in one region: pass None.")

    @property
    def regions(self) -> int:
        return self.num_nodes // self.nodes_per_region

    def region_of(self, node: int) -> int:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} is not one of the {self.num_nodes} nodes.")
        return node // self.nodes_per_region

    def nodes_of(self, region: int) -> list[int]:
        start = region * self.nodes_per_region
        return list(range(start, start + self.nodes_per_region))

    def port_bridge(self, node: int) -> str:
        """The bridge node ``node``'s port joins: its region's."""
        return region_bridge(self.region_of(node))

    def switch_commands(self, switch: str, mtu: int) -> list[list[str]]:
        """The ``ip`` commands that build the core bridge, one bridge per region and one link per region between
        them, all inside ``switch`` (both ends of every veth are created there: nothing appears on the host)."""
        commands = [["ip", "-n", switch, "link", "add", CORE_BRIDGE, "type", "bridge"],
                    ["ip", "-n", switch, "link", "set", CORE_BRIDGE, "up"]]
        for region in range(self.regions):
            bridge, near, far = region_bridge(region), region_link(region), core_port(region)
            commands += [
                ["ip", "-n", switch, "link", "add", bridge, "type", "bridge"],
                ["ip", "-n", switch, "link", "set", bridge, "up"],
                ["ip", "-n", switch, "link", "add", near, "mtu", str(mtu), "type", "veth", "peer", "name", far,
                 "mtu", str(mtu)],
                ["ip", "-n", switch, "link", "set", near, "master", bridge],
                ["ip", "-n", switch, "link", "set", far, "master", CORE_BRIDGE],
                ["ip", "-n", switch, "link", "set", near, "up"],
                ["ip", "-n", switch, "link", "set", far, "up"],
            ]
        return commands

    def shaped_devices(self) -> list[str]:
        """The switch namespace's devices a region shape applies to: both ends of every region link."""
        return [dev for region in range(self.regions) for dev in (region_link(region), core_port(region))]

    def probe_pairs(self) -> list[tuple[int, int]]:
        """(sender, receiver) nodes the set-up probes with: inside region 0 (when it has two nodes) and from the last
        region to node 0 (across a region link)."""
        pairs = [(1, 0)] if self.nodes_per_region > 1 else []
        return pairs + [(self.num_nodes - 1, 0)]


def region_layout(num_nodes: int, nodes_per_region: Optional[int]) -> Optional[RegionLayout]:
    """The layout, or ``None`` for one region (``nodes_per_region`` ``None`` or all the nodes): today's one bridge."""
    if nodes_per_region is None or nodes_per_region == num_nodes:
        return None
    return RegionLayout(num_nodes, nodes_per_region)


_DEV_LINE = re.compile(r"^\s*([^:\s]+):\s*(.*)$")


def parse_net_dev(text: str) -> dict[str, dict[str, int]]:
    """``/proc/<pid>/net/dev`` as ``{interface: {"rx_bytes", "tx_bytes"}}`` (receive bytes are the first column,
    transmit bytes the ninth)."""
    out = {}
    for line in text.splitlines():
        match = _DEV_LINE.match(line)
        if match is None or "|" in line:
            continue
        fields = match[2].split()
        if len(fields) >= 9:
            out[match[1]] = {"rx_bytes": int(fields[0]), "tx_bytes": int(fields[8])}
    return out


def region_counters(path: str | Path | None) -> dict[str, int]:
    """Every region link's counters as flat keys ``region<r>_tx`` / ``region<r>_rx`` (what region ``r`` sent to
    and received from the others), read from ``path`` (:data:`REGION_COUNTERS_ENV`'s); ``{}`` without one."""
    if not path:
        return {}
    devices = parse_net_dev(Path(path).read_text())
    out: dict[str, int] = {}
    region = 0
    while region_link(region) in devices:
        counters = devices[region_link(region)]
        out[f"region{region}_tx"], out[f"region{region}_rx"] = counters["tx_bytes"], counters["rx_bytes"]
        region += 1
    return out


def region_deltas(start: dict[str, float], end: dict[str, float]) -> Optional[dict[str, list[float]]]:
    """Per region, the bytes it sent to (``tx``) and received from (``rx``) the other regions between two counter
    readings; ``None`` when they hold no region counters."""
    regions = sorted(int(key[6:-3]) for key in end if key.startswith("region") and key.endswith("_tx"))
    if not regions:
        return None
    return {direction: [end[f"region{r}_{direction}"] - start[f"region{r}_{direction}"] for r in regions]
            for direction in ("tx", "rx")}
