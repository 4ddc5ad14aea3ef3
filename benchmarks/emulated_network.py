"""The emulated cluster's network: its links' command-line options, the loopback calibration, the shaping of
the node links and the measurement of the shaped link -- and, on a cluster with regions, of the region links
(:func:`set_up_regions`, :class:`RegionSettings`).

Both benchmarks on the emulated network (``emulated_cluster.py``, ``fault_tolerance.py``) build their links with
:func:`add_link_arguments`, :func:`link_request` and :func:`set_up_network`, so a setting added for one cannot be
missing from the other. Here because the links are one concern of their own: the inter-node rate is derived from a
measurement of this host (:func:`measure_gloo_loopback`), not a constant, and every report records it
(:class:`NetworkSettings`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Optional

from benchmarks.comm_model import RingCollective, fsdp2_unit_numel, gloo_wire_bytes, gpt_fsdp_units
from benchmarks.netns import REPO_ROOT, UPLINK, EmulatedCluster, LinkShape
from benchmarks.scenarios import ClusterShape, TrainingSetup

#: Ports of the runs' rendezvous: a strategy row's ``MASTER_PORT`` is this plus its index, the gloo loopback
#: probe's (one per node) just below it.
MASTER_PORT_BASE = 29600
#: The inter-node rate is the measured loopback throughput over this, unless told otherwise (15: the cloud ratio
#: of the MiCS paper).
DEFAULT_BANDWIDTH_RATIO = 15.0


@dataclass(frozen=True)
class NetworkSettings:
    loopback_single_stream_bytes_per_s: float  #: one raw TCP stream on one node, nothing else running
    loopback_tcp_per_node_bytes_per_s: float  #: raw TCP, ranks_per_node streams on every node at once
    loopback_gloo_per_node_bytes_per_s: float  #: gloo all-reduces, ranks_per_node ranks on every node at once
    calibration: str  #: which loopback number the inter-node rate is derived from ("gloo" or "tcp")
    #: That number (per node): the intra-node bandwidth of the emulated cluster (read by compare_planner.py).
    loopback_per_node_bytes_per_s: float
    inter_node_rate_bytes_per_s: float  #: the configured tbf rate, per direction
    inter_node_measured_bytes_per_s: float  #: one TCP stream across the shaped link
    mtu: int


CALIBRATIONS = ("gloo", "tcp")


@dataclass(frozen=True)
class LinkRequest:
    """Everything :func:`set_up_network` needs, and nothing else: built by :func:`link_request` from a command
    line that :func:`add_link_arguments` extended. Both benchmarks on the emulated network
    (``emulated_cluster.py``, ``fault_tolerance.py``) go through these two functions, so a setting added for one
    cannot be missing from the other (``fault_tolerance.py`` once crashed on an attribute only this parser set).
    """

    setup: TrainingSetup  #: the model whose largest unit is the gloo loopback probe's payload
    probe_seconds: float  #: how long each throughput probe runs
    calibrate: str  #: which loopback throughput the inter-node rate is derived from: "gloo" or "tcp"
    bandwidth_ratio: float  #: inter-node rate = that loopback throughput / this
    inter_node_mbps: Optional[float]  #: an explicit inter-node rate in MB/s instead of the ratio
    mtu: int  #: MTU of the node links
    #: a link rate kept from an earlier run (``--scaling``'s later points) instead of the one the settings give
    fixed_rate_bytes_per_s: Optional[float] = None

    def __post_init__(self) -> None:
        if self.calibrate not in CALIBRATIONS:
            raise ValueError(f"--calibrate must be one of {', '.join(CALIBRATIONS)}, got {self.calibrate!r}.")
        if self.bandwidth_ratio <= 0:
            raise ValueError(f"--bandwidth-ratio must be positive, got {self.bandwidth_ratio}.")
        if self.inter_node_mbps is not None and self.inter_node_mbps <= 0:
            raise ValueError(f"--inter-node-mbps must be positive, got {self.inter_node_mbps}.")
        if self.probe_seconds <= 0:
            raise ValueError(f"the throughput probes need a positive duration, got {self.probe_seconds} s.")
        if self.mtu < 68:  # the kernel's IPv4 minimum: `ip link set mtu` would fail with a bare "Invalid argument"
            raise ValueError(f"--mtu must be at least 68, got {self.mtu}.")


def add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line options of the emulated network's links, for every benchmark that builds one."""
    parser.add_argument("--bandwidth-ratio", type=float,
                        help="inter-node rate = measured per-node loopback throughput / this (default "
                             f"{DEFAULT_BANDWIDTH_RATIO:g}; 240: a cross-region link)")
    parser.add_argument("--calibrate", choices=CALIBRATIONS, default="gloo",
                        help="loopback throughput to divide: what gloo all-reduces achieve with all ranks of all "
                             "nodes at once (default), or raw TCP streams (an upper bound gloo ranks never reach)")
    parser.add_argument("--inter-node-mbps", type=float,
                        help="inter-node rate in MB/s (10^6 bytes/s per direction), instead of the ratio")
    parser.add_argument("--mtu", type=int, default=9000,
                        help="MTU of the node links (default 9000, cloud jumbo frames)")


def link_request(
    args: argparse.Namespace, setup: TrainingSetup, probe_seconds: float,
    fixed_rate_bytes_per_s: Optional[float] = None,
) -> LinkRequest:
    """The :class:`LinkRequest` of a command line parsed with :func:`add_link_arguments`'s options; a bad value
    raises ``ValueError`` naming the option (parsers turn it into their usage error)."""
    ratio = DEFAULT_BANDWIDTH_RATIO if args.bandwidth_ratio is None else args.bandwidth_ratio
    return LinkRequest(setup=setup, probe_seconds=probe_seconds, calibrate=args.calibrate,
                       bandwidth_ratio=ratio, inter_node_mbps=args.inter_node_mbps, mtu=args.mtu,
                       fixed_rate_bytes_per_s=fixed_rate_bytes_per_s)


def set_up_network(cluster: EmulatedCluster, shape: ClusterShape, link: LinkRequest) -> NetworkSettings:
    """Measure loopback (raw TCP and gloo), shape the links, measure the shaped link; print as it goes.

    The inter-node rate is ``1 / --bandwidth-ratio`` of the *gloo* loopback throughput by default:
    that is the intra-node bandwidth the ranks' collectives actually get on this host (all nodes
    share its cores), just as the cloud ratio compares what collectives get inside and across
    nodes. Raw TCP streams move several times more, so a rate derived from them would make the
    emulated network far flatter than the cloud it stands for.
    """
    seconds = link.probe_seconds
    single = cluster.measure_throughput([(0, 0)], seconds)[0]
    flows = [(node, node) for node in range(shape.num_nodes) for _ in range(shape.ranks_per_node)]
    tcp_per_node = sum(cluster.measure_throughput(flows, seconds)) / shape.num_nodes
    gloo_per_node = measure_gloo_loopback(cluster, shape, link.setup, seconds)
    print(f"intra-node loopback: raw TCP {_gbit(single)} one stream alone, {_gbit(tcp_per_node)} per node with "
          f"{shape.ranks_per_node} streams on each of the {shape.num_nodes} nodes at once; gloo all-reduce "
          f"{_gbit(gloo_per_node)} per node with {shape.ranks_per_node} ranks on every node at once")
    reference = gloo_per_node if link.calibrate == "gloo" else tcp_per_node
    rate = link.inter_node_mbps * 1e6 if link.inter_node_mbps else reference / link.bandwidth_ratio
    how = ("set by --inter-node-mbps" if link.inter_node_mbps
           else f"1/{link.bandwidth_ratio:g} of the per-node {link.calibrate} loopback throughput")
    if link.fixed_rate_bytes_per_s is not None:  # --scaling: every node count gets the first point's link
        rate = link.fixed_rate_bytes_per_s
        how = "the rate of the scaling run's first point, kept for every node count"
    cluster.shape(LinkShape(rate))
    measured = cluster.measure_throughput([(1, 0)], seconds)[0]
    print(f"inter-node link: tbf {_gbit(rate)} per direction ({how}); one TCP stream measures {_gbit(measured)}")
    return NetworkSettings(single, tcp_per_node, gloo_per_node, link.calibrate, reference, rate, measured, link.mtu)


def measure_gloo_loopback(cluster: EmulatedCluster, shape: ClusterShape, setup: TrainingSetup, seconds: float) -> float:
    """Loopback bytes per second per node while every node's ranks all-reduce one model unit's
    worth of fp32 over gloo (:mod:`benchmarks.gloo_probe`), all nodes at once."""
    payload = max(fsdp2_unit_numel(u, 1) for u in gpt_fsdp_units(setup.model)) * 4
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "GLOO_SOCKET_IFNAME": UPLINK, "OMP_NUM_THREADS": "1"}
    leaders: list[subprocess.Popen[bytes]] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for node in range(shape.num_nodes):
            init = f"tcp://{cluster.node_address(node)}:{MASTER_PORT_BASE - 10 - node}"
            for local in range(shape.ranks_per_node):
                argv = [sys.executable, "-m", "benchmarks.gloo_probe", "--rank", str(local), "--world",
                        str(shape.ranks_per_node), "--init", init, "--payload-bytes", str(payload),
                        "--seconds", str(seconds)]
                # stderr dropped: c10d warns about the namespaces' missing hostnames, harmlessly
                proc = cluster.spawn(node, argv, env=env, stdout=subprocess.PIPE if local == 0 else subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
                procs.append(proc)
                if local == 0:
                    leaders.append(proc)
        rates = []
        for leader in leaders:
            out, _ = leader.communicate(timeout=120 + 10 * seconds)
            if not out.strip():
                raise RuntimeError(
                    f"the gloo loopback probe failed (exit code {leader.returncode}); run "
                    "`python -m benchmarks.gloo_probe --help` and check that torch.distributed works, "
                    "or use --calibrate tcp / --inter-node-mbps"
                )
            result = json.loads(out.decode().strip().splitlines()[-1])
            node_ranks = tuple(range(result["ranks"]))  # node-local ring: every edge is loopback
            per_call = gloo_wire_bytes(RingCollective("all_reduce", node_ranks, result["payload_bytes"]),
                                       ClusterShape(2, result["ranks"])).intra_node
            rates.append(per_call * result["iterations"] / result["seconds"])
        return sum(rates) / len(rates)
    finally:
        for proc in procs:
            cluster.stop(proc)


@dataclass(frozen=True)
class RegionSettings:
    """The region level of a cluster with regions (``--regions``): how many, their size and their links' rate."""

    regions: int
    nodes_per_region: int
    region_bandwidth_ratio: float  #: region link rate = the per-node loopback throughput / this
    region_rate_bytes_per_s: float  #: the configured tbf rate of every region link, per direction
    region_measured_bytes_per_s: float  #: one TCP stream from the last region to node 0, across a region link


def set_up_regions(cluster: EmulatedCluster, network: NetworkSettings, ratio: float, seconds: float) -> RegionSettings:
    """Shape every region link to ``1 / ratio`` of the loopback throughput ``network`` measured (as the node links
    are ``1 / --bandwidth-ratio`` of it) and measure one TCP stream across a region link; print as it goes."""
    layout = cluster.regions
    if layout is None:
        raise ValueError("set_up_regions needs a cluster with regions (nodes_per_region).")
    rate = network.loopback_per_node_bytes_per_s / ratio
    cluster.shape_regions(LinkShape(rate))
    measured = cluster.measure_throughput([(cluster.num_nodes - 1, 0)], seconds)[0]
    print(f"region links ({layout.regions} regions of {layout.nodes_per_region} nodes): tbf {_gbit(rate)} per "
          f"direction (1/{ratio:g} of the per-node {network.calibration} loopback throughput); one TCP stream from "
          f"node {cluster.num_nodes - 1} to node 0 measures {_gbit(measured)}")
    return RegionSettings(layout.regions, layout.nodes_per_region, ratio, rate, measured)


def _gbit(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e9:.2f} Gbit/s ({bytes_per_s / 1e6:,.0f} MB/s)"


def reshape_link(cluster: EmulatedCluster, network: NetworkSettings, ratio: float, seconds: float) -> NetworkSettings:
    """Shape the links to ``1 / ratio`` of the loopback throughput ``network`` measured (not measured again: every
    ratio of a ``--convergence`` run divides the same number) and measure one TCP stream across them."""
    rate = network.loopback_per_node_bytes_per_s / ratio
    cluster.shape(LinkShape(rate))
    measured = cluster.measure_throughput([(1, 0)], seconds)[0]
    print(f"inter-node link: tbf {_gbit(rate)} per direction (1/{ratio:g} of the per-node {network.calibration} "
          f"loopback throughput measured above); one TCP stream measures {_gbit(measured)}")
    return replace(network, inter_node_rate_bytes_per_s=rate, inter_node_measured_bytes_per_s=measured)
