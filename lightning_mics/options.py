"""Every MiCS option, declared once: :class:`MiCSOptions`.

Both front ends -- the Trainer's :class:`lightning_mics.MiCSStrategy` and Fabric's
:class:`lightning_mics.MiCSFabricStrategy` -- take these options as keyword arguments (or a
``MiCSOptions`` object) and hand them to one :class:`~lightning_mics.engine.MiCSEngine`. Hydra's
``conf/strategy/mics.yaml`` lists the same keys and LightningCLI reads them through the constructors'
``**options`` (jsonargparse follows them into this dataclass). ``docs/options.md`` is generated from the
field docstrings below (``python -m lightning_mics.options --markdown``), and tests check that the
table, the Hydra file and this class agree, so an option cannot exist in one place and be missing in
another.

A malformed value is refused when the options are created -- when the strategy is built, not in every
rank after launch; layout rules that need the world size are checked by
:func:`lightning_mics.launch.check_layout` once the launcher knows it.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from torch.distributed.constants import default_pg_timeout

from lightning_mics.accumulation import GradAccumulation, check_grad_accumulation
from lightning_mics.fault_tolerance.config import FaultTolerance, check_catch_up_heal, check_exact_trajectory
from lightning_mics.hop2.diloco_options import CrossReplicaSync, OuterOptimizerFactory, check_semi_sync_options
from lightning_mics.offload_option import check_cpu_offload_option
from lightning_mics.planner.live import PlannerCluster, check_planner_cluster
from lightning_mics.sharding_spec import ShardingSpec
from lightning_mics.topology import PartitionSizeSpec, WorkerSizeSpec
from lightning_mics.wire import resolve_wire_format
from lightning_mics.wrap_policy import AutoWrapPolicy, make_wrap_predicate

if TYPE_CHECKING:  # read for the types by type checkers and by LightningCLI (jsonargparse runs this block)
    from torch.distributed.fsdp import CPUOffloadPolicy

Hierarchical = Union[bool, Literal["auto"]]
#: What users may pass as ``sharding``: a spec, ``"auto"`` (the planner picks every degree) or ``None``.
ShardingOption = Union[ShardingSpec, Literal["auto"], None]

#: ``buffer_sync``: how buffers are made equal across ranks (:func:`lightning_mics.buffer_sync.sync_buffers`).
BufferSync = Literal["broadcast", "average", "none"]
BUFFER_SYNC_MODES: tuple[str, ...] = ("broadcast", "average", "none")


def check_buffer_sync(mode: object) -> None:
    """Refuse an unknown ``buffer_sync`` when the strategy is built, naming the valid values."""
    if mode not in BUFFER_SYNC_MODES:
        raise ValueError(
            f"buffer_sync={mode!r} is not one of {list(BUFFER_SYNC_MODES)}: 'broadcast' gives every rank global rank "
            "0's buffers (as DDP does), 'average' the mean over ranks of floating-point buffers (integer ones from "
            "rank 0), 'none' leaves each rank its own (a sharded checkpoint may then mix ranks' buffers)."
        )


#: ``checkpoint_verify``: ``"checksum"``: sizes and CRC-32 of every file (default); ``"size"``: sizes only (no
#: reading, for very large checkpoints on slow storage); ``"none"``: no verification.
VerifyMode = Literal["checksum", "size", "none"]
VERIFY_MODES: tuple[str, ...] = ("checksum", "size", "none")


#: Options only the Trainer has a place for, and why Fabric refuses them when they are set.
TRAINER_ONLY: dict[str, str] = {
    "async_save": "Fabric ends a script without a teardown that could wait for a background save",
    "release_gradients_after_step": (
        "Fabric's loop is yours: call optimizer.zero_grad(set_to_none=True) right after optimizer.step()"
    ),
}


@dataclass(frozen=True)
class MiCSOptions:
    """How a MiCS run shards, syncs and checkpoints: the options of both strategies.

    ``MiCSStrategy(partition_size=8)`` and ``MiCSStrategy(MiCSOptions(partition_size=8))`` are the same;
    keyword arguments given beside an options object replace its values."""

    partition_size: PartitionSizeSpec = None
    """Ranks that shard one copy of the model states. ``None``/``"node"``: one node (the MiCS default);
    ``"world"`` or ``-1``: every rank (ZeRO-3); ``1``: no sharding (DDP-like); an int: that many ranks (a
    divisor of a node, or whole nodes); ``"auto"``: the planner picks it."""

    ranks_per_node: Optional[int] = None
    """Ranks on each node. ``None``: the launcher's ``LOCAL_WORLD_SIZE`` (or the SLURM / Open MPI
    equivalent), else the number of devices per node. Set it to emulate a multi-node layout on one machine."""

    ranks_per_region: Optional[int] = None
    """Ranks in each region (zone or data centre joined to the others by a slower link), whole nodes. ``None``:
    the environment's ``MICS_RANKS_PER_REGION``, else no regions. ``diloco_worker_size="region"`` reads it."""

    auto_wrap_policy: AutoWrapPolicy = None
    """Which modules become FSDP units. ``None``: children of every ``nn.ModuleList`` (e.g. transformer
    blocks) and the classes a Hugging Face style ``_no_split_modules`` names; if neither exists, the
    largest modules that split the model into at least 8 units; module class(es); a callable
    ``(name, module) -> bool``; ``False``: only the root."""

    reshard_after_forward: Union[bool, int] = True
    """Free gathered parameters after each unit's forward (ZeRO-3 style, least memory) or keep them until
    backward (``False``, less communication); an int reshards to that many ranks instead (it must divide
    the partition size)."""

    hierarchical: Hierarchical = "auto"
    """Two-stage all-gather / reduce-scatter (across nodes among same-local-rank peers, then inside the
    node) for partitions that span nodes. ``"auto"``: on exactly when a partition spans nodes; ``True``
    requires such a partition."""

    sharding: ShardingOption = None
    """AMSP per-state sharding degrees, ``ShardingSpec(params=..., grads=..., optim=...)``. ``grads``
    becomes the partition size; ``params`` smaller than it reshards parameters to that group after forward
    (1: keep them gathered through the step); ``optim`` larger than it shards optimizer states across
    replicas too. Replaces ``partition_size`` and ``reshard_after_forward`` (pass one or the other).
    ``"auto"``: the planner picks all three degrees -- the fastest layout predicted to fit memory."""

    grad_accumulation: Union[GradAccumulation, Literal["auto"]] = "sharded"
    """How gradients accumulate over the micro-steps of one optimizer step. ``"sharded"`` (MiCS's default):
    reduce-scatter inside the partition every micro-step, least memory. ``"unsharded"``: keep the full
    gradients until the boundary, then reduce-scatter once -- one reduce-scatter per optimizer step, for
    the memory of a full gradient. Both all-reduce across replicas once per optimizer step. ``"auto"``
    (Trainer only: Fabric does not know the accumulation count): the planner picks the faster mode that
    fits memory."""

    cross_replica_dtype: Union[str, torch.dtype, None] = None
    """The format gradients cross replicas in (hop 2, the slow inter-node links): ``None`` (their reduction
    dtype, fp32 in the mixed modes), ``"bf16"`` / ``"fp16"``: half the inter-node bytes, one 16-bit rounding
    per message, or ``"int8"``: blockwise int8 with one fp32 scale per 256 elements, ~0.25x the bytes.
    Reduce-scatters inside the partition and the optimizer stay in full precision."""

    cross_replica_overlap: bool = True
    """Start hop 2 for each FSDP unit as soon as its gradients are final on the boundary micro-step, so the
    transfer across nodes runs while backward computes the earlier units (DDP's buckets, with units as the
    buckets); the optimizer step waits for it. ``False``: FSDP2's own hop 2 on its 2-D mesh, which blocks the
    backward where there are no CUDA streams (CPU ranks), and a compressed hop 2 after backward."""

    cross_replica_sync: CrossReplicaSync = "every_step"
    """How often replica groups synchronise. ``"every_step"``: hop 2 all-reduces the gradients at every
    optimizer step, which equals plain data-parallel training. ``"diloco"``: semi-synchronous replica groups
    (DiLoCo, Douillard et al. 2023) for links too slow for a per-step hop 2 -- nothing crosses replicas on
    inner steps (gradients are still reduce-scattered inside the partition); every ``sync_every`` optimizer
    steps the groups average their parameter deltas and ``outer_optimizer`` applies them. Not equivalent to
    synchronous training for ``sync_every > 1`` (docs/semi-sync.md)."""

    sync_every: Optional[int] = None
    """With ``cross_replica_sync="diloco"`` (needed there, refused otherwise): optimizer steps each replica
    group takes on its own between two outer synchronisations (DiLoCo's H; the paper used 500). The bytes
    crossing replicas per optimizer step are divided by it."""

    outer_optimizer: Optional[OuterOptimizerFactory] = None
    """With ``cross_replica_sync="diloco"``: a callable that builds the outer optimizer from a list of
    tensors (the last-synchronised parameter shards), e.g. ``functools.partial(torch.optim.SGD, lr=0.7,
    momentum=0.9, nesterov=True)`` -- DiLoCo's, which ``None`` stands for. It steps on the replica-averaged
    pseudo-gradient (last-synchronised minus current parameters), element-wise on each rank's shards."""

    num_fragments: int = 1
    """With ``cross_replica_sync="diloco"``: streaming DiLoCo (Douillard et al. 2025; torchft's ``num_fragments``)
    -- the trained parameters split into this many fragments (cut between the model's FSDP units at about equal
    elements, or as ``fragment_modules`` names them), synchronised in turn, one every ``sync_every /
    num_fragments`` steps (each fragment every ``sync_every``): the same bytes per step, ``1 / num_fragments`` of
    them at a time. Must divide ``sync_every``."""

    fragment_sync_delay: int = 0
    """With ``cross_replica_sync="diloco"``: streaming DiLoCo's tau -- a fragment's average starts this many inner
    steps before it is applied, so that it crosses the link while they compute (overlap). Below
    ``sync_every / num_fragments``."""

    fragment_update_alpha: float = 0.0
    """With ``cross_replica_sync="diloco"``: streaming DiLoCo's alpha -- when a fragment's outer update lands, the
    parameters become ``(1 - alpha) * global + alpha * local`` (``local``: the group's own, trained during the
    delay). 0 takes the global values, as DiLoCo does."""

    fragment_modules: Optional[Sequence[str]] = None
    """With streaming DiLoCo (``num_fragments`` > 1): the modules of each fragment, in the order they synchronise,
    by their names in the model (``LightningModule.named_modules()``; e.g. ``["model.blocks.0", "model.blocks.1"]``)
    -- one fragment per name, ``num_fragments`` of them; a parameter under none joins the fragment before it.
    ``None``: fragments follow the model's FSDP units (cut between blocks, at about equal elements), by element
    count only where there are fewer units than fragments (the run says so)."""

    diloco_worker_size: WorkerSizeSpec = None
    """With ``cross_replica_sync="diloco"``: partition groups per DiLoCo worker. ``None`` or 1: each partition
    group is a worker (flat DiLoCo). Above 1, two-level DiLoCo: a worker's partition groups -- whole nodes, on the
    zone's network -- run the synchronous hop 2 every step (every ``cross_replica_*`` option applies to it), and
    only the workers average every ``sync_every`` steps (the outer round, on the slow link between regions).
    ``"region"``: one worker per region (``ranks_per_region``). Not with ``fault_tolerance`` (docs/semi-sync.md)."""

    activation_checkpointing_policy: AutoWrapPolicy = None
    """Recompute activations in backward for these modules: ``True`` = every wrapped block; module classes
    or a callable as for ``auto_wrap_policy``."""

    prefetch_depth: int = 1
    """Start the all-gather of the next ``N`` blocks while the current one computes (forward and backward),
    so communication overlaps compute; 0 leaves FSDP's implicit prefetching. Assumes blocks run in module
    order, as transformer layers do."""

    compile_blocks: bool = False
    """``torch.compile`` each wrapped block (in place) before sharding."""

    process_group_backend: Optional[str] = None
    """``"nccl"``, ``"gloo"``, ...; ``None``: NCCL on CUDA, gloo on CPU."""

    timeout: Union[timedelta, float, None] = default_pg_timeout
    """Timeout for collectives, so that a dead rank cannot hang the others forever: a ``timedelta`` or a
    number of seconds."""

    save_full_state_dict: bool = False
    """Save checkpoints as one file gathered on rank 0 (Lightning's usual format, for small models /
    export) instead of a sharded directory. Loading takes either."""

    sync_module_states: bool = True
    """Start every rank from global rank 0's parameters and buffers, as DDP does (one broadcast before
    sharding), so that training does not depend on every rank seeding alike. Meta-device models have no
    values before sharding: their replicas of each shard take the first replica's values instead."""

    async_save: bool = False
    """Write sharded checkpoints in the background (Trainer only): a save copies the states to CPU memory
    and returns; a worker thread (its own process group) writes, checksums and commits the shards. At most
    one save is in flight; loads, the next save and the end of the run wait for it. A failed background
    save raises at the next save or at teardown."""

    checkpoint_verify: VerifyMode = "checksum"
    """How a checkpoint's files are checked against its integrity record before loading: ``"checksum"``
    (sizes and CRC-32), ``"size"`` (sizes only, for very large checkpoints on slow storage) or ``"none"``."""

    release_gradients_after_step: bool = True
    """With automatic optimization (Trainer only), set the gradients to ``None`` as soon as the optimizer
    step has used them. Lightning zeroes them only after the next training step's forward, so otherwise a
    full set of gradients stays allocated through every forward (on a GPU: a whole fp32 gradient's worth more
    peak memory than a plain PyTorch loop, docs/gpu.md). ``False`` keeps Lightning's order, for code that
    reads ``.grad`` after the step. Manual optimization is never touched."""

    gc_freeze: bool = True
    """When training starts (the Trainer's ``fit``, Fabric's ``setup``), collect Python's garbage (fully the first
    time in a process) and ``gc.freeze()`` the rest -- torch, Lightning, the model: ~400 K objects -- until
    the strategy's teardown.
    Python's full garbage collections then skip those objects: without the freeze each one walks them all, a
    pause of a sizeable fraction of a second on each rank every minute or so of a CPU job, and about a
    millisecond after it. A synchronous job waits for the slowest rank, so
    each such pause, at a random step on any rank, stalls every rank (a fault-tolerant heal's copy set one off
    mid-quorum). Skipped when the garbage collector is disabled or something froze objects already (the
    process's own policy); ``False`` leaves the collector as it is."""

    buffer_sync: BufferSync = "broadcast"
    """How buffers (BatchNorm running statistics, ...) are made equal on every rank before each checkpoint's
    state is taken, at the start of each validation / test / predict run and at the end of fit (buffers are
    not sharded: each rank updates its own copy from its own data). ``"broadcast"``: global rank 0's, as
    DDP's ``broadcast_buffers`` -- exact for every dtype; ``"average"``: the mean over ranks of
    floating-point buffers (integer ones from rank 0); ``"none"``: each rank keeps its own. Fabric applies
    it in ``fabric.save`` and ``fabric.strategy.sync_buffers(model)``."""

    planner_cluster: PlannerCluster = None
    """What the planner assumes about the cluster for ``"auto"`` settings (only then; given without one it
    is refused). ``None``: a generic A100-class GPU cluster. ``"calibrate"``: measure this job's links,
    compute rate and optimizer-step rate at set-up. A preset name (``"p4d"``, ``"p3dn"``, ``"dgx-h100"``),
    the path of a ``lightning-mics plan calibrate --out`` JSON, or a ``lightning_mics.planner.ClusterSpec``."""

    fault_tolerance: Union[FaultTolerance, bool, dict, None] = None
    """Partition groups as fault domains (torchft): each replica group runs as its own job, a lost group
    costs a step instead of the job, and a restarted one heals from a live peer. A
    ``lightning_mics.FaultTolerance`` (Lighthouse address, this group's index, ...), ``True`` (all of it from
    the environment: ``TORCHFT_LIGHTHOUSE``, ``MICS_REPLICA_GROUP``, ``MICS_NUM_REPLICA_GROUPS``) or a dict of
    its fields; needs the ``[ft]`` extra. See docs/fault-tolerance.md."""

    cpu_offload: Union[bool, CPUOffloadPolicy] = False
    """Keep the sharded parameters, gradients and optimizer states in host memory (FSDP2's
    ``CPUOffloadPolicy``; ``True``: pinned memory, or pass a ``torch.distributed.fsdp.CPUOffloadPolicy``), for
    GPUs too small for the model states: each unit's shard is copied to the GPU for its all-gather and its
    gradient back, and the optimizer steps on the CPU. The planner counts only what stays on the GPU, plus
    the PCIe copies and the host optimizer step. GPU ranks only; not with ``cross_replica_dtype``,
    ``fault_tolerance`` or optimizer states sharded beyond the gradients (docs/usage.md#cpu-offload)."""

    def __post_init__(self) -> None:
        ft = self.fault_tolerance
        if ft is True or isinstance(ft, Mapping):  # a dict, or Hydra's DictConfig when instantiated without _convert_
            object.__setattr__(self, "fault_tolerance", FaultTolerance(**({} if ft is True else dict(ft))))
        elif ft is not None and not isinstance(ft, FaultTolerance):
            raise TypeError(
                f"fault_tolerance must be a lightning_mics.FaultTolerance, True (from the environment), a dict of its "
                f"fields or None, got {ft!r}."
            )
        self._check_values()
        self._check_combinations()

    def _check_values(self) -> None:
        """One clear error per malformed option."""
        region = self.ranks_per_region
        if region is not None and (isinstance(region, bool) or not isinstance(region, int) or region < 1):
            raise ValueError(f"ranks_per_region must be a positive int or None (no regions), got {region!r}.")
        rpn = self.ranks_per_node
        if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1):
            raise ValueError(
                f"ranks_per_node must be a positive int or None (detect from the launcher), got {rpn!r}"
                + (f"; write ranks_per_node={int(rpn)}." if str(rpn).isdigit() else ".")
            )
        reshard = self.reshard_after_forward
        if not isinstance(reshard, (bool, int)) or (not isinstance(reshard, bool) and reshard < 1):
            raise ValueError(f"reshard_after_forward={reshard!r} must be True, False or a positive group size.")
        make_wrap_predicate(self.auto_wrap_policy)  # a malformed policy fails here, not at setup
        if self.activation_checkpointing_policy is not True:
            make_wrap_predicate(self.activation_checkpointing_policy)
        as_timedelta(self.timeout)
        depth = self.prefetch_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"prefetch_depth must be a non-negative int, got {depth!r}.")
        if self.hierarchical not in (True, False, "auto"):
            raise ValueError(f"hierarchical must be True, False or 'auto', got {self.hierarchical!r}.")
        check_grad_accumulation(self.grad_accumulation, allow_auto=True)
        resolve_wire_format(self.cross_replica_dtype)
        if self.checkpoint_verify not in VERIFY_MODES:
            raise ValueError(
                f"checkpoint_verify={self.checkpoint_verify!r} is not one of {list(VERIFY_MODES)}: 'checksum' checks "
                "sizes and CRC-32 of every file before loading, 'size' only sizes, 'none' nothing."
            )
        for name in (
            "async_save", "release_gradients_after_step", "compile_blocks", "cross_replica_overlap", "gc_freeze"
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        check_buffer_sync(self.buffer_sync)

    def _check_combinations(self) -> None:
        sharding = self.sharding
        if sharding is not None and (self.partition_size is not None or self.reshard_after_forward is not True):
            raise ValueError(
                "Pass either sharding=ShardingSpec(...) or partition_size/reshard_after_forward, not both: the spec's "
                "grads degree is the partition size and its params degree sets the reshard group."
            )
        if sharding is not None and sharding != "auto" and not isinstance(sharding, ShardingSpec):
            raise TypeError(
                f"sharding must be a lightning_mics.ShardingSpec or 'auto' (the planner picks every degree), got "
                f"{sharding!r}."
            )
        check_planner_cluster(self.planner_cluster, plans=self.plans_anything)
        check_cpu_offload_option(self.cpu_offload, self.cross_replica_dtype, self.fault_tolerance, sharding)
        check_semi_sync_options(self)
        check_catch_up_heal(self.fault_tolerance, cross_replica_sync=self.cross_replica_sync)
        # (a semi-synchronous hop 2 is refused with DiLoCo's other checks, above)
        check_exact_trajectory(self.fault_tolerance, cross_replica_dtype=self.cross_replica_dtype)

    @property
    def plans_anything(self) -> bool:
        """Whether any setting is ``"auto"`` (the planner then runs at set-up)."""
        return "auto" in (self.partition_size, self.sharding, self.grad_accumulation)

    @property
    def timeout_delta(self) -> Optional[timedelta]:
        return as_timedelta(self.timeout)

    @classmethod
    def check_names(cls, options: Optional[MiCSOptions], values: dict[str, Any]) -> None:
        """What a strategy constructor was given: an optional options object and keyword options (which
        replace its values). An unknown keyword is refused with the nearest name."""
        if options is not None and not isinstance(options, MiCSOptions):
            raise TypeError(
                f"The first argument of MiCSStrategy is a lightning_mics.MiCSOptions, got {type(options).__name__}; "
                "pass options by name, e.g. MiCSStrategy(partition_size=8)."
            )
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in values if key not in names]
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(
                f"MiCSStrategy got an unknown option {unknown[0]!r}: {hint}the options are {', '.join(names)} "
                "(docs/options.md)."
            )

    def refuse_trainer_only(self) -> None:
        """Fabric: a Trainer-only option set to anything but its default is refused, saying why."""
        defaults = MiCSOptions()
        for name, why in TRAINER_ONLY.items():
            if getattr(self, name) != getattr(defaults, name):
                raise ValueError(f"{name} is a Trainer option that Fabric's MiCSStrategy does not take: {why}.")
        if self.grad_accumulation == "auto":
            raise ValueError(
                "grad_accumulation='auto' needs the number of micro-steps per optimizer step, which Fabric does not "
                "know: choose 'sharded' (reduce-scatter every micro-step, least memory) or 'unsharded' (one "
                "reduce-scatter per optimizer step); lightning_mics.planner.choose_layout(..., training=TrainingSpec("
                "accumulation=...), grad_accumulation='auto') compares them for yours."
            )
        if self.fault_tolerance is not None and self.cross_replica_sync == "diloco":
            raise ValueError(
                "fault_tolerance with cross_replica_sync='diloco' is built for the Trainer only (the quorum and heal "
                "run once per outer round, at its synchronisation). With Fabric drop one of the two, or train with the "
                "Trainer (docs/semi-sync.md)."
            )


#: The strategy names importing the package registers, with the Trainer and with Fabric alike:
#: name -> (description, MiCSStrategy keyword arguments). ``"mics_auto"`` is the fastest layout the
#: planner finds for the cluster the job runs on (measured at set-up); on the emulated cloud
#: cluster (2 x 4 ranks, ratio 24) it ran 1.31x Lightning's DDP and 1.83x HYBRID_SHARD, where ``"mics"`` (MiCS's
#: least-memory schedule) ran 0.95x HYBRID_SHARD (README, docs/benchmarks.md).
REGISTERED_STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mics": ("MiCS: shard inside one node, replicate across nodes, 2-hop gradient sync", {}),
    "mics_auto": (
        "MiCS with the planner's fastest layout and accumulation mode for the measured cluster",
        {"sharding": "auto", "grad_accumulation": "auto", "planner_cluster": "calibrate"},
    ),
    "mics_zero3": ("MiCS strategy sharding across all ranks (ZeRO-3)", {"partition_size": "world"}),
    "mics_replicate": ("MiCS strategy without sharding (DDP-like)", {"partition_size": 1}),
}


def register_strategy_names(strategy_registry: Any, strategy: Any, knows_accumulation: bool) -> None:
    """Register :data:`REGISTERED_STRATEGIES` in ``strategy_registry`` (the Trainer's or Fabric's), each built by
    ``strategy(**options)`` -- a strategy class or a factory.

    ``knows_accumulation=False`` (Fabric: the user's loop decides how many micro-steps make an
    optimizer step) leaves ``grad_accumulation`` at its default, ``"sharded"``, where a name asks for
    ``"auto"``: the planner still chooses the sharding degrees."""
    for name, (description, options) in REGISTERED_STRATEGIES.items():
        if not knows_accumulation and options.get("grad_accumulation") == "auto":
            options = {key: value for key, value in options.items() if key != "grad_accumulation"}
        strategy_registry.register(name, strategy, description=description, **options)


def as_timedelta(timeout: Union[timedelta, float, None]) -> Optional[timedelta]:
    """Collective timeouts are ``timedelta``s in torch; a plain number is taken as seconds."""
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return timedelta(seconds=timeout)
    raise ValueError(
        f"timeout={timeout!r} must be a datetime.timedelta or a positive number of seconds, e.g. timeout=1800."
    )


def option_docs() -> dict[str, str]:
    """Each option's docstring (the string literal under its field), read from this file's source --
    the one place options are documented."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(MiCSOptions)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for field_node, doc_node in zip(body, body[1:]):
        if isinstance(field_node, ast.AnnAssign) and isinstance(field_node.target, ast.Name):
            if isinstance(doc_node, ast.Expr) and isinstance(doc_node.value, ast.Constant):
                docs[field_node.target.id] = inspect.cleandoc(doc_node.value.value)
    return docs


def _default_text(value: Any) -> str:
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g} s"
    return repr(value)


def options_markdown() -> str:
    """The options table of ``docs/options.md``: name, default, which front ends take it, what it does."""
    docs = option_docs()
    rows = ["| option | default | front ends | what it does |", "|---|---|---|---|"]
    for f in dataclasses.fields(MiCSOptions):
        where = "Trainer" if f.name in TRAINER_ONLY else "Trainer, Fabric"
        text = " ".join(docs[f.name].split()).replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{_default_text(f.default)}` | {where} | {text} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m lightning_mics.options --markdown  (prints docs/options.md's table)")
    print(options_markdown())
