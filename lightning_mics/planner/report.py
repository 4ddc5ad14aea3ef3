"""A plan: the ranked layouts of one job, and how they are shown (table, explanation, JSON)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional, Union

from lightning_mics.planner.cost_model import LayoutEstimate
from lightning_mics.planner.specs import GB, GIB, ClusterSpec, ModelSpec, TrainingSpec
from lightning_mics.planner.ties import MEMORY_TIE_TOLERANCE, TIE_TOLERANCE, lost_because, near_ties

# ---------------------------------------------------------------------------------------------- search


#: The share of a step the GPUs must spend computing for a layout to keep them busy: below it, in every
#: synchronous layout, :class:`SemiSyncAdvice` is worked out.
BUSY_ENOUGH = 0.5


@dataclass(frozen=True)
class SemiSyncAdvice:
    """When the link across replicas is so slow that no synchronous layout keeps the GPUs busy
    (:data:`BUSY_ENOUGH`): the semi-synchronous layout (``cross_replica_sync="diloco"``) with the smallest
    ``sync_every`` that does -- the smallest because it stays closest to synchronous training."""

    synchronous: LayoutEstimate  #: the best synchronous layout (the plan's winner)
    semi_sync: LayoutEstimate  #: the best layout with DiLoCo at :attr:`sync_every`
    #: ranks per region where the cluster has several regions (the plan then weighs workers of a region first)
    synchronous_region_ranks: Optional[int] = None

    @property
    def two_level(self) -> bool:
        """Synchronous inside each DiLoCo worker of several partition groups, DiLoCo across workers."""
        return self.semi_sync.diloco_worker_size > 1

    @property
    def sync_every(self) -> int:
        assert self.semi_sync.sync_every is not None
        return self.semi_sync.sync_every

    def explain(self) -> str:
        best, semi = self.synchronous, self.semi_sync
        return (
            f"  the link across replicas is too slow for a hop 2 at every step: the best synchronous layout keeps the "
            f"GPUs computing {100 * best.busy_fraction:.0f}% of its {best.step_time_s:.3g} s step. Semi-synchronous "
            f"replica groups would keep them {100 * semi.busy_fraction:.0f}% busy ({semi.name}, "
            f"{semi.step_time_s:.3g} s/step, {best.step_time_s / semi.step_time_s:.2f}x the "
            f"tokens/s): MiCSStrategy(cross_replica_sync='diloco', sync_every={self.sync_every}, "
            f"partition_size={semi.layout.partition_size}"
            + (", diloco_worker_size='region'" if self.two_level else "")
            + f"). {self._levels()}DiLoCo is not synchronous training -- measure the loss it reaches "
            "(docs/semi-sync.md)."
        )

    def _levels(self) -> str:
        """Which levels synchronise how: where the cluster has regions, whether the DiLoCo workers are its regions
        (a hop 2 or the partition's collectives every step inside each, DiLoCo only across regions)."""
        semi, region = self.semi_sync, self.synchronous_region_ranks
        if region is None:
            return ""
        worker_ranks = semi.layout.grads * semi.diloco_worker_size
        if worker_ranks == region:
            inside = (
                f"DiLoCo workers of {semi.diloco_worker_size} partition groups, a hop 2 at every step between them"
                if semi.diloco_worker_size > 1 else "one partition group sharding the model states across the region"
            )
            return f"Two-level: synchronous inside each region ({inside}), DiLoCo across regions only. "
        return (
            f"Flat: DiLoCo workers of {worker_ranks} rank{'s' if worker_ranks != 1 else ''}, smaller than a region of "
            f"{region} -- even inside a region "
            "the links cannot carry a per-step hop 2 while the GPUs stay busy. "
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "sync_every": self.sync_every,
            "diloco_worker_size": self.semi_sync.diloco_worker_size,
            "synchronous_busy_fraction": self.synchronous.busy_fraction,
            "semi_sync": self.semi_sync.to_dict(),
        }


#: Lightning's names for the precisions the planner knows (``deepspeed-fp16`` is DeepSpeed's recipe, not one)
_LIGHTNING_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


@dataclass(frozen=True)
class Plan:
    """The ranked layouts for one job: fitting layouts first, fastest first, the near-ties' winner on top
    (:mod:`lightning_mics.planner.ties`)."""

    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingSpec
    ranked: tuple[LayoutEstimate, ...]
    #: a synchronous plan whose best layout leaves the GPUs mostly waiting: the semi-synchronous way out
    semi_sync_advice: Optional[SemiSyncAdvice] = None
    #: step times within this fraction of the fastest were a tie (the winner chosen by rules, not the time)
    tie_tolerance: float = TIE_TOLERANCE
    #: memory within this fraction of the usable device memory counted as a tie too
    memory_tie_tolerance: float = MEMORY_TIE_TOLERANCE
    #: the ``hierarchical`` the layouts were priced with (``"auto"``: two-stage wherever a partition spans nodes)
    hierarchical: Union[bool, Literal["auto"]] = "auto"
    #: the strategy's ``cross_replica_dtype`` priced for hop 2 (``None``: the gradients' reduction dtype)
    cross_replica_dtype: Optional[str] = None
    #: the accumulation mode(s) asked for: one mode, or ``"auto"`` (every layout priced in both)
    grad_accumulation: str = "sharded"

    @property
    def winner(self) -> LayoutEstimate:
        return self.ranked[0]

    @property
    def any_fits(self) -> bool:
        return self.winner.fits

    @property
    def fitting(self) -> tuple[LayoutEstimate, ...]:
        return tuple(c for c in self.ranked if c.fits)

    @property
    def near_ties(self) -> tuple[LayoutEstimate, ...]:
        """The fitting layouts predicted within :attr:`tie_tolerance` of the fastest, fastest first."""
        return tuple(near_ties(self.ranked, self.tie_tolerance))

    def find(self, params: int, grads: int, optim: int, grad_accumulation: Optional[str] = None) -> LayoutEstimate:
        """The best-ranked estimate of layout (P, G, OS), in ``grad_accumulation`` when given."""
        for candidate in self.ranked:
            layout = candidate.layout
            if (layout.params, layout.grads, layout.optim) == (params, grads, optim) and (
                grad_accumulation in (None, candidate.grad_accumulation)
            ):
                return candidate
        raise KeyError(
            f"No layout P={params} G={grads} OS={optim}"
            + (f" with grad_accumulation={grad_accumulation}" if grad_accumulation else "")
            + " in this plan."
        )

    # ------------------------------------------------------------------------------------------ the winner
    def strategy_arguments(self) -> Optional[dict[str, Any]]:
        """The winner as ``MiCSStrategy`` keyword arguments (values as Python source text), only those that
        differ from the strategy's defaults or carry the choice; ``None`` when no layout fits."""
        best = self.winner
        if not best.fits:
            return None
        layout, training = best.layout, self.training
        arguments: dict[str, Any] = {}
        if layout.is_uniform:
            arguments["partition_size"] = str(layout.grads)
        else:
            arguments["sharding"] = f"ShardingSpec(params={layout.params}, grads={layout.grads}, optim={layout.optim})"
        if training.accumulation > 1 and layout.grads > 1:
            arguments["grad_accumulation"] = repr(best.grad_accumulation)
        if layout.grads > layout.ranks_per_node and self.hierarchical is False:
            arguments["hierarchical"] = "False"
        if self.cross_replica_dtype is not None:
            arguments["cross_replica_dtype"] = repr(self.cross_replica_dtype)
        if not training.cross_replica_overlap:
            arguments["cross_replica_overlap"] = "False"
        if training.sync_every is not None:
            arguments["cross_replica_sync"] = repr("diloco")
            arguments["sync_every"] = str(training.sync_every)
            if training.diloco_worker_size != 1:
                arguments["diloco_worker_size"] = repr(training.diloco_worker_size)
            if training.num_fragments != 1:
                arguments["num_fragments"] = str(training.num_fragments)
            if training.fragment_sync_delay:
                arguments["fragment_sync_delay"] = str(training.fragment_sync_delay)
        if training.cpu_offload:
            arguments["cpu_offload"] = "True"
        if training.activation_checkpointing:
            arguments["activation_checkpointing_policy"] = "True"
        return arguments

    def strategy_line(self) -> Optional[str]:
        """The winner as the ``MiCSStrategy(...)`` to paste (``None`` when no layout fits)."""
        arguments = self.strategy_arguments()
        if arguments is None:
            return None
        return "MiCSStrategy(" + ", ".join(f"{key}={value}" for key, value in arguments.items()) + ")"

    def trainer_line(self) -> Optional[str]:
        """The ``Trainer`` settings the plan assumed beside the strategy: the cluster's shape, the precision
        and the micro-steps per optimizer step (``None`` when no layout fits)."""
        if not self.any_fits:
            return None
        parts = [f"num_nodes={self.cluster.nodes}", f"devices={self.cluster.gpus_per_node}"]
        if self.training.precision in _LIGHTNING_PRECISIONS:
            parts.append(f"precision={self.training.precision!r}")
        if self.training.accumulation > 1:
            parts.append(f"accumulate_grad_batches={self.training.accumulation}")
        return "Trainer(" + ", ".join(parts) + ")"

    def strategy_text(self) -> str:
        """The winner as code: the import, the strategy and the Trainer it was planned for."""
        strategy, trainer = self.strategy_line(), self.trainer_line()
        if strategy is None or trainer is None:
            return "No layout fits, so there is no strategy to recommend (see above)."
        names = "MiCSStrategy, ShardingSpec" if "ShardingSpec(" in strategy else "MiCSStrategy"
        note = "" if self.training.precision in _LIGHTNING_PRECISIONS else (
            f" ({self.training.precision} is DeepSpeed's recipe, not a Lightning precision: set the one you train in)"
        )
        return "\n".join(
            [
                f"The winner as a strategy (from lightning_mics import {names}):",
                f"    {strategy}",
                f"  with {trainer}, as planned" + note,
            ]
        )

    def explain(self) -> str:
        """Why the winner wins: against the runner-up and, when different, the MiCS default and ZeRO-3."""
        best = self.winner
        if not best.fits:
            return (
                f"No layout fits in {gib_text(best.usable_memory_bytes)} usable per GPU; the leanest, "
                f"{leanest(self.ranked).name}, needs {gib_text(leanest(self.ranked).memory.total)}. "
                "Add GPUs or nodes, use "
                f"activation checkpointing, a smaller micro-batch or bf16-true"
                + ("." if self.training.cpu_offload else ", or offload the states to host memory (cpu_offload).")
            )
        lines = [
            (
                f"{best.name} wins: {best.step_time_s:.3g} s/step ({best.tokens_per_s:,.0f} tokens/s), "
                f"{best.exposed_comm_s:.3g} s exposed communication, {_gb(best.inter_node_bytes)} across nodes per "
                f"node, {gib_text(best.memory.total)} of {gib_text(best.usable_memory_bytes)} per GPU, "
                f"gradients accumulated {best.accumulation_text}."
            )
        ]
        if best.cpu_offload:
            lines.append(
                f"  cpu offload on: {gib_text(best.memory.host)} of states per rank in host memory, "
                f"{best.host_copy_s:.3g} s of PCIe copies and a {best.optimizer_step_s:.3g} s host optimizer step "
                f"per step (host link {_gb(self.cluster.host_link_bandwidth)}/s, host optimizer "
                f"{_gb(self.cluster.host_memory_bandwidth)}/s assumed unless the cluster says otherwise)."
            )
        if best.sync_every is not None:
            lines.append(
                f"  semi-synchronous (DiLoCo, sync_every={best.sync_every}): the replicas average their parameter "
                f"deltas once every {best.sync_every} steps, priced here at 1/{best.sync_every} per step"
                + self._streaming_text()
                + f"; GPUs computing {100 * best.busy_fraction:.0f}% of the step. Not synchronous training "
                "(docs/semi-sync.md)."
            )
        if self.semi_sync_advice is not None:
            lines.append(self.semi_sync_advice.explain())
        elif best.sync_every is None and self.cluster.regions > 1 and best.busy_fraction >= BUSY_ENOUGH:
            lines.append(
                f"  {self.cluster.regions} regions of {self.cluster.nodes_per_region} nodes: the links between them "
                f"carry a hop 2 at every step with the GPUs computing {100 * best.busy_fraction:.0f}% of it -- "
                "synchronous MiCS, no DiLoCo needed."
            )
        world, node = self.cluster.world_size, min(self.cluster.gpus_per_node, self.cluster.world_size)
        rivals: list[tuple[str, LayoutEstimate]] = []
        if len(self.ranked) > 1:
            rivals.append(("the runner-up, " + self.ranked[1].name, self.ranked[1]))
        for label, degree in (("MiCS's one-node default", node), ("ZeRO-3", world)):
            try:
                rival = self.find(degree, degree, degree)
            except KeyError:
                continue
            rivals.append((f"{label} ({_without_kind(rival)})", rival))
        seen = {id(best)}
        for label, rival in rivals:
            if id(rival) in seen:
                continue
            seen.add(id(rival))
            lines.append(f"  vs {label}: {self._compare(best, rival)}")
        return "\n".join(lines)

    def _compare(self, best: LayoutEstimate, rival: LayoutEstimate) -> str:
        """One line naming the terms that separate two layouts, and the tie-break when it decided."""
        if not rival.fits:
            return f"does not fit ({gib_text(rival.memory.total)} > {gib_text(rival.usable_memory_bytes)})."
        ratio = rival.step_time_s / best.step_time_s
        tied = self.near_ties
        why = lost_because(rival, best, tied, self.memory_tie_tolerance) if len(tied) > 1 else None
        tie = f"within the {100 * self.tie_tolerance:.0f} % tie"
        if ratio >= 1:
            parts = [f"{rival.step_time_s:.3g} s/step, {_slower_text(ratio)}" + (f" ({tie}; {why})" if why else "")]
        else:
            reason = why or "the tie-break preferred the winner"
            faster = f"predicted {100 * (1 - ratio):.1f} % faster ({rival.step_time_s:.3g} s/step)"
            parts = [f"{faster}, {tie}, but {reason}"]
        exposed_gap = rival.exposed_comm_s - best.exposed_comm_s
        if abs(exposed_gap) > 0.01 * best.step_time_s:
            parts.append(f"{rival.exposed_comm_s:.3g} s exposed communication vs {best.exposed_comm_s:.3g}")
        if ratio >= 1 and rival.inter_node_bytes > 1.05 * best.inter_node_bytes and not (why and "sends" in why):
            parts.append(f"{_gb(rival.inter_node_bytes)} across nodes vs {_gb(best.inter_node_bytes)}")
        if rival.compute_s > 1.001 * best.compute_s:
            parts.append("more recompute")
        if rival.memory.total < best.memory.total:
            parts.append(f"though it needs less memory ({gib_text(rival.memory.total)})")
        elif not (why and "GiB more" in why) and rival.memory.total > best.memory.total + 0.5 * GIB:
            parts.append(f"{gib_text(rival.memory.total)} per GPU vs {gib_text(best.memory.total)}")
        return "; ".join(parts) + "."

    # ------------------------------------------------------------------------------------------ the table
    def table(self, top: Optional[int] = None, show_infeasible: bool = False, notes: bool = True) -> str:
        """The ranked table as fixed-width text, with notes under it: how near-ties were decided, what the
        accumulation modes mean, and the rows left out. Layouts that do not fit are summarised in one note
        unless ``show_infeasible`` (or unless none fits: then the table lists them, leanest first)."""
        fitting = list(self.fitting)
        if show_infeasible:
            pool = list(self.ranked)
        elif fitting:
            pool = fitting
        else:
            pool = sorted(self.ranked, key=lambda c: c.memory.total)
        shown = pool[:top] if top else pool
        tied = self.near_ties
        tie_ids = {id(c) for c in tied} if len(tied) > 1 else set()
        with_fits = any(not c.fits for c in shown)
        header = ["#", "layout", "grad acc", "step s", "vs #1", "tokens/s", "exposed comm s", "inter-node GB",
                  "mem GiB/GPU"] + (["fits"] if with_fits else [])
        rows = [header]
        first = shown[0].step_time_s  # the winner, or with nothing fitting the leanest layout
        for index, candidate in enumerate(shown, start=1):
            versus = "" if index == 1 else f"{100 * (candidate.step_time_s / first - 1):+.1f}%"
            if id(candidate) in tie_ids:
                versus = (versus + " ~").strip()
            row = [
                str(index),
                candidate.layout_text,
                candidate.accumulation_text,
                f"{candidate.step_time_s:.4g}",
                versus,
                f"{candidate.tokens_per_s:,.0f}",
                f"{candidate.exposed_comm_s:.4g}",
                f"{candidate.inter_node_bytes / GB:.3g}",
                f"{candidate.memory.total / GIB:.1f}",
            ] + (["yes" if candidate.fits else "NO"] if with_fits else [])
            rows.append(row)
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * width for width in widths))
        if notes:
            lines.extend(self._table_notes(shown, pool, fitting, show_infeasible, top))
        return "\n".join(lines)

    def _table_notes(
        self,
        shown: list[LayoutEstimate],
        pool: list[LayoutEstimate],
        fitting: list[LayoutEstimate],
        show_infeasible: bool,
        top: Optional[int],
    ) -> list[str]:
        notes: list[str] = []
        tied = self.near_ties
        if len(tied) > 1:
            winner, fastest = self.winner, tied[0]
            text = (
                f"~ a tie: {len(tied)} layouts are predicted within {100 * self.tie_tolerance:.0f} % of the fastest "
                f"({fastest.step_time_s:.4g} s), closer than the cost model can tell apart. #1 is chosen among them by "
                "the fewest bytes across nodes, then a gradient partition inside one node, then OS = G, then the "
                f"least memory per GPU (the fastest where memory, too, is within {100 * self.memory_tie_tolerance:.0f} "
                "% of the usable GPU memory)."
            )
            if fastest is not winner:
                where = next((f"#{i} " for i, c in enumerate(shown, start=1) if c is fastest), "")
                text += (
                    f" {where}({fastest.layout_text}, {fastest.accumulation_text}) is predicted "
                    f"{100 * (1 - fastest.step_time_s / winner.step_time_s):.1f} % faster than #1 but lost the tie "
                    f"because {lost_because(fastest, winner, tied, self.memory_tie_tolerance)}."
                )
            notes.append(text)
        modes = {c.accumulation_text for c in shown}
        legend = {
            "sharded": "sharded = reduce-scatter inside the partition every micro-step (MiCS's default, least memory)",
            "unsharded": "unsharded = whole gradients kept until the optimizer step, one reduce-scatter per step "
            "(more memory)",
            "replicated": "replicated = a partition of one (G=1): whole gradients on every rank",
        }
        text = "grad acc: " + "; ".join(legend[mode] for mode in legend if mode in modes) + "."
        if self.grad_accumulation == "auto" and self.training.accumulation == 1:
            text += " At 1 micro-step per optimizer step the two modes are one schedule: the rows say sharded."
        notes.append(text)
        unfit = len(self.ranked) - len(fitting)
        if not show_infeasible and fitting and unfit:
            lean = leanest(c for c in self.ranked if not c.fits)
            notes.append(
                f"{unfit} more {_layouts(unfit)} not fit in {gib_text(self.winner.usable_memory_bytes)} usable per GPU "
                f"(the leanest of them, {lean.name}, needs {gib_text(lean.memory.total)}); --show-infeasible lists "
                "them."
            )
        if top and len(pool) > top:
            hidden = len(pool) - top
            notes.append(
                f"{hidden} more {'' if show_infeasible else 'fitting '}layout{'s' if hidden > 1 else ''} not shown "
                "(--top 0 lists them all)."
            )
        return [textwrap.fill(note, width=118, subsequent_indent="  ", break_on_hyphens=False) for note in notes]

    def to_dict(self, top: Optional[int] = None) -> dict[str, Any]:
        tied = self.near_ties
        return {
            "cluster": asdict(self.cluster),
            "model": asdict(self.model),
            "training": asdict(self.training),
            "winner": self.winner.to_dict(),
            "strategy": self.strategy_line(),
            "strategy_arguments": self.strategy_arguments(),
            "explanation": self.explain(),
            "semi_sync_advice": self.semi_sync_advice.to_dict() if self.semi_sync_advice is not None else None,
            "tie": {
                "tolerance": self.tie_tolerance,
                "memory_tolerance": self.memory_tie_tolerance,
                "layouts": len(tied),
                "fastest_step_time_s": tied[0].step_time_s if tied else None,
            },
            "ranked": [c.to_dict() for c in (self.ranked[:top] if top else self.ranked)],
        }

    def _streaming_text(self) -> str:
        fragments, delay = self.training.num_fragments, self.training.fragment_sync_delay
        if fragments == 1 and delay == 0:
            return ""
        return (
            f", in {fragments} fragment(s) each started {delay} inner step(s) before its turn (streaming DiLoCo: "
            "what of each fragment's average fits behind those steps is priced as hidden)"
        )

    def to_json(self, top: Optional[int] = None) -> str:
        return json.dumps(self.to_dict(top), indent=2)


def gib_text(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _gb(value: float) -> str:
    return f"{value / GB:.3g} GB"


def leanest(candidates: Iterable[LayoutEstimate]) -> LayoutEstimate:
    return min(candidates, key=lambda c: c.memory.total)


def _layouts(count: int) -> str:
    return "layout does" if count == 1 else "layouts do"


def _without_kind(estimate: LayoutEstimate) -> str:
    """``estimate``'s name without its family ("ZeRO-3: P=32 ..." -> "P=32 ..."), for lines that name it."""
    return estimate.name.split(": ", 1)[-1]


def _slower_text(ratio: float) -> str:
    """A step-time ratio as words: per cent below 1.1x (where "1.00x slower" would hide the gap), else x."""
    if ratio < 1.1:
        return f"{100 * (ratio - 1):.1f} % slower"
    return f"{ratio:.2f}x the step time"
