"""``cross_replica_sync`` and DiLoCo's options: what they may be, their defaults and the one check of them.

Declared apart from the schedule (:mod:`lightning_mics.hop2.diloco`), which imports the distributed runtime, so
that :mod:`lightning_mics.options` checks them when the options are created without importing it; the
combinations they refuse are DiLoCo's (docs/semi-sync.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, Optional

from torch import Tensor
from torch.optim import Optimizer

from lightning_mics.fault_tolerance.config import check_exact_trajectory
from lightning_mics.schedule import check_streaming_options

if TYPE_CHECKING:
    from lightning_mics.options import MiCSOptions

#: ``cross_replica_sync``: a hop 2 at every optimizer step, or DiLoCo's outer synchronisation every ``sync_every``.
CrossReplicaSync = Literal["every_step", "diloco"]
CROSS_REPLICA_SYNC_MODES: tuple[str, ...] = ("every_step", "diloco")

#: ``outer_optimizer``: builds the outer optimizer from the last-synchronised parameter shards.
OuterOptimizerFactory = Callable[[list[Tensor]], Optimizer]

#: DiLoCo's outer optimizer (Douillard et al., 2023, and torchft's examples): Nesterov SGD.
DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM = 0.7, 0.9


def check_semi_sync_options(options: MiCSOptions) -> None:
    """One clear error per option that does not fit ``cross_replica_sync`` (called when the options are made)."""
    mode = options.cross_replica_sync
    if mode not in CROSS_REPLICA_SYNC_MODES:
        raise ValueError(
            f"cross_replica_sync={mode!r} is not one of {list(CROSS_REPLICA_SYNC_MODES)}: 'every_step' (hop 2 every "
            "optimizer step, synchronous) or 'diloco' (replica groups synchronise every sync_every steps)."
        )
    streaming = [name for name, default in STREAMING_DEFAULTS.items() if getattr(options, name) != default]
    if mode != "diloco":
        given = [
            name for name in ("sync_every", "outer_optimizer", "diloco_worker_size") if getattr(options, name) is not None
        ] + streaming
        if given:
            raise ValueError(
                f"{' and '.join(given)} only {'applies' if len(given) == 1 else 'apply'} to semi-synchronous replica "
                "groups: add cross_replica_sync='diloco', or drop them."
            )
        return
    every = options.sync_every
    if every is None:
        raise ValueError(
            "cross_replica_sync='diloco' needs sync_every=H, the optimizer steps each replica group takes on its own "
            "between outer synchronisations (DiLoCo used 500; at 1 it is synchronous training with an outer step)."
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"sync_every must be a positive int (optimizer steps between outer syncs), got {every!r}.")
    if options.outer_optimizer is not None and not callable(options.outer_optimizer):
        raise TypeError(
            "outer_optimizer must be a callable that builds an optimizer from a list of tensors, e.g. "
            f"functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True); got {options.outer_optimizer!r}."
        )
    check_streaming_options(every, options.num_fragments, options.fragment_sync_delay, options.fragment_update_alpha)
    _check_fragment_modules(options)
    ft = options.fault_tolerance
    worker = options.diloco_worker_size
    if worker is not None and worker != "region" and (isinstance(worker, bool) or not isinstance(worker, int)
                                                      or worker < 1):
        raise ValueError(
            f"diloco_worker_size={worker!r} must be a positive number of partition groups per DiLoCo worker, 'region' "
            "(one worker per region, ranks_per_region) or None (each partition group its own worker)."
        )
    if worker not in (None, 1) and options.partition_size == "auto":
        raise ValueError(
            f"diloco_worker_size={worker!r} (two-level DiLoCo) with partition_size='auto' is not planned at set-up: "
            "give partition_size (lightning-mics plan --nodes-per-region ... --diloco-worker-size ... weighs them)."
        )
    if ft is not None and worker not in (None, 1):
        raise ValueError(
            f"diloco_worker_size={worker!r} (two-level DiLoCo) with fault_tolerance is not built: torchft's replica "
            "groups are whole partition groups, each its own DiLoCo worker. Drop fault_tolerance, or use flat "
            "DiLoCo with it (diloco_worker_size=None)."
        )
    if ft is not None:
        check_exact_trajectory(ft, "diloco")
        if ft.keep_trajectory:
            raise ValueError(
                "FaultTolerance(keep_trajectory=True) cannot be combined with cross_replica_sync='diloco': each "
                "replica group takes its inner steps on its own share of the data, and a lost group misses outer "
                "rounds rather than having its share read by the others. Leave keep_trajectory unset (or False)."
            )
        # unset: fixed shares, the only data assignment DiLoCo has (resolved here, once, for every reader)
        object.__setattr__(options, "fault_tolerance", replace(ft, keep_trajectory=False))
    refused = {
        "sharding='auto'": (
            options.sharding == "auto",
            "the planner may shard optimizer states across replicas, which DiLoCo cannot (each group steps its own "
            "inner optimizer); use partition_size='auto' or an explicit ShardingSpec with optim <= grads",
        ),
        "cpu_offload": (options.cpu_offload not in (False, None), "offloaded shards are not built for DiLoCo yet"),
        "save_full_state_dict=True": (
            options.save_full_state_dict,
            "the replicas' own parameters and inner optimizer states are kept in sharded checkpoints only",
        ),
    }
    for name, (applies, why) in refused.items():
        if applies:
            raise ValueError(f"cross_replica_sync='diloco' cannot be combined with {name}: {why}. Drop one of the two.")


#: Streaming DiLoCo's options and the values that mean "plain DiLoCo" (the whole model synchronised at once).
STREAMING_DEFAULTS: dict[str, Any] = {
    "num_fragments": 1, "fragment_sync_delay": 0, "fragment_update_alpha": 0.0, "fragment_modules": None,
}


def _check_fragment_modules(options: MiCSOptions) -> None:
    """``fragment_modules``: distinct module names, one per fragment (stored as a tuple: Hydra gives a ListConfig)."""
    names = options.fragment_modules
    if names is None:
        return
    if isinstance(names, str) or not isinstance(names, Sequence) or not all(
        isinstance(n, str) and n for n in names
    ):
        raise ValueError(
            f"fragment_modules must be a list of module names (as in named_modules()), one per fragment, got {names!r}."
        )
    names = tuple(names)
    if len(set(names)) != len(names):
        raise ValueError(f"fragment_modules names a module more than once: {list(names)}.")
    if len(names) != options.num_fragments:
        raise ValueError(
            f"fragment_modules names {len(names)} module(s), one per fragment: set num_fragments={len(names)} "
            f"(it is {options.num_fragments})."
        )
    object.__setattr__(options, "fragment_modules", names)


def describe_outer_optimizer(factory: Optional[OuterOptimizerFactory]) -> str:
    """For logs: DiLoCo's default or the callable given."""
    if factory is None:
        return f"SGD(lr={DILOCO_OUTER_LR}, momentum={DILOCO_OUTER_MOMENTUM}, nesterov=True) (DiLoCo's)"
    if isinstance(factory, partial):
        arguments = ", ".join(f"{k}={v!r}" for k, v in factory.keywords.items())
        return f"{getattr(factory.func, '__name__', factory.func)}({arguments})"
    return getattr(factory, "__name__", repr(factory))
