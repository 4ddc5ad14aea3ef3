"""``python -m lightning_mics.plan``: rank MiCS / AMSP layouts for a cluster, model and batch.

    lightning-mics plan --model llama-3-8b --cluster p4d --nodes 4 --gpus-per-node 8
    lightning-mics plan --hf-config path/to/model/config.json --cluster dgx-h100 --nodes 2 --seq-len 4096
    python -m lightning_mics.plan --cluster p3dn --nodes 8 --model bert-10b --micro-batch 8 \\
        --accumulation 4 --precision deepspeed-fp16 --activation-checkpointing
    python -m lightning_mics.plan --nodes 4 --gpus-per-node 8 --gpu-memory 80GiB \\
        --intra-bandwidth 360GB/s --inter-bandwidth 400Gbps --compute 400TFLOPS \\
        --params 13B --layers 40 --hidden 5120 --seq-len 2048 --micro-batch 2 --json

    # measure the links of the running cluster (every rank), then plan with the measurements
    torchrun --nnodes 2 --nproc-per-node 8 -m lightning_mics.plan calibrate --out links.json
    python -m lightning_mics.plan --cluster p4d --nodes 2 --calibration links.json --model gpt-13b

Flags override the preset named by ``--cluster`` / ``--model`` (or the ``--hf-config`` file); a shape flag
on a published shape recomputes its parameter count. ``--params`` needs the shape beside it: a count alone does
not say how many layers or how wide, which set activations, FLOPs and the FSDP units, so it is refused with the
presets of about that size named. See :mod:`lightning_mics.planner` for the cost model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional, Union

from lightning_mics.planner import (
    CLUSTER_PRESETS,
    MODEL_PRESETS,
    MODEL_SHAPES,
    PRECISIONS,
    Calibration,
    ClusterSpec,
    ModelSpec,
    Plan,
    TrainingSpec,
    TransformerShape,
    parse_bandwidth,
    parse_bytes,
    parse_count,
    parse_flops,
    parse_seconds,
    plan,
    read_hf_config,
)
from lightning_mics.planner.models import DEFAULT_SEQ_LEN, nearest_presets
from lightning_mics.wire import WIRE_FORMATS


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Turn a parser's ValueError into argparse's one-line usage error."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__.replace("parse_", "")
    return convert


def _non_negative_int(text: str) -> int:
    """``--top``: a row count, 0 for all."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of rows >= 0 (0: all), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-mics plan",
        description="Predict step time, exposed communication, cross-node traffic and memory of every valid "
        "(P, G, OS) sharding layout and rank them. Subcommand 'calibrate' (under torchrun) measures the links.",
    )
    cluster = parser.add_argument_group("cluster (defaults: the --cluster preset)")
    cluster.add_argument("--cluster", choices=sorted(CLUSTER_PRESETS), help="named cluster preset")
    cluster.add_argument("--nodes", type=int, help="number of nodes (required without a preset's default of 1)")
    cluster.add_argument("--gpus-per-node", type=int)
    cluster.add_argument("--gpu-memory", type=_typed(parse_bytes), help="per GPU, e.g. 40GiB")
    cluster.add_argument("--intra-bandwidth", type=_typed(parse_bandwidth), help="per GPU inside a node, e.g. 230GB/s")
    cluster.add_argument("--inter-bandwidth", type=_typed(parse_bandwidth), help="per node across nodes, e.g. 400Gbps")
    cluster.add_argument("--intra-latency", type=_typed(parse_seconds), help="per ring step, e.g. 8us")
    cluster.add_argument("--inter-latency", type=_typed(parse_seconds), help="per ring step, e.g. 30us")
    cluster.add_argument("--compute", type=_typed(parse_flops), help="achieved FLOP/s per GPU, e.g. 140TFLOPS")
    cluster.add_argument("--memory-bandwidth", type=_typed(parse_bandwidth), help="HBM, e.g. 1.5TB/s")
    cluster.add_argument("--overlap", type=float, help="fraction of compute that hides communication, 0..1")
    cluster.add_argument("--calibration", type=Path, help="JSON written by the 'calibrate' subcommand")
    cluster.add_argument(
        "--nodes-per-region", type=int, help="regions (zones, data centres) of this many nodes each (with "
        "--region-bandwidth): the plan weighs two-level DiLoCo, synchronous inside a region, DiLoCo across regions"
    )
    cluster.add_argument(
        "--region-bandwidth", type=_typed(parse_bandwidth), help="between two regions, shared by a region's GPUs, "
        "e.g. 10Gbps"
    )
    cluster.add_argument("--region-latency", type=_typed(parse_seconds), help="between regions, e.g. 10ms")

    model = parser.add_argument_group(
        "model (a --model preset, a --hf-config file, or --params with --layers and --hidden)"
    )
    model.add_argument(
        "--model",
        choices=sorted(MODEL_PRESETS),
        metavar="NAME",
        help="named model: " + ", ".join(MODEL_SHAPES) + " (from their published config.json); "
        + ", ".join(name for name in MODEL_PRESETS if name not in MODEL_SHAPES) + " (the papers')",
    )
    model.add_argument(
        "--hf-config",
        type=Path,
        metavar="PATH",
        help="a local Hugging Face config.json (or the model folder holding it); read, never downloaded. "
        "Model types: llama, mistral, qwen2, gpt2",
    )
    model.add_argument(
        "--params",
        type=_typed(parse_count),
        help="parameter count, e.g. 10B or 1.3e9: with --layers and --hidden for a custom model, or to override "
        "a preset's count (alone it is refused: a count does not give the shape)",
    )
    model.add_argument("--layers", type=int)
    model.add_argument("--hidden", type=int)
    model.add_argument(
        "--seq-len", type=int, help=f"tokens per sequence (default: {DEFAULT_SEQ_LEN}, at most the model's positions)"
    )
    model.add_argument("--heads", type=int)
    model.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention)")
    model.add_argument("--intermediate", type=int, help="the MLP's inner width")
    model.add_argument("--vocab", type=int)
    model.add_argument(
        "--attention",
        choices=("fused", "eager"),
        help="fused: F.scaled_dot_product_attention / FlashAttention, no s x s scores kept (the default for "
        "published shapes and config files); eager: scores stored (the papers' presets and custom shapes)",
    )

    batch = parser.add_argument_group("batch and numerics")
    batch.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-step")
    batch.add_argument("--accumulation", type=int, default=1, help="micro-steps per optimizer step")
    batch.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16-mixed")
    batch.add_argument("--activation-checkpointing", action="store_true")

    search = parser.add_argument_group("search and output")
    search.add_argument("--uniform-only", action="store_true", help="only MiCS layouts (P = G = OS)")
    search.add_argument("--flat", action="store_true", help="flat rings across nodes (no hierarchical collectives)")
    search.add_argument(
        "--grad-accumulation",
        choices=("sharded", "unsharded", "auto"),
        default="sharded",
        help="gradients between micro-steps: sharded (MiCS), unsharded (one reduce-scatter per step) or auto (both)",
    )
    search.add_argument(
        "--cross-replica-dtype",
        choices=("fp32", *WIRE_FORMATS),
        default="fp32",
        help="wire format of the cross-replica hop (int8: blockwise, 1 byte + a 4-byte scale per block)",
    )
    search.add_argument(
        "--sync-every",
        type=int,
        metavar="H",
        help="semi-synchronous replica groups (cross_replica_sync='diloco'): price an average across replicas every "
        "H optimizer steps instead of a hop 2 at every step. Without it, the plan says when only semi-sync keeps the "
        "GPUs busy",
    )
    search.add_argument(
        "--num-fragments",
        type=int,
        default=1,
        metavar="P",
        help="streaming DiLoCo (with --sync-every): the parameters synchronised in P fragments, one every H / P steps",
    )
    search.add_argument(
        "--fragment-sync-delay",
        type=int,
        default=0,
        metavar="TAU",
        help="streaming DiLoCo: inner steps each fragment's average runs behind (priced as hidden behind them)",
    )
    search.add_argument(
        "--diloco-worker-size",
        type=_worker_size,
        default=1,
        metavar="K|region",
        help="two-level DiLoCo (with --sync-every): DiLoCo workers of K partition groups, or 'region' (one per region), "
        "synchronised at every step inside, averaged every H steps across",
    )
    search.add_argument("--top", type=_non_negative_int, default=15, help="rows to show (0: all)")
    search.add_argument(
        "--show-infeasible",
        action="store_true",
        help="list the layouts that do not fit memory too (by default they are summarised in one line)",
    )
    search.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _worker_size(text: str) -> Union[int, str]:
    if text == "region":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of partition groups nor 'region'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a DiLoCo worker holds at least one partition group")
    return value


def _cluster_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ClusterSpec:
    overrides = {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "gpu_memory_bytes": args.gpu_memory,
        "intra_node_bandwidth": args.intra_bandwidth,
        "inter_node_bandwidth": args.inter_bandwidth,
        "intra_node_latency": args.intra_latency,
        "inter_node_latency": args.inter_latency,
        "compute_flops": args.compute,
        "memory_bandwidth": args.memory_bandwidth,
        "overlap": args.overlap,
        "nodes_per_region": args.nodes_per_region,
        "region_bandwidth": args.region_bandwidth,
        "region_latency": args.region_latency,
    }
    given = {name: value for name, value in overrides.items() if value is not None}
    if args.cluster:
        cluster = replace(CLUSTER_PRESETS[args.cluster], **given)
    else:
        required = (
            "nodes",
            "gpus_per_node",
            "gpu_memory_bytes",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
            "compute_flops",
        )
        missing = [name for name in required if name not in given]
        if missing:
            flags = ", ".join("--" + _flag(name) for name in missing)
            parser.error(
                f"without --cluster, give {flags} "
                f"(or pick a preset: --cluster {{{','.join(sorted(CLUSTER_PRESETS))}}})."
            )
        cluster = ClusterSpec(**given)
    if args.calibration:
        cluster = Calibration.from_dict(json.loads(args.calibration.read_text())).apply(cluster)
    return cluster


def _flag(field_name: str) -> str:
    return {
        "gpu_memory_bytes": "gpu-memory",
        "intra_node_bandwidth": "intra-bandwidth",
        "inter_node_bandwidth": "inter-bandwidth",
        "compute_flops": "compute",
    }.get(field_name, field_name.replace("_", "-"))


#: ``--flag`` -> the :class:`TransformerShape` field it overrides
_SHAPE_FLAGS = {
    "layers": "layers",
    "hidden": "hidden",
    "heads": "heads",
    "kv_heads": "kv_heads",
    "intermediate": "intermediate",
    "vocab": "vocab",
}


def _model_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelSpec:
    """The model the flags name: a published shape or ``--hf-config`` (shape flags override it and the count
    follows), a paper preset (flags override its fields), or a custom shape given in full with ``--params``."""
    shape_overrides = {
        field: getattr(args, flag) for flag, field in _SHAPE_FLAGS.items() if getattr(args, flag) is not None
    }
    if args.model and args.hf_config:
        parser.error("give --model or --hf-config, not both: each names the whole model.")
    fused = None if args.attention is None else args.attention == "fused"
    shape: Optional[TransformerShape] = None
    if args.hf_config:
        shape = read_hf_config(args.hf_config)
    elif args.model in MODEL_SHAPES:
        shape = MODEL_SHAPES[args.model]
    if shape is not None:
        if "heads" in shape_overrides and "kv_heads" not in shape_overrides and shape.kv_heads == shape.heads:
            shape_overrides["kv_heads"] = shape_overrides["heads"]  # multi-head attention stays multi-head
        spec = replace(shape, **shape_overrides).model_spec(args.seq_len, fused_attention=fused is not False)
        return spec if args.params is None else replace(spec, params=args.params)
    given = {
        "params": args.params,
        "seq_len": args.seq_len,
        **shape_overrides,
        **({} if fused is None else {"fused_attention": fused}),
    }
    given = {name: value for name, value in given.items() if value is not None}
    if args.model:
        return replace(MODEL_PRESETS[args.model], **given)
    presets = ", ".join(MODEL_SHAPES)
    if "params" not in given:
        parser.error(
            f"name the model: --model NAME ({presets}, ...), --hf-config path/to/config.json, "
            "or a custom shape: --params N --layers L --hidden H [--seq-len S --heads A --vocab V]."
        )
    if not {"layers", "hidden"} <= set(given):
        parser.error(
            f"--params {given['params']:,} alone does not give the model's shape (layers, hidden size), which sets "
            "its activations, FLOPs and FSDP units, so the planner does not guess one. Name the model: "
            f"--model NAME (about that size: {', '.join(nearest_presets(given['params']))}; all: {presets}), "
            "--hf-config path/to/config.json, or add --layers and --hidden (with --seq-len, --heads, --vocab)."
        )
    return ModelSpec(**{"seq_len": DEFAULT_SEQ_LEN, **given})


def _model_text(model: ModelSpec) -> str:
    """The model line's shape: what the plan assumed, so that a wrong input shows."""
    grouped = model.num_kv_heads != model.num_heads
    heads = f"{model.num_heads} heads" + (f" ({model.num_kv_heads} kv)" if grouped else "")
    mlp = f"MLP {model.mlp_width}" + (" gated" if model.gated_mlp else "")
    positions = f" of {model.max_positions} positions" if model.max_positions else ""
    return (
        f"{model.name}, {model.params:,} params, {model.layers} layers x {model.hidden}, {heads}, {mlp}"
        + (f", vocab {model.vocab:,}" if model.vocab else "")
        + f", seq {model.seq_len}{positions}, {'fused' if model.fused_attention else 'eager'} attention"
    )


def _checkpointing_hint(result: Plan, search: dict[str, Any]) -> Optional[str]:
    """When nothing fits without activation checkpointing: whether it fits with it, and which layout wins."""
    training = result.training
    if result.any_fits or training.activation_checkpointing:
        return None
    checkpointed = plan(result.cluster, result.model, replace(training, activation_checkpointing=True), **search)
    if not checkpointed.any_fits:
        return None
    best = checkpointed.winner
    return (
        f"With --activation-checkpointing it fits: {best.name} at {best.memory.total / 1024**3:.1f} GiB per GPU, "
        f"{best.step_time_s:.3g} s/step -- {checkpointed.strategy_line()}."
    )


def run_plan(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cluster = _cluster_from_args(args, parser)
        model = _model_from_args(args, parser)
        training = TrainingSpec(
            micro_batch=args.micro_batch,
            accumulation=args.accumulation,
            precision=args.precision,
            activation_checkpointing=args.activation_checkpointing,
            sync_every=args.sync_every,
            num_fragments=args.num_fragments,
            fragment_sync_delay=args.fragment_sync_delay,
            diloco_worker_size=args.diloco_worker_size,
        )
        search: dict[str, Any] = {
            "uniform_only": args.uniform_only,
            "hierarchical": False if args.flat else "auto",
            "grad_accumulation": args.grad_accumulation,
            "cross_replica_dtype": None if args.cross_replica_dtype == "fp32" else args.cross_replica_dtype,
        }
        result = plan(cluster, model, training, **search)
        hint = _checkpointing_hint(result, search)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    top = args.top or None
    if args.json:
        print(result.to_json(top))
        return 0
    print(
        f"cluster: {cluster.name}, {cluster.nodes} x {cluster.gpus_per_node} GPUs, "
        f"{cluster.gpu_memory_bytes / 1024**3:.0f} GiB, intra {cluster.intra_node_bandwidth / 1e9:.0f} GB/s, "
        f"inter {cluster.inter_node_bandwidth * 8 / 1e9:.0f} Gbps per node, {cluster.compute_flops / 1e12:.0f} TFLOP/s"
        + (
            f", {cluster.regions} regions of {cluster.nodes_per_region} nodes joined at "
            f"{cluster.region_bandwidth * 8 / 1e9:.3g} Gbps"
            if cluster.nodes_per_region is not None and cluster.region_bandwidth is not None else ""
        )
    )
    print(f"model: {_model_text(model)}")
    print(
        f"training: micro-batch {training.micro_batch} x {training.accumulation} micro-steps per optimizer step, "
        f"{training.precision}, grad accumulation {args.grad_accumulation}"
        + (" (each row says which mode it priced)" if args.grad_accumulation == "auto" else "")
        + (", activation checkpointing" if training.activation_checkpointing else "")
        + (f", semi-synchronous (DiLoCo) every {training.sync_every} steps" if training.sync_every else "")
        + (f", DiLoCo workers of {training.diloco_worker_size} partition groups"
           if training.diloco_worker_size != 1 else "")
    )
    print()
    print(result.table(top, show_infeasible=args.show_infeasible))
    print()
    print(result.explain())
    if hint:
        print(hint)
    print()
    print(result.strategy_text())
    return 0


def run_calibrate(argv: Optional[Sequence[str]] = None) -> int:
    """Measure the links on a running job (start it with torchrun: every rank runs this)."""
    parser = argparse.ArgumentParser(prog="lightning-mics plan calibrate", description=run_calibrate.__doc__)
    parser.add_argument("--out", type=Path, default=Path("calibration.json"))
    parser.add_argument("--ranks-per-node", type=int, help="default: LOCAL_WORLD_SIZE from the launcher")
    parser.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    args = parser.parse_args(argv)
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        parser.error(
            f"calibration times collectives between the job's processes, so it must run under a launcher "
            f"({', '.join(missing)} not set). Start it on every node with torchrun, e.g. "
            "`torchrun --nnodes=N --nproc-per-node=GPUS --rdzv-endpoint=HOST:PORT -m lightning_mics.plan calibrate`."
        )

    import torch
    import torch.distributed as dist

    from lightning_mics.planner import calibrate_cluster
    from lightning_mics.topology import MiCSTopology, detect_ranks_per_node

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        ranks_per_node = args.ranks_per_node or detect_ranks_per_node() or dist.get_world_size()
        topology = MiCSTopology.create(dist.get_world_size(), ranks_per_node, 1)
        result = calibrate_cluster(topology)
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps(result.to_dict(), indent=2))
            print(json.dumps(result.link_values(), indent=2))
            print(f"wrote {args.out}")
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: ``plan [flags]`` or ``plan calibrate [flags]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "calibrate":
        return run_calibrate(argv[1:])
    return run_plan(argv)


def console_main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``lightning-mics`` console script: ``lightning-mics plan [calibrate] [flags]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["plan"]:
        print(
            "usage: lightning-mics plan [calibrate] [flags]   (the layout planner; see lightning-mics plan --help)\n"
            "Training runs through Lightning: Trainer(strategy='mics'); the demo LightningCLI is "
            "`python examples/cli.py fit --config examples/cli_config.yaml`.",
            file=sys.stderr,
        )
        return 2
    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
