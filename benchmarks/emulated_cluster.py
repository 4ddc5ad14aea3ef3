"""Emulated cloud cluster benchmark: MiCS against ZeRO-3, replication and Lightning's FSDP peers on
shaped "nodes" made of network namespaces.

    sudo "$(command -v python)" benchmarks/emulated_cluster.py            # default: 2 nodes x 4 ranks
    sudo "$(command -v python)" benchmarks/emulated_cluster.py --quick    # < 5 minutes on 2 cores
    sudo "$(command -v python)" benchmarks/emulated_cluster.py --scaling  # 2, 3, 4 nodes x 2 ranks (weak scaling)
    sudo "$(command -v python)" benchmarks/emulated_cluster.py --smoke [--scaling]  # the main path, ~1 min
    sudo "$(command -v python)" benchmarks/emulated_cluster.py --convergence  # held-out loss vs wall-clock, ~20 min
    sudo "$(command -v python)" benchmarks/emulated_cluster.py --convergence --smoke  # its main path, ~1.5 min

Steps: build the namespaces (:mod:`benchmarks.netns`), measure the intra-node (loopback)
throughput, shape every node link to ``1 / --bandwidth-ratio`` of it (15: the cloud ratio of the
MiCS paper) and measure that too; then train the same GPT under every strategy
(:mod:`benchmarks.emulated_worker`, one process per rank inside its node's namespace), compare the
measured inter-node bytes with :mod:`benchmarks.comm_model`, print a table and write
``benchmarks/results/emulated_cluster.json`` and ``.png``. Every row also gets its *wire floor*: the
busiest node uplink direction's bytes per step over the measured link rate, the time the shaped link
alone needs (:func:`add_wire_floor`). ``--scaling`` repeats the run at several node counts with the
same per-rank batch (:mod:`benchmarks.scaling`). ``--convergence`` trains the synchronous reference
(``mics-auto``) and semi-synchronous DiLoCo rows (H = 8, 32 and the planner's H) on learnable data for several
seeds and compares the held-out loss of their synchronised models against tokens and wall-clock
(:mod:`benchmarks.convergence`).
Namespaces, links and rank processes are removed on every exit path (errors and Ctrl-C included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_mics` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.comm_model import (  # noqa: E402
    RingCollective,
    expected_step_bytes,
    fsdp2_unit_numel,
    gloo_wire_bytes,
    gpt_fsdp_units,
    gradient_bytes_held_during_accumulation,
)
from benchmarks.convergence import (  # noqa: E402
    CONVERGENCE_RATIOS,
    CONVERGENCE_SEEDS,
    CONVERGENCE_STRATEGIES,
    PLANNED_ROW,
    REFERENCE,
    SMOKE_CONVERGENCE_RATIOS,
    SMOKE_CONVERGENCE_SEEDS,
    SMOKE_CONVERGENCE_STRATEGIES,
    ConvergenceSettings,
    MarkovChain,
    achieved_flops,
    build_convergence_report,
    draw_convergence,
    format_convergence_table,
    planner_answer,
)
from benchmarks.netns import (  # noqa: E402
    REPO_ROOT,
    UPLINK,
    EmulatedCluster,
    LinkShape,
    RankProcess,
    check_prerequisites,
    prepare_host,
    rank_environment,
)
from benchmarks.scaling import (  # noqa: E402
    DEFAULT_SCALING_NODES,
    SCALING_RANKS_PER_NODE,
    SCALING_STRATEGIES,
    build_scaling_report,
    draw_scaling,
    format_scaling_table,
    link_rate,
    parse_node_list,
    point_predictions,
)
from benchmarks.scenarios import (  # noqa: E402
    ClusterShape,
    StrategySpec,
    TrainingSetup,
    diloco_spec,
    measured_steps_for,
    select_strategies,
)
from examples.models import GPTConfig  # noqa: E402

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
MASTER_PORT_BASE = 29600


@dataclass(frozen=True)
class Preset:
    """Model and run length of a mode. The model is chosen so that communication dominates: wide
    layers (bytes to move) and few tokens per micro-batch (little compute)."""

    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    warmup_steps: int
    measured_steps: int
    probe_seconds: float
    run_timeout_s: int


FULL = Preset(d_model=512, n_layers=4, n_heads=8, seq_len=8, warmup_steps=1, measured_steps=5,
              probe_seconds=3.0, run_timeout_s=600)
QUICK = Preset(d_model=256, n_layers=2, n_heads=4, seq_len=8, warmup_steps=1, measured_steps=2,
               probe_seconds=1.0, run_timeout_s=150)
#: The main path in about a minute (what tests/test_entry_points.py runs): quick's model, one measured step, short
#: probes, 2 ranks per node and one strategy per family (SMOKE_STRATEGIES). It checks that everything runs and
#: that the bytes match the model; its step times mean nothing (rank start-up dominates).
SMOKE = Preset(d_model=256, n_layers=2, n_heads=4, seq_len=8, warmup_steps=0, measured_steps=1,
               probe_seconds=0.3, run_timeout_s=150)
SMOKE_RANKS_PER_NODE = 2
#: --smoke's strategies: one per worker family (FSDP2 with the live planner, Lightning's FSDP1, Lightning's DDP);
#: with --scaling only the planner's, at SMOKE_SCALING_NODES.
SMOKE_STRATEGIES = ("mics-auto", "fsdp-hybrid", "ddp")
SMOKE_SCALING_STRATEGIES = ("mics-auto",)
SMOKE_SCALING_NODES = (2, 3)
#: --convergence: the reference's token budget is ``measured_steps`` optimizer steps, every one of them recorded (no
#: warm-up). The model (d_model 128, 2 layers: 0.43 M parameters, 1.7 MB in fp32) is one whose mics-auto step is
#: mostly wire on the 1/240 link: with the nodes' CPU quotas the link is ~3.8 MB/s and the hop 2 takes ~0.46 s of a
#: ~0.56 s step (the smoke measured a wire fraction of 0.77). Three seeds of four rows then take ~20 minutes on 2
#: cores; --quick's model (d_model 256, 6.6 MB a step across nodes, ~1.75 s of wire a step) would take ~45.
CONVERGENCE = Preset(d_model=128, n_layers=2, n_heads=4, seq_len=8, warmup_steps=0, measured_steps=256,
                     probe_seconds=1.0, run_timeout_s=1200)
#: --convergence --smoke: its main path (three rows, two seeds, one ratio) in about a minute and a half: the same
#: model, 16 steps.
SMOKE_CONVERGENCE = Preset(d_model=128, n_layers=2, n_heads=4, seq_len=8, warmup_steps=0, measured_steps=16,
                           probe_seconds=0.3, run_timeout_s=240)
CONVERGENCE_RANKS_PER_NODE = 2
#: --convergence's micro-batch per rank (the throughput rows use 1): a global batch of 512 tokens per step, so
#: that the loss of a step says something about the model
CONVERGENCE_MICRO_BATCH = 4
#: steps in the trailing mean of the training-loss curves (smoke: fewer, its runs are short)
CONVERGENCE_WINDOW, SMOKE_CONVERGENCE_WINDOW = 16, 4
#: optimizer steps between two held-out evaluations, and held-out sequences (smoke: fewer of both)
CONVERGENCE_EVAL_EVERY, SMOKE_CONVERGENCE_EVAL_EVERY = 16, 4
CONVERGENCE_HELDOUT, SMOKE_CONVERGENCE_HELDOUT = 512, 256
DEFAULT_BANDWIDTH_RATIO = 15.0


def build_parser() -> argparse.ArgumentParser:
    """The command line (its defaults that depend on --quick / --scaling are resolved in :func:`parse_args`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps: finishes in < 5 minutes")
    parser.add_argument("--smoke", action="store_true",
                        help="the main path in about a minute: quick's model, 1 step, 2 ranks per node, one strategy "
                             f"per family ({','.join(SMOKE_STRATEGIES)}; with --scaling "
                             f"{','.join(SMOKE_SCALING_STRATEGIES)} at {','.join(map(str, SMOKE_SCALING_NODES))} "
                             "nodes); checks that it runs, measures nothing")
    parser.add_argument("--fork-server", action=argparse.BooleanOptionalAction, default=None,
                        help="start the ranks forked from one process that imported torch and Lightning once "
                             "(benchmarks/fork_server.py): no ~6 s of imports per rank. Default: on with --smoke "
                             "and --convergence (whose clock starts after set-up) only")
    parser.add_argument("--nodes", type=int, help="emulated nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=int,
                        help=f"ranks per node (default 4; with --scaling {SCALING_RANKS_PER_NODE})")
    parser.add_argument("--strategies", help="comma-separated subset of the strategy names (default: all; with "
                                             f"--scaling: {','.join(SCALING_STRATEGIES)})")
    parser.add_argument("--scaling", action="store_true",
                        help="weak scaling: run the strategies at every node count of --scaling-nodes with the same "
                             "per-rank micro-batch and accumulation; writes scaling.json and scaling.png")
    parser.add_argument("--scaling-nodes", type=_node_list_arg,
                        help="node counts for --scaling, comma-separated (default "
                             f"{','.join(map(str, DEFAULT_SCALING_NODES))})")
    parser.add_argument("--convergence", action="store_true",
                        help="held-out loss against tokens and wall-clock: train "
                             f"{','.join(CONVERGENCE_STRATEGIES)} ({PLANNED_ROW}: DiLoCo with the H the planner names "
                             "for the link) on learnable data for every seed of --seeds at every ratio of "
                             "--convergence-ratios, mics-auto for --steps optimizer steps (default "
                             f"{CONVERGENCE.measured_steps}), DiLoCo rows for --diloco-budget times as many; writes "
                             "convergence.json and convergence.png")
    parser.add_argument("--convergence-ratios", type=_ratio_list_arg,
                        help="bandwidth ratios of --convergence, comma-separated; the first is the headline "
                             f"(default {','.join(f'{r:g}' for r in CONVERGENCE_RATIOS)}; smoke: "
                             f"{','.join(f'{r:g}' for r in SMOKE_CONVERGENCE_RATIOS)})")
    parser.add_argument("--seeds", type=_seed_list_arg,
                        help="--convergence: seeds, comma-separated; each sets the initialisation and the draw of "
                             f"training sequences (default {','.join(map(str, CONVERGENCE_SEEDS))}; smoke: "
                             f"{','.join(map(str, SMOKE_CONVERGENCE_SEEDS))})")
    parser.add_argument("--eval-every", type=int,
                        help="--convergence: optimizer steps between held-out evaluations (default "
                             f"{CONVERGENCE_EVAL_EVERY}; smoke: {SMOKE_CONVERGENCE_EVAL_EVERY})")
    parser.add_argument("--diloco-budget", type=float, default=2.0,
                        help="--convergence: a DiLoCo row's token budget over mics-auto's, at least (rounded up to "
                             "whole rounds and evaluation intervals; default 2)")
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="--convergence: peak AdamW learning rate (the DiLoCo rows' inner optimizer; default 3e-3)")
    parser.add_argument("--lr-warmup", type=int, default=10,
                        help="--convergence: linear learning-rate warm-up in optimizer steps, then cosine (default 10)")
    parser.add_argument("--outer-lr", type=float,
                        help="learning rate of the DiLoCo rows' outer Nesterov SGD, momentum 0.9 (default: the "
                             "library's, 0.7 as in the DiLoCo paper)")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step (default 4)")
    parser.add_argument("--micro-batch", type=int,
                        help=f"samples per micro-batch per rank (default 1; --convergence {CONVERGENCE_MICRO_BATCH})")
    parser.add_argument("--d-model", type=int, help="model width (default: 512, quick: 256)")
    parser.add_argument("--layers", type=int, help="transformer blocks (default: 4, quick: 2)")
    parser.add_argument("--heads", type=int, help="attention heads (default: 8, quick: 4)")
    parser.add_argument("--seq-len", type=int, help="tokens per sample (default 8: little compute per byte moved)")
    parser.add_argument("--warmup-steps", type=int, help="optimizer steps run but not measured (default 1)")
    parser.add_argument("--steps", type=int, help="measured optimizer steps (default: 5, quick: 2; --convergence: the "
                                                  f"token budget, {CONVERGENCE.measured_steps})")
    add_link_arguments(parser)
    parser.add_argument("--run-timeout", type=int, help="seconds one strategy may run before it is stopped")
    parser.add_argument("--output-dir", type=Path, help="where the JSON and PNG go (default: benchmarks/results, "
                                                        "with --scaling benchmarks/results/scaling)")
    parser.add_argument(
        "--profile-dir",
        type=Path,
        help="sample rank 0 of every strategy with py-spy (pip install py-spy) into DIR/<strategy>.txt "
        "(collapsed stacks, with idle time; with --scaling DIR/nodes<N>/); summarise with "
        "benchmarks/profile_breakdown.py",
    )
    return parser


def _ratio_list_arg(text: str) -> tuple[float, ...]:
    """``--convergence-ratios`` as argparse wants it: distinct positive numbers, in the order given."""
    try:
        ratios = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        ratios = ()
    if not ratios or any(not r > 0 for r in ratios) or len(set(ratios)) != len(ratios):
        raise argparse.ArgumentTypeError(
            f"--convergence-ratios takes distinct comma-separated positive numbers, e.g. 240,24; got {text!r}."
        )
    return ratios


def _seed_list_arg(text: str) -> tuple[int, ...]:
    """``--seeds`` as argparse wants it: distinct non-negative ints, in the order given."""
    try:
        seeds = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        seeds = ()
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds takes distinct comma-separated non-negative ints, e.g. 0,1,2; "
                                         f"got {text!r}.")
    return seeds


def _node_list_arg(text: str) -> tuple[int, ...]:
    """``--scaling-nodes`` as argparse wants it: a bad list is reported with our message, not argparse's."""
    try:
        return parse_node_list(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke and args.quick:
        parser.error("--smoke and --quick exclude each other: --smoke is the shorter of the two.")
    if args.fork_server is None:
        args.fork_server = args.smoke or args.convergence
    if args.convergence:
        _check_convergence_flags(parser, args)
        preset = SMOKE_CONVERGENCE if args.smoke else CONVERGENCE
    else:
        preset = SMOKE if args.smoke else QUICK if args.quick else FULL
        for flag in ("convergence_ratios", "seeds", "eval_every"):
            if getattr(args, flag) is not None:
                parser.error(f"--{flag.replace('_', '-')} only applies with --convergence.")
    if args.micro_batch is None:
        args.micro_batch = CONVERGENCE_MICRO_BATCH if args.convergence else 1
    for name, default in (("d_model", preset.d_model), ("layers", preset.n_layers), ("heads", preset.n_heads),
                          ("seq_len", preset.seq_len), ("warmup_steps", preset.warmup_steps),
                          ("steps", preset.measured_steps), ("run_timeout", preset.run_timeout_s)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.fixed_rate_bytes_per_s = None  # set between the points of a --scaling run
    try:
        _resolve_mode(args)
        args.setup = TrainingSetup(
            model=GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads),
            micro_batch=args.micro_batch,
            accumulate=args.accumulate,
            warmup_steps=args.warmup_steps,
            measured_steps=args.steps,
        )
        args.link = link_request(args, args.setup, preset.probe_seconds)
        names = [n.strip() for n in args.strategies.split(",") if n.strip()] if args.strategies else None
        if names is None and args.convergence:
            names = list(SMOKE_CONVERGENCE_STRATEGIES if args.smoke else CONVERGENCE_STRATEGIES)
        elif names is None and args.smoke:
            names = list(SMOKE_SCALING_STRATEGIES if args.scaling else SMOKE_STRATEGIES)
        elif args.scaling and names is None:
            names = list(SCALING_STRATEGIES)
        args.planner_row = bool(args.convergence and PLANNED_ROW in names)
        if args.planner_row:  # resolved once a mics-auto run has measured the cluster (run_convergence)
            names = [n for n in names if n != PLANNED_ROW]
        args.points = []
        for nodes in args.node_counts:  # every node count must run every named strategy
            shape = ClusterShape(nodes, args.ranks_per_node)
            specs = [_with_outer_lr(spec, shape, args.outer_lr) for spec in select_strategies(shape, names)]
            if not args.convergence:  # --convergence trains on generated sequences, not the corpus
                for spec in specs:
                    replace(args.setup, measured_steps=measured_steps_for(spec, args.setup.measured_steps)) \
                        .check_corpus(shape)
            args.points.append((shape, specs))
        args.convergence_settings = _convergence_settings(args) if args.convergence else None
    except ValueError as error:
        parser.error(str(error))
    args.cluster, args.specs = args.points[0]  # the single run's (or the first scaling point's)
    return args


def _check_convergence_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The options ``--convergence`` refuses, each with what to use instead."""
    refused = {
        "--scaling": (args.scaling, "run them one after the other"),
        "--quick": (args.quick, "--convergence has its own budget and model (--quick's); --smoke shortens it"),
        "--bandwidth-ratio": (args.bandwidth_ratio is not None, "give the ratios with --convergence-ratios"),
        "--inter-node-mbps": (args.inter_node_mbps is not None, "give the ratios with --convergence-ratios"),
        "--warmup-steps": (args.warmup_steps is not None,
                           "every step of a convergence run is recorded; the learning-rate warm-up is --lr-warmup"),
        "--profile-dir": (args.profile_dir is not None, "profile the throughput rows instead"),
    }
    for flag, (given, instead) in refused.items():
        if given:
            parser.error(f"--convergence and {flag} exclude each other: {instead}.")


def _with_outer_lr(spec: StrategySpec, shape: ClusterShape, outer_lr: Optional[float]) -> StrategySpec:
    """A semi-synchronous row with ``--outer-lr`` (same name and H); other rows unchanged."""
    if outer_lr is None or not spec.semi_synchronous:
        return spec
    return diloco_spec(shape, spec.sync_every or 1, outer_lr, name=spec.name)


def _convergence_settings(args: argparse.Namespace) -> ConvergenceSettings:
    """The settings every row of ``--convergence`` trains with, checked against its rows: the reference must run
    (and run first: the planner's H comes from its measurements), and its budget must end on an evaluation point
    (a DiLoCo row's budget is whole rounds by construction, :meth:`ConvergenceSettings.row_steps`)."""
    shape, specs = args.points[0]
    names = [spec.name for spec in specs]
    if REFERENCE not in names:
        raise ValueError(f"--convergence compares every row with {REFERENCE}: add it to --strategies.")
    if names[0] != REFERENCE:
        args.points[0] = (shape, [specs[names.index(REFERENCE)], *(s for s in specs if s.name != REFERENCE)])
    settings = ConvergenceSettings(
        steps=args.steps, learning_rate=args.lr, warmup_steps=args.lr_warmup,
        heldout_samples=SMOKE_CONVERGENCE_HELDOUT if args.smoke else CONVERGENCE_HELDOUT,
        eval_every=args.eval_every or (SMOKE_CONVERGENCE_EVAL_EVERY if args.smoke else CONVERGENCE_EVAL_EVERY),
        diloco_budget=args.diloco_budget,
        seeds=args.seeds or (SMOKE_CONVERGENCE_SEEDS if args.smoke else CONVERGENCE_SEEDS),
        window=SMOKE_CONVERGENCE_WINDOW if args.smoke else CONVERGENCE_WINDOW,
    )
    settings.check(shape.world_size)
    args.ratios = args.convergence_ratios or (SMOKE_CONVERGENCE_RATIOS if args.smoke else CONVERGENCE_RATIOS)
    return settings


def _resolve_mode(args: argparse.Namespace) -> None:
    """The node counts, ranks per node and output folder of a single run, a ``--scaling`` or a ``--convergence``
    run."""
    if args.convergence:
        args.node_counts = (2 if args.nodes is None else args.nodes,)
        if args.ranks_per_node is None:
            args.ranks_per_node = CONVERGENCE_RANKS_PER_NODE
        if args.output_dir is None:
            args.output_dir = RESULTS_DIR / ("convergence_smoke" if args.smoke else "convergence")
        return
    if not args.scaling:
        if args.scaling_nodes is not None:
            raise ValueError("--scaling-nodes only applies with --scaling: add --scaling, "
                             "or use --nodes N for one run.")
        args.node_counts = (2 if args.nodes is None else args.nodes,)
        if args.ranks_per_node is None:
            args.ranks_per_node = SMOKE_RANKS_PER_NODE if args.smoke else 4
        args.output_dir = RESULTS_DIR if args.output_dir is None else args.output_dir
        return
    if args.nodes is not None:
        raise ValueError("--nodes and --scaling exclude each other: give the node counts with --scaling-nodes, "
                         f"e.g. --scaling-nodes {','.join(map(str, DEFAULT_SCALING_NODES))}.")
    args.node_counts = args.scaling_nodes or (SMOKE_SCALING_NODES if args.smoke else DEFAULT_SCALING_NODES)
    args.ranks_per_node = SCALING_RANKS_PER_NODE if args.ranks_per_node is None else args.ranks_per_node
    args.output_dir = RESULTS_DIR / "scaling" if args.output_dir is None else args.output_dir


# ---------------------------------------------------------------------------------- network
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


def _gbit(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e9:.2f} Gbit/s ({bytes_per_s / 1e6:,.0f} MB/s)"


# ---------------------------------------------------------------------------------- runs
def run_strategy(
    cluster: EmulatedCluster, spec: StrategySpec, args: argparse.Namespace, work_dir: Path, index: int,
    convergence: Optional[ConvergenceRun] = None,
) -> dict[str, Any]:
    """Launch every rank of one strategy in its node's namespace and return rank 0's record (or a
    failure record naming the reason). ``convergence``: a ``--convergence`` run of the row instead of a
    throughput measurement."""
    shape, setup = args.cluster, args.setup
    if convergence is None:  # a semi-synchronous row measures whole rounds of sync_every steps
        setup = replace(setup, measured_steps=measured_steps_for(spec, setup.measured_steps))
    work_dir.mkdir(parents=True, exist_ok=True)
    job = work_dir / f"{spec.name}.job.json"
    setup_dict = asdict(setup)
    job.write_text(json.dumps({
        "strategy": spec.to_dict(), "cluster": asdict(shape), "setup": setup_dict,
        "convergence": None if convergence is None else asdict(convergence.settings),
        "convergence_run": None if convergence is None else {"seed": convergence.seed, "steps": convergence.steps},
    }))
    output = work_dir / f"{spec.name}.result.json"
    base_env = rank_environment(MASTER_ADDR=cluster.node_address(0), MASTER_PORT=str(MASTER_PORT_BASE + index),
                                WORLD_SIZE=str(shape.world_size), GLOO_SOCKET_IFNAME=UPLINK)
    procs: list[tuple[int, RankProcess, Path]] = []
    started = time.monotonic()
    try:
        for rank in range(shape.world_size):
            node, local = divmod(rank, shape.ranks_per_node)
            env = {**base_env, "NODE_RANK": str(node), "LOCAL_RANK": str(local)}
            log = work_dir / f"{spec.name}.rank{rank}.log"
            argv = [sys.executable, "-m", "benchmarks.emulated_worker", "--job", str(job)]
            if rank == 0:
                argv += ["--output", str(output)]
                if args.profile_dir is not None:
                    args.profile_dir.mkdir(parents=True, exist_ok=True)
                    profile = args.profile_dir / f"{spec.name}.txt"
                    argv = ["py-spy", "record", "--idle", "--rate", "100", "--format", "raw", "-o", str(profile),
                            "--", *argv]
            with log.open("wb") as log_file:
                if argv[0] == "py-spy":  # profiled: py-spy starts the rank
                    proc = cluster.spawn(node, argv, env=env, stdout=log_file, stderr=subprocess.STDOUT)
                else:
                    proc = cluster.spawn_rank(node, argv, env, log_file)
                procs.append((rank, proc, log))
        failure = _wait_all(procs, started + args.run_timeout)
    finally:
        for _, proc, _ in procs:
            cluster.stop(proc)
    wall = time.monotonic() - started
    if failure is None and output.exists():
        record = json.loads(output.read_text())
        record["wall_s"] = wall
        return record
    return {"strategy": spec.name, "family": spec.family, "partition_size": spec.partition_size,
            "hierarchical": spec.hierarchical, "sharding_strategy": spec.sharding_strategy,
            "status": failure or "failed: rank 0 wrote no result", "wall_s": wall}


def skip_reason(spec: StrategySpec) -> Optional[str]:
    """Why a row cannot run on this machine (an optional peer that is not installed), or ``None``."""
    if spec.family == "deepspeed":
        from benchmarks.deepspeed_peer import unavailable_reason

        return unavailable_reason()
    return None


def skipped_record(spec: StrategySpec, reason: str) -> dict[str, Any]:
    return {"strategy": spec.name, "family": spec.family, "partition_size": spec.partition_size,
            "hierarchical": spec.hierarchical, "sharding_strategy": spec.sharding_strategy,
            "status": f"skipped: {reason}", "wall_s": 0.0}


def _wait_all(procs: list[tuple[int, RankProcess, Path]], deadline: float) -> Optional[str]:
    """Wait for every rank; the first failure (or the timeout) stops the run and is described."""
    while True:
        pending = False
        for rank, proc, log in procs:
            code = proc.poll()
            if code is None:
                pending = True
            elif code != 0:
                return f"failed: rank {rank} exited with {code}: {_last_error(log)}"
        if not pending:
            return None
        if time.monotonic() > deadline:
            return "failed: timed out (see --run-timeout)"
        time.sleep(0.5)


def _last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["(no output)"])[-1][:300]


def add_expectations(record: dict[str, Any], spec: StrategySpec, args: argparse.Namespace) -> dict[str, Any]:
    if spec.planned and record.get("status") == "ok":
        spec = spec.with_choice(record)  # the bytes of the layout the planner chose
    expected = expected_step_bytes(spec, args.cluster, args.setup)
    record["expected_inter_node_bytes_per_step"] = expected.inter_node
    record["expected_loopback_bytes_per_step"] = expected.intra_node
    record["expected_grad_bytes_during_accumulation"] = gradient_bytes_held_during_accumulation(
        spec, args.cluster, args.setup
    )
    measured = record.get("inter_node_bytes_per_step")
    if measured is not None and expected.inter_node:
        record["inter_node_error"] = measured / expected.inter_node - 1
    record["description"] = spec.description
    return record


def add_wire_floor(record: dict[str, Any], link_bytes_per_s: float, num_nodes: int) -> dict[str, Any]:
    """Add the row's wire floor: the time the shaped links alone need for its inter-node bytes.

    Each direction of each node uplink is its own tbf queue at ``link_bytes_per_s``, so no step can
    be shorter than its busiest direction's bytes over that rate; ``step_over_floor`` says how far
    above that floor the step runs (1.0: the wire is the only cost).
    """
    if record.get("status") != "ok":
        return record
    tx = record.get("inter_node_tx_bytes_per_step_per_node")
    rx = record.get("inter_node_rx_bytes_per_step_per_node")
    if tx and rx:  # measured: every node's uplink counters, both directions
        busiest, basis = max(*tx, *rx), "busiest uplink direction (per-node tx/rx counters)"
    else:
        # Only the total is known (records from before the per-node counters): the sum over nodes of
        # every uplink's tx_bytes. It counts each crossing byte once, at its sender; that byte also
        # uses one receiver's ingress, so with symmetric traffic each node's egress -- and each
        # node's ingress -- carries total / nodes (not total / (2 * nodes): the total is one direction's sum).
        busiest, basis = record["inter_node_bytes_per_step"] / num_nodes, "total / nodes (symmetric traffic assumed)"
    floor = busiest / link_bytes_per_s
    record["inter_node_bytes_per_direction_per_step"] = busiest
    record["wire_floor_basis"] = basis
    record["wire_floor_link_bytes_per_s"] = link_bytes_per_s
    record["wire_floor_s"] = floor
    record["step_over_floor"] = record["step_time_s"] / floor if floor > 0 else None
    return record


# ---------------------------------------------------------------------------------- reporting
def format_table(records: list[dict[str, Any]]) -> str:
    header = ("strategy", "p", "hier", "step s", "tokens/s", "inter MB/step", "expected", "err",
              "floor s", "step/floor", "loopback MB", "expected", "peak RSS MB", "grad held MB")
    rows = [header]
    failures: list[str] = []
    for r in records:
        if r.get("status") != "ok":
            rows.append((r["strategy"], str(r["partition_size"]), _yes_no(r.get("hierarchical")), "-", "-", "-",
                         _mb(r.get("expected_inter_node_bytes_per_step")), "-", "-", "-", "-", "-", "-",
                         "skipped*" if _skipped(r) else "failed*"))
            failures.append(f"* {r['strategy']}: {r.get('status')}")
            continue
        rows.append((
            _label(r, short=True), str(r["partition_size"]), _yes_no(r.get("hierarchical")),
            f"{r['step_time_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
            _mb(r["inter_node_bytes_per_step"]), _mb(r["expected_inter_node_bytes_per_step"]),
            f"{r.get('inter_node_error', 0) * 100:+.1f}%", *_floor_cells(r),
            _mb(r["loopback_bytes_per_step"]), _mb(r["expected_loopback_bytes_per_step"]),
            _mb(r["peak_mem_bytes"]), _mb(r.get("grad_bytes_during_accumulation")),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:], *failures])


def format_markdown(records: list[dict[str, Any]]) -> str:
    """The same table in Markdown, for docs/benchmarks.md."""
    lines = ["| strategy | partition | hier. | step time (s) | tokens/s | inter-node MB/step | expected | "
             "wire floor (s) | step / floor | loopback MB/step | expected | peak RSS/rank (MB) | grad held (MB) |",
             "|---|---:|:-:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        if r.get("status") != "ok":
            lines.append(f"| {r['strategy']} | {r['partition_size']} | {_yes_no(r.get('hierarchical'))} | "
                         f"{r.get('status')} | | | {_mb(r.get('expected_inter_node_bytes_per_step'))} | | | | | | |")
            continue
        floor, ratio = _floor_cells(r)
        lines.append(
            f"| {_label(r)} | {r['partition_size']} | {_yes_no(r.get('hierarchical'))} | {r['step_time_s']:.2f} | "
            f"{r['tokens_per_s']:,.0f} | {_mb(r['inter_node_bytes_per_step'])} | "
            f"{_mb(r['expected_inter_node_bytes_per_step'])} ({r.get('inter_node_error', 0) * 100:+.1f}%) | "
            f"{floor} | {ratio} | "
            f"{_mb(r['loopback_bytes_per_step'])} | {_mb(r['expected_loopback_bytes_per_step'])} | "
            f"{_mb(r['peak_mem_bytes'])} | {_mb(r.get('grad_bytes_during_accumulation'))} |"
        )
    return "\n".join(lines)


def _label(record: dict[str, Any], short: bool = False) -> str:
    """The row's name; a semi-synchronous row says so, since its step time and bytes are averages over rounds."""
    every = record.get("sync_every")
    if not every:
        return record["strategy"]
    if short:
        return f"{record['strategy']} (H={every})"
    return f"{record['strategy']} (semi-synchronous, H={every}: step and bytes are means over whole rounds)"


def _floor_cells(record: dict[str, Any]) -> tuple[str, str]:
    """The wire floor (s) and step / floor as table cells (``-`` when the row has none)."""
    floor, ratio = record.get("wire_floor_s"), record.get("step_over_floor")
    return ("-" if floor is None else f"{floor:.2f}", "-" if ratio is None else f"{ratio:.2f}x")


def _mb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def _yes_no(value: Optional[bool]) -> str:
    return "-" if value is None else ("yes" if value else "no")


def draw_chart(records: list[dict[str, Any]], path: Path, title: str) -> Optional[Path]:
    """Throughput and inter-node bytes (measured next to expected) per strategy, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing, so no chart: `pip install -e '.[bench]'`", file=sys.stderr)
        return None
    names = [r["strategy"] for r in records]
    ok = [r.get("status") == "ok" for r in records]
    positions = list(range(len(records)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    top.bar(positions, [r["tokens_per_s"] if good else 0 for r, good in zip(records, ok)], color="tab:blue")
    top.set_ylabel("tokens/s (all ranks)")
    top.set_title(textwrap.fill(title, 110), fontsize=9)
    for x, (r, good) in enumerate(zip(records, ok)):
        label = f"{r['tokens_per_s']:,.0f}" if good else ("skipped" if _skipped(r) else "failed")
        top.annotate(label, (x, r["tokens_per_s"] if good else 0),
                     ha="center", va="bottom", fontsize=8)
    width = 0.4
    bottom.bar([x - width / 2 for x in positions],
               [r["inter_node_bytes_per_step"] / 1e6 if good else 0 for r, good in zip(records, ok)],
               width, label="measured (veth tx_bytes)", color="tab:orange")
    bottom.bar([x + width / 2 for x in positions], [r["expected_inter_node_bytes_per_step"] / 1e6 for r in records],
               width, label="analytic (gloo ring model)", color="tab:gray")
    bottom.set_ylabel("inter-node MB per optimizer step")
    bottom.legend(fontsize=8)
    bottom.set_xticks(positions, names, rotation=20, ha="right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not prepare_host(check_prerequisites):  # and teardown runs in `finally` on SIGTERM too, as for Ctrl-C
        return 2
    command = "python benchmarks/emulated_cluster.py " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        if args.convergence:
            return run_convergence(args, command)
        return run_scaling(args, command) if args.scaling else run_single(args, command)
    except KeyboardInterrupt:
        print("\ninterrupted: namespaces, links and rank processes were removed", file=sys.stderr)
        return 130


def measure_point(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Build the cluster of ``args.cluster``, run ``args.specs`` on it, tear it down; return the report
    (the ``emulated_cluster.json`` schema, which compare_planner.py reads)."""
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} "
          f"on {os.cpu_count()} cores")
    records: list[dict[str, Any]] = []
    started = time.monotonic()
    with EmulatedCluster(args.cluster.num_nodes, mtu=args.mtu) as cluster, \
            tempfile.TemporaryDirectory(prefix="micsbench-") as tmp:
        if args.fork_server:
            cluster.start_fork_server()  # it imports while the links are probed
        network = set_up_network(cluster, args.cluster,
                                 replace(args.link, fixed_rate_bytes_per_s=args.fixed_rate_bytes_per_s))
        for index, spec in enumerate(args.specs):
            print(f"[{index + 1}/{len(args.specs)}] {spec.name}: {spec.description} ...", flush=True)
            reason = skip_reason(spec)
            raw = skipped_record(spec, reason) if reason else run_strategy(cluster, spec, args, Path(tmp), index)
            record = add_wire_floor(add_expectations(raw, spec, args), link_rate(asdict(network)),
                                    args.cluster.num_nodes)
            records.append(record)
            print("    " + _one_line(record), flush=True)
        cpu = cluster.cpu_settings()  # before the teardown removes the cgroups
    load_after = os.getloadavg()
    print()
    print(format_table(records))
    print(f"\nload average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; "
          f"total {time.monotonic() - started:.0f} s")
    setup = args.setup
    return {
        "command": command,
        "title": report_title(args, network),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_before": load_before, "load_after": load_after},
        "network": asdict(network),
        "cluster": asdict(args.cluster),
        "settings": cpu,
        "setup": {**asdict(setup), "model_params": setup.model.num_params,
                  "tokens_per_step": setup.tokens_per_step(args.cluster)},
        "results": records,
    }


def report_title(args: argparse.Namespace, network: NetworkSettings) -> str:
    setup = args.setup
    return (f"{args.cluster.num_nodes} nodes x {args.cluster.ranks_per_node} ranks (gloo, CPU), GPT "
            f"{setup.model.num_params / 1e6:.1f}M params, micro-batch {setup.micro_batch}x{setup.model.seq_len} "
            f"tokens, accumulate {setup.accumulate}; inter-node {network.inter_node_rate_bytes_per_s * 8 / 1e9:.2f} "
            f"Gbit/s, gloo loopback {network.loopback_gloo_per_node_bytes_per_s * 8 / 1e9:.1f} Gbit/s per node")


def run_single(args: argparse.Namespace, command: str) -> int:
    """One cluster shape: ``emulated_cluster.json`` and ``.png``, and the Markdown table."""
    report = measure_point(args, command)
    records = report["results"]
    output_dir: Path = args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / "emulated_cluster.json"
    json_path.write_text(json.dumps(report, indent=2))
    chart = draw_chart(records, output_dir / "emulated_cluster.png", report["title"])
    print(f"wrote {json_path}" + (f" and {chart}" if chart else ""))
    print("\n" + format_markdown(records))
    return 0 if _all_ran(records) else 1


def run_scaling(args: argparse.Namespace, command: str) -> int:
    """Weak scaling: the same strategies and per-rank batch at every node count, one cluster at a time
    (torn down before the next), on one link rate -- the first point's -- so that only the node count
    changes. ``scaling.json`` is rewritten after every point: a late failure keeps the earlier ones."""
    output_dir: Path = args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / "scaling.json"
    reports: list[dict[str, Any]] = []
    for shape, specs in args.points:
        print(f"\n=== scaling point: {shape.num_nodes} nodes x {shape.ranks_per_node} ranks ===", flush=True)
        point = argparse.Namespace(**vars(args))
        point.cluster, point.specs = shape, specs
        if args.profile_dir is not None:
            point.profile_dir = args.profile_dir / f"nodes{shape.num_nodes}"
        report = measure_point(point, command)
        report["planner_predictions"] = point_predictions(report)
        reports.append(report)
        if args.fixed_rate_bytes_per_s is None:
            args.fixed_rate_bytes_per_s = report["network"]["inter_node_rate_bytes_per_s"]
        scaling = build_scaling_report(reports, command)
        json_path.write_text(json.dumps(scaling, indent=2))
    chart = draw_scaling(scaling, output_dir / "scaling.png")
    print(f"\nwrote {json_path}" + (f" and {chart}" if chart else ""))
    print("\n" + format_scaling_table(scaling["rows"]))
    print("\n" + format_scaling_table(scaling["rows"], markdown=True))
    return 0 if all(_all_ran(r["results"]) for r in reports) else 1


def reshape_link(cluster: EmulatedCluster, network: NetworkSettings, ratio: float, seconds: float) -> NetworkSettings:
    """Shape the links to ``1 / ratio`` of the loopback throughput ``network`` measured (not measured again: every
    ratio of a ``--convergence`` run divides the same number) and measure one TCP stream across them."""
    rate = network.loopback_per_node_bytes_per_s / ratio
    cluster.shape(LinkShape(rate))
    measured = cluster.measure_throughput([(1, 0)], seconds)[0]
    print(f"inter-node link: tbf {_gbit(rate)} per direction (1/{ratio:g} of the per-node {network.calibration} "
          f"loopback throughput measured above); one TCP stream measures {_gbit(measured)}")
    return replace(network, inter_node_rate_bytes_per_s=rate, inter_node_measured_bytes_per_s=measured)


@dataclass(frozen=True)
class ConvergenceRun:
    """One row and seed of ``--convergence``: the settings every row shares, the seed, and the row's budget."""

    settings: ConvergenceSettings
    seed: int
    steps: int


def run_convergence(args: argparse.Namespace, command: str) -> int:
    """``--convergence``: one cluster; the loopback measured once, then for every ratio of ``args.ratios`` the
    links shaped to ``1 / ratio`` of it and, for every seed, ``mics-auto`` first (its set-up measures the cluster the
    planner's H is computed for, once per ratio from the first seed's run) and then every DiLoCo row, the planner's
    included. ``convergence.json`` is rewritten after every seed (a late failure keeps the earlier ones); then the
    chart and the tables."""
    settings: ConvergenceSettings = args.convergence_settings
    setup = args.setup
    chain = MarkovChain(setup.model.vocab_size, settings.successors, settings.data_seed)
    tokens_per_step = setup.tokens_per_step(args.cluster)
    described = {
        **asdict(settings),
        "model": asdict(setup.model), "model_params": setup.model.num_params,
        "cluster": asdict(args.cluster), "micro_batch": setup.micro_batch, "accumulate": setup.accumulate,
        "tokens_per_step": tokens_per_step,
        "tokens": settings.steps * tokens_per_step,
        "budget": f"mics-auto (and any synchronous row) {settings.steps} optimizer steps = "
                  f"{settings.steps * tokens_per_step:,} tokens; DiLoCo rows at least {settings.diloco_budget:g} times "
                  f"as many (whole rounds of H, whole evaluation intervals), so that they may reach mics-auto's final "
                  "loss after its token budget; every row's learning-rate schedule spans its own budget",
        "optimizer": f"AdamW(lr={settings.learning_rate:g}, betas=(0.9, 0.95), weight_decay=0.1 on matrices), "
                     f"{settings.warmup_steps} warm-up steps then cosine to 0.1x at the row's last step",
        "outer_optimizer": "SGD(lr=0.7, momentum=0.9, nesterov=True) (the library's default, DiLoCo's)"
        if args.outer_lr is None else f"SGD(lr={args.outer_lr:g}, momentum=0.9, nesterov=True) (--outer-lr)",
        "data": f"first-order Markov chain over {setup.model.vocab_size} tokens, {settings.successors} successors "
                f"each (table seed {settings.data_seed}); entropy rate {chain.entropy_rate:.4f} nats/token; each seed "
                f"draws its own training sequences, every row of a seed the same ones in the same order; "
                f"{settings.heldout_samples} held-out sequences, the same for every row and seed",
        "evaluation": f"held-out loss of the global model every {settings.eval_every} optimizer steps "
                      f"({settings.eval_every * tokens_per_step:,} tokens), its time taken out of the training clock",
        "entropy_rate": chain.entropy_rate,
        "fork_server": bool(args.fork_server),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    output_dir: Path = args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / "convergence.json"
    points: list[dict[str, Any]] = []
    started = time.monotonic()
    rows = len(args.specs) + int(args.planner_row)
    print(f"convergence: {rows} rows x {len(settings.seeds)} seeds x {len(args.ratios)} ratios; mics-auto "
          f"{settings.steps} steps of {tokens_per_step} tokens, DiLoCo rows >= {settings.diloco_budget:g}x; loss floor "
          f"(entropy rate) {chain.entropy_rate:.3f}", flush=True)
    index = 0
    with EmulatedCluster(args.cluster.num_nodes, mtu=args.mtu) as cluster, \
            tempfile.TemporaryDirectory(prefix="micsbench-") as tmp:
        if args.fork_server:
            cluster.start_fork_server()  # it imports while the links are probed
        network: Optional[NetworkSettings] = None
        for i, ratio in enumerate(args.ratios):
            print(f"\n=== bandwidth ratio {ratio:g} ===", flush=True)
            load_before = os.getloadavg()
            if network is None:
                network = set_up_network(cluster, args.cluster, replace(args.link, bandwidth_ratio=ratio))
                current = network
            else:
                current = reshape_link(cluster, network, ratio, args.link.probe_seconds)
            planner: dict[str, Any] = {"row": None, "sync_every": None, "from_seed": None, "per_seed": []}
            point: dict[str, Any] = {"bandwidth_ratio": ratio, "network": asdict(current), "load_before": load_before,
                                     "planner": planner, "runs": []}
            points.append(point)
            planned: Optional[StrategySpec] = None
            for seed in settings.seeds:
                queue = list(args.specs)  # mics-auto first (_convergence_settings)
                while queue:
                    spec = queue.pop(0)
                    steps = settings.row_steps(spec.sync_every)
                    print(f"[seed {seed}] {spec.name}: {steps} steps; {spec.description} ...", flush=True)
                    record = run_strategy(cluster, spec, args, Path(tmp) / f"ratio{i}" / f"seed{seed}", index,
                                          convergence=ConvergenceRun(settings, seed, steps))
                    index += 1
                    record.setdefault("seed", seed)
                    point["runs"].append(add_convergence_expectations(record, spec, args, steps))
                    print("    " + _convergence_line(record), flush=True)
                    if spec.name != REFERENCE:
                        continue
                    answer = convergence_planner(record, args)
                    planner["per_seed"].append({"seed": seed, **_planner_digest(answer)})
                    if planner["from_seed"] is None and answer is not None:
                        planner.update(answer, from_seed=seed)
                        planned = planned_spec(answer, args.specs, args.cluster, args.outer_lr)
                        if not args.planner_row and planned not in args.specs:
                            planned = None  # not asked for (--strategies without mics-diloco-planned)
                        planner["row"] = None if planned is None else planned.name
                        print(f"    planner: H = {answer['sync_every']} for this link (row {planner['row']})",
                              flush=True)
                    if args.planner_row and planned is None:
                        why = ("the planner names no H for this link" if planner["from_seed"] is not None
                               else "no planner answer yet (mics-auto did not run)")
                        point["runs"].append({"strategy": PLANNED_ROW, "seed": seed, "status": f"skipped: {why}"})
                    elif planned is not None and planned.name not in [s.name for s in args.specs]:
                        queue.append(planned)
                point["load_after"] = os.getloadavg()
                report = build_convergence_report(points, command, described)
                report.setdefault("settings", {}).update(cluster.cpu_settings())
                report["date_utc"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                report["total_s"] = time.monotonic() - started
                json_path.write_text(json.dumps(report, indent=2))
    chart = draw_convergence(report, output_dir / "convergence.png")
    print(f"\nwrote {json_path}" + (f" and {chart}" if chart else "") + f"; total {time.monotonic() - started:.0f} s")
    print("\n" + format_convergence_table(report))
    print("\n" + format_convergence_table(report, markdown=True))
    means = ", ".join(f"{k} = {_or_none(report.get(k))}" for k in ("time_to_sync_final_loss_ratio",
                                                                     "final_loss_ratio"))
    print(f"\nratio {report['headline_bandwidth_ratio']:g}, {report.get('headline_strategy')} (the planner's H = "
          f"{report.get('planner_sync_every')}), mean over {len(settings.seeds)} seeds: {means}; targets met: "
          f"{report.get('targets_met')}; seeds distinct: {report.get('seeds_distinct')}")
    ran = all(r.get("status") == "ok" for point in points for r in point["runs"]
              if not (r["strategy"] == PLANNED_ROW and _skipped(r)))
    return 0 if ran else 1


def convergence_planner(record: dict[str, Any], args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """The planner's answer for a ``mics-auto`` run (:func:`benchmarks.convergence.planner_answer`): the cluster
    its strategy measured at set-up, the compute rate its accumulation micro-steps achieved, this run's model and
    batch. ``None`` for a run that failed or recorded no measurement."""
    cluster = record.get("planner_cluster_spec")
    if record.get("status") != "ok" or not cluster:
        return None
    model = args.setup.model
    flops = achieved_flops(record.get("compute_micro_step_s"), model.flops_per_token, args.setup.micro_batch,
                           model.seq_len)
    return planner_answer(cluster, asdict(model), args.setup.micro_batch, args.setup.accumulate,
                          record["device_memory_bytes"], flops)


def _planner_digest(answer: Optional[dict[str, Any]]) -> dict[str, Any]:
    """One seed's planner answer in brief (the ratio's ``planner`` holds the full one, from the first seed)."""
    if answer is None:
        return {"sync_every": None}
    return {"sync_every": answer["sync_every"],
            "compute_flops": answer["inputs"]["cluster"]["compute_flops"],
            "calibrated_compute_flops": answer["inputs"]["calibrated_compute_flops"],
            "sync_every_with_calibrated_compute": answer["with_calibrated_compute"]["sync_every"],
            "synchronous_busy_fraction": answer["answer"]["synchronous_busy_fraction"]}


def planned_spec(answer: dict[str, Any], specs: list[StrategySpec], shape: ClusterShape,
                 outer_lr: Optional[float]) -> Optional[StrategySpec]:
    """The DiLoCo row for the planner's H: the run's row with that H when it has one, else a new
    ``mics-diloco-h<H>`` (same layout and outer optimizer as the others); ``None`` when the planner names no H."""
    every = answer.get("sync_every")
    if every is None:
        return None
    for spec in specs:
        if spec.sync_every == every:
            return spec
    return diloco_spec(shape, int(every), outer_lr, name=f"mics-diloco-h{every}")


def add_convergence_expectations(
    record: dict[str, Any], spec: StrategySpec, args: argparse.Namespace, steps: int
) -> dict[str, Any]:
    """The inter-node bytes the byte model expects for the whole run (per step x steps; a DiLoCo row's budget is
    whole rounds, so its one message per round counts exactly), next to the measured ones. The held-out
    evaluations add one all-reduce of two numbers each, too few bytes to count."""
    if spec.planned and record.get("status") == "ok":
        spec = spec.with_choice(record)
    record.setdefault("sync_every", spec.sync_every)
    record["description"] = spec.description
    expected = expected_step_bytes(spec, args.cluster, args.setup).inter_node * steps
    record["expected_inter_node_bytes"] = expected
    if record.get("inter_node_bytes") is not None and expected:
        record["inter_node_error"] = record["inter_node_bytes"] / expected - 1
    return record


def _convergence_line(record: dict[str, Any]) -> str:
    if record.get("status") != "ok":
        return f"{record.get('status')} ({record.get('wall_s', 0):.0f} s)"
    steps, evals = record["steps"], record["evals"]
    return (f"{len(steps)} steps in {steps[-1]['time_s']:.0f} s ({steps[-1]['time_s'] / len(steps):.3f} s/step), "
            f"held-out {evals[0]['heldout_loss']:.3f} -> {evals[-1]['heldout_loss']:.3f} "
            f"({sum(e['computed'] for e in evals)} of {len(evals)} evaluations computed, {record['eval_s']:.1f} s "
            f"taken out), inter-node {_mb(record.get('inter_node_bytes'))} MB (expected "
            f"{_mb(record.get('expected_inter_node_bytes'))}) ({record.get('wall_s', 0):.0f} s with start-up)")


def _or_none(value: Optional[float]) -> str:
    return "none (not reached)" if value is None else f"{value:.3f}"


def _all_ran(records: list[dict[str, Any]]) -> bool:
    return all(r.get("status") == "ok" or _skipped(r) for r in records)


def _skipped(record: dict[str, Any]) -> bool:
    return str(record.get("status", "")).startswith("skipped")


def _one_line(record: dict[str, Any]) -> str:
    if record.get("status") != "ok":
        return f"{record.get('status')} ({record.get('wall_s', 0):.0f} s)"
    floor, ratio = _floor_cells(record)
    return (f"step {record['step_time_s']:.2f} s, {record['tokens_per_s']:,.0f} tokens/s, inter-node "
            f"{_mb(record['inter_node_bytes_per_step'])} MB/step (expected "
            f"{_mb(record['expected_inter_node_bytes_per_step'])}), wire floor {floor} s (step {ratio}), "
            f"peak RSS {_mb(record['peak_mem_bytes'])} MB ({record.get('wall_s', 0):.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
