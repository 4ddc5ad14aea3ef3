"""Emulated cloud cluster benchmark: MiCS against ZeRO-3, replication and Lightning's FSDP peers on
shaped "nodes" made of network namespaces.

    sudo "$(command -v python)" benchmarks/emulated_cluster.py            # default: 2 nodes x 4 ranks
    sudo "$(command -v python)" benchmarks/emulated_cluster.py --quick    # < 5 minutes on 2 cores
    sudo "$(command -v python)" benchmarks/emulated_cluster.py --scaling  # 2, 3, 4 nodes x 2 ranks (weak scaling)
    sudo "$(command -v python)" benchmarks/emulated_cluster.py --smoke [--scaling]  # the main path, ~1 min
    sudo "$(command -v python)" benchmarks/emulated_cluster.py --convergence  # held-out loss vs wall-clock, ~20 min
    sudo "$(command -v python)" benchmarks/emulated_cluster.py --convergence --smoke  # its main path, ~1.5 min
    sudo "$(command -v python)" benchmarks/emulated_cluster.py --convergence --regions 2  # two-level DiLoCo
    sudo "$(command -v python)" benchmarks/emulated_cluster.py --bandwidth-ratio 24 --regions 2 \
        --region-bandwidth-ratio 240 --strategies mics-auto,mics-diloco,mics-diloco-two-level-h8  # bytes per level

Steps: build the namespaces (:mod:`benchmarks.netns`), measure the intra-node (loopback)
throughput, shape every node link to ``1 / --bandwidth-ratio`` of it (15: the cloud ratio of the
MiCS paper) and measure that too; then train the same GPT under every strategy
(:mod:`benchmarks.emulated_worker`, one process per rank inside its node's namespace), compare the
measured inter-node bytes with :mod:`benchmarks.comm_model`, print a table and write
``benchmarks/results/emulated_cluster.json`` and ``.png``. Every row also gets its *wire floor*: the
busiest node uplink direction's bytes per step over the measured link rate, the time the shaped link
alone needs (:func:`benchmarks.emulated_analysis.add_wire_floor`). ``--scaling`` repeats the run at several node
counts with the same per-rank batch (:mod:`benchmarks.scaling`). ``--convergence`` trains the synchronous
reference (``mics-auto``) and semi-synchronous DiLoCo rows (H = 8, 32 and the planner's H) on learnable data for
several seeds and compares the held-out loss of their synchronised models against tokens and wall-clock
(:mod:`benchmarks.convergence`). ``--regions N`` splits the nodes into N regions joined by links of their own,
``1 / --region-bandwidth-ratio`` of the loopback throughput (:mod:`benchmarks.netns_regions`); every row's bytes are
then measured and modelled at both levels, and ``--convergence --regions N`` compares two-level DiLoCo with flat
DiLoCo and ``mics-auto`` (:mod:`benchmarks.convergence_regions`).
Namespaces, links and rank processes are removed on every exit path (errors and Ctrl-C included).

This file is the entry point and the command line: the presets, the options and their checks (:func:`parse_args`).
The modes run in :mod:`benchmarks.emulated_modes`, each row through :mod:`benchmarks.emulated_rows`; the links are
:mod:`benchmarks.emulated_network`'s, the byte model's expectations and wire floors
:mod:`benchmarks.emulated_analysis`'s, the tables and charts :mod:`benchmarks.emulated_report`'s.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_mics` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.convergence_setup import (  # noqa: E402
    CONVERGENCE_RATIOS,
    CONVERGENCE_SEEDS,
    CONVERGENCE_STRATEGIES,
    PLANNED_ROW,
    REFERENCE,
    SMOKE_CONVERGENCE_RATIOS,
    SMOKE_CONVERGENCE_SEEDS,
    SMOKE_CONVERGENCE_STRATEGIES,
    ConvergenceSettings,
)
from benchmarks.convergence_regions import (  # noqa: E402
    DEFAULT_REGION_BANDWIDTH_RATIO,
    NODES_PER_REGION,
    PLANNED_ROWS,
    REGION_CONVERGENCE_MICRO_BATCH,
    REGION_CONVERGENCE_RATIOS,
    REGION_CONVERGENCE_STEPS,
    SMOKE_REGION_CONVERGENCE_MICRO_BATCH,
    SMOKE_REGION_CONVERGENCE_RATIOS,
    REGION_CONVERGENCE_STRATEGIES,
    REPORT_NAME,
    TWO_LEVEL_ROW,
)
from benchmarks.emulated_modes import run_convergence, run_scaling, run_single  # noqa: E402

from benchmarks.emulated_network import add_link_arguments, link_request  # noqa: E402
from benchmarks.netns import REPO_ROOT, check_prerequisites, prepare_host  # noqa: E402
from benchmarks.scaling import (  # noqa: E402
    DEFAULT_SCALING_NODES,
    SCALING_RANKS_PER_NODE,
    SCALING_STRATEGIES,
    parse_node_list,
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
#: --convergence --regions N --smoke: twice as many ranks on the same cores, so half the steps (the DiLoCo rows still
#: train at least two evaluation intervals; their budget is whole rounds of the planner's H)
SMOKE_REGION_CONVERGENCE = replace(SMOKE_CONVERGENCE, measured_steps=8)
#: --convergence --regions N: the one-region mode's tokens in steps of twice as many ranks
#: (:data:`~benchmarks.convergence_regions.REGION_CONVERGENCE_STEPS`)
REGION_CONVERGENCE = replace(CONVERGENCE, measured_steps=REGION_CONVERGENCE_STEPS)
#: --convergence --regions N --smoke: one seed, and region links 1/60 of loopback rather than 1/240 (ten times
#: slower than its node links, as the full run's), so that the planner's H -- and with it a two-level row's budget
#: of whole rounds -- stays small: at 1/60 it names 8 and 32 (0.5 min in all), at 1/120 32 and 128 (1.5 min). The
#: smoke measures nothing
SMOKE_REGION_CONVERGENCE_SEEDS = (0,)
SMOKE_REGION_BANDWIDTH_RATIO = 60.0
CONVERGENCE_RANKS_PER_NODE = 2
#: --convergence's micro-batch per rank (the throughput rows use 1): a global batch of 512 tokens per step, so
#: that the loss of a step says something about the model
CONVERGENCE_MICRO_BATCH = 4
#: steps in the trailing mean of the training-loss curves (smoke: fewer, its runs are short)
CONVERGENCE_WINDOW, SMOKE_CONVERGENCE_WINDOW = 16, 4
#: optimizer steps between two held-out evaluations, and held-out sequences (smoke: fewer of both)
CONVERGENCE_EVAL_EVERY, SMOKE_CONVERGENCE_EVAL_EVERY = 16, 4
CONVERGENCE_HELDOUT, SMOKE_CONVERGENCE_HELDOUT = 512, 256


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
                        help=f"samples per micro-batch per rank (default 1; --convergence {CONVERGENCE_MICRO_BATCH}, "
                             f"--convergence --regions --smoke {SMOKE_REGION_CONVERGENCE_MICRO_BATCH})")
    parser.add_argument("--d-model", type=int, help="model width (default: 512, quick: 256)")
    parser.add_argument("--layers", type=int, help="transformer blocks (default: 4, quick: 2)")
    parser.add_argument("--heads", type=int, help="attention heads (default: 8, quick: 4)")
    parser.add_argument("--seq-len", type=int, help="tokens per sample (default 8: little compute per byte moved)")
    parser.add_argument("--warmup-steps", type=int, help="optimizer steps run but not measured (default 1)")
    parser.add_argument("--steps", type=int, help="measured optimizer steps (default: 5, quick: 2; --convergence: the "
                                                  f"token budget, {CONVERGENCE.measured_steps}; with --regions "
                                                  f"{REGION_CONVERGENCE.measured_steps})")
    add_link_arguments(parser)
    parser.add_argument("--regions", type=int, default=1,
                        help="split the nodes evenly into this many regions, each on a bridge of its own, joined by "
                             "one shaped link per region (default 1: one bridge; --nodes then defaults to "
                             f"{NODES_PER_REGION} per region). With --convergence: mics-auto, flat and two-level "
                             f"DiLoCo at the planner's H ({','.join(REGION_CONVERGENCE_STRATEGIES)}); writes "
                             f"{REPORT_NAME}.json and .png")
    parser.add_argument("--region-bandwidth-ratio", type=float,
                        help="region link rate = measured per-node loopback throughput / this, as --bandwidth-ratio "
                             f"sets the node links (default {DEFAULT_REGION_BANDWIDTH_RATIO:g}; --convergence --smoke "
                             f"{SMOKE_REGION_BANDWIDTH_RATIO:g}; needs --regions 2 or more)")
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
    _check_region_flags(parser, args)
    if args.convergence:
        _check_convergence_flags(parser, args)
        preset = SMOKE_CONVERGENCE if args.smoke else CONVERGENCE
        if args.regions > 1:
            preset = SMOKE_REGION_CONVERGENCE if args.smoke else REGION_CONVERGENCE
    else:
        preset = SMOKE if args.smoke else QUICK if args.quick else FULL
        for flag in ("convergence_ratios", "seeds", "eval_every"):
            if getattr(args, flag) is not None:
                parser.error(f"--{flag.replace('_', '-')} only applies with --convergence.")
    if args.micro_batch is None:
        args.micro_batch = 1 if not args.convergence else \
            CONVERGENCE_MICRO_BATCH if args.regions == 1 else \
            SMOKE_REGION_CONVERGENCE_MICRO_BATCH if args.smoke else REGION_CONVERGENCE_MICRO_BATCH
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
        if names is None and args.convergence and args.regions > 1:
            names = list(REGION_CONVERGENCE_STRATEGIES)
        elif names is None and args.convergence:
            names = list(SMOKE_CONVERGENCE_STRATEGIES if args.smoke else CONVERGENCE_STRATEGIES)
        elif names is None and args.smoke:
            names = list(SMOKE_SCALING_STRATEGIES if args.scaling else SMOKE_STRATEGIES)
        elif args.scaling and names is None:
            names = list(SCALING_STRATEGIES)
        if TWO_LEVEL_ROW in (names or ()) and not (args.convergence and args.regions > 1):
            raise ValueError(f"{TWO_LEVEL_ROW} needs --convergence and --regions 2 or more (its H is the planner's "
                             "for the cluster with its regions).")
        args.planner_row = bool(args.convergence and PLANNED_ROW in names)
        #: --convergence --regions: the rows the planner resolves per mode (flat and two-level DiLoCo)
        args.planned_rows = [n for n in names if n in PLANNED_ROWS] if args.convergence and args.regions > 1 else []
        if args.planned_rows:  # one planner for both modes (regions_planner_answer), not the one-region one
            args.planner_row = False
        if args.planner_row or args.planned_rows:  # resolved once a mics-auto run has measured the cluster
            names = [n for n in names if n not in PLANNED_ROWS]
        args.points = []
        for nodes in args.node_counts:  # every node count must run every named strategy
            shape = ClusterShape(nodes, args.ranks_per_node)
            args.nodes_per_region = None if args.regions == 1 else _nodes_per_region(nodes, args.regions)
            ranks_per_region = None if args.nodes_per_region is None else args.nodes_per_region * args.ranks_per_node
            specs = [_with_outer_lr(spec, shape, args.outer_lr)
                     for spec in select_strategies(shape, names, ranks_per_region)]
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


def _check_region_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--regions`` and ``--region-bandwidth-ratio``: what they refuse, and the region link's default ratio."""
    if args.regions < 1:
        parser.error(f"--regions must be a positive int, got {args.regions}.")
    if args.regions == 1:
        if args.region_bandwidth_ratio is not None:
            parser.error("--region-bandwidth-ratio needs --regions 2 or more (one region has no region links).")
        return
    if args.scaling:
        parser.error("--regions and --scaling exclude each other: give the nodes with --nodes.")
    if args.region_bandwidth_ratio is None:
        smoke = args.smoke and args.convergence
        args.region_bandwidth_ratio = SMOKE_REGION_BANDWIDTH_RATIO if smoke else DEFAULT_REGION_BANDWIDTH_RATIO
    if not args.region_bandwidth_ratio > 0:
        parser.error(f"--region-bandwidth-ratio must be positive, got {args.region_bandwidth_ratio}.")


def _nodes_per_region(nodes: int, regions: int) -> int:
    if nodes % regions or nodes == regions:
        raise ValueError(f"--regions {regions} must split the {nodes} nodes evenly into regions of at least two "
                         f"nodes (e.g. --nodes {NODES_PER_REGION * regions}).")
    return nodes // regions


def _with_outer_lr(spec: StrategySpec, shape: ClusterShape, outer_lr: Optional[float]) -> StrategySpec:
    """A semi-synchronous row with ``--outer-lr`` (same name and H, and workers); other rows unchanged."""
    if outer_lr is None or not spec.semi_synchronous:
        return spec
    if spec.two_level:
        return replace(spec, outer_lr=outer_lr)
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
        seeds=args.seeds or (CONVERGENCE_SEEDS if not args.smoke else
                             SMOKE_REGION_CONVERGENCE_SEEDS if args.regions > 1 else SMOKE_CONVERGENCE_SEEDS),
        window=SMOKE_CONVERGENCE_WINDOW if args.smoke else CONVERGENCE_WINDOW,
    )
    settings.check(shape.world_size)
    if args.regions > 1:
        defaults = SMOKE_REGION_CONVERGENCE_RATIOS if args.smoke else REGION_CONVERGENCE_RATIOS
    else:
        defaults = SMOKE_CONVERGENCE_RATIOS if args.smoke else CONVERGENCE_RATIOS
    args.ratios = args.convergence_ratios or defaults
    return settings


def _resolve_mode(args: argparse.Namespace) -> None:
    """The node counts, ranks per node and output folder of a single run, a ``--scaling`` or a ``--convergence``
    run."""
    nodes = 2 if args.regions == 1 else NODES_PER_REGION * args.regions
    if args.convergence:
        args.node_counts = (nodes if args.nodes is None else args.nodes,)
        if args.ranks_per_node is None:
            args.ranks_per_node = CONVERGENCE_RANKS_PER_NODE
        if args.output_dir is None and args.regions > 1:  # convergence_regions.json beside the other results
            args.output_dir = RESULTS_DIR / "convergence_regions_smoke" if args.smoke else RESULTS_DIR
        elif args.output_dir is None:
            args.output_dir = RESULTS_DIR / ("convergence_smoke" if args.smoke else "convergence")
        return
    if not args.scaling:
        if args.scaling_nodes is not None:
            raise ValueError("--scaling-nodes only applies with --scaling: add --scaling, "
                             "or use --nodes N for one run.")
        args.node_counts = (nodes if args.nodes is None else args.nodes,)
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


if __name__ == "__main__":
    sys.exit(main())
