"""A plan: the ranked layouts of one job, and how they are shown (table, explanation, JSON)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Optional

from lightning_mics.planner.cost_model import LayoutEstimate
from lightning_mics.planner.specs import GB, GIB, ClusterSpec, ModelSpec, TrainingSpec

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
            f"partition_size={semi.layout.partition_size}). DiLoCo is not synchronous training -- measure the loss it "
            "reaches (docs/semi-sync.md)."
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "sync_every": self.sync_every,
            "synchronous_busy_fraction": self.synchronous.busy_fraction,
            "semi_sync": self.semi_sync.to_dict(),
        }


@dataclass(frozen=True)
class Plan:
    """The ranked layouts for one job: fitting layouts first, fastest first."""

    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingSpec
    ranked: tuple[LayoutEstimate, ...]
    #: a synchronous plan whose best layout leaves the GPUs mostly waiting: the semi-synchronous way out
    semi_sync_advice: Optional[SemiSyncAdvice] = None

    @property
    def winner(self) -> LayoutEstimate:
        return self.ranked[0]

    @property
    def any_fits(self) -> bool:
        return self.winner.fits

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
            f"{best.name} wins: {best.step_time_s:.3g} s/step ({best.tokens_per_s:,.0f} tokens/s), "
            f"{best.exposed_comm_s:.3g} s exposed communication, {_gb(best.inter_node_bytes)} across nodes per node, "
            f"{gib_text(best.memory.total)} of {gib_text(best.usable_memory_bytes)} per GPU."
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
        world, node = self.cluster.world_size, min(self.cluster.gpus_per_node, self.cluster.world_size)
        rivals: list[tuple[str, LayoutEstimate]] = []
        if len(self.ranked) > 1:
            rivals.append(("runner-up", self.ranked[1]))
        for label, degree in (("MiCS default", node), ("ZeRO-3", world)):
            try:
                rivals.append((label, self.find(degree, degree, degree)))
            except KeyError:
                pass
        seen = {id(best)}
        for label, rival in rivals:
            if id(rival) in seen:
                continue
            seen.add(id(rival))
            lines.append(f"  vs {label} {rival.name}: {_compare(best, rival)}")
        return "\n".join(lines)

    def table(self, top: Optional[int] = None) -> str:
        """The ranked table as fixed-width text."""
        header = ("#", "layout", "step s", "tokens/s", "exposed comm s", "inter-node GB", "mem GiB/GPU", "fits")
        rows = [header]
        for index, candidate in enumerate(self.ranked[:top] if top else self.ranked, start=1):
            rows.append(
                (
                    str(index),
                    candidate.name,
                    f"{candidate.step_time_s:.4g}",
                    f"{candidate.tokens_per_s:,.0f}",
                    f"{candidate.exposed_comm_s:.4g}",
                    f"{candidate.inter_node_bytes / GB:.3g}",
                    f"{candidate.memory.total / GIB:.1f}",
                    "yes" if candidate.fits else "NO",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * width for width in widths))
        return "\n".join(lines)

    def to_dict(self, top: Optional[int] = None) -> dict[str, Any]:
        return {
            "cluster": asdict(self.cluster),
            "model": asdict(self.model),
            "training": asdict(self.training),
            "winner": self.winner.to_dict(),
            "explanation": self.explain(),
            "semi_sync_advice": self.semi_sync_advice.to_dict() if self.semi_sync_advice is not None else None,
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


def _compare(best: LayoutEstimate, rival: LayoutEstimate) -> str:
    """One line naming the terms that separate two layouts."""
    if not rival.fits:
        return f"does not fit ({gib_text(rival.memory.total)} > {gib_text(rival.usable_memory_bytes)})."
    ratio = rival.step_time_s / best.step_time_s
    if ratio >= 1:
        parts = [f"{rival.step_time_s:.3g} s/step ({ratio:.2f}x slower)"]
    else:
        parts = [
            f"predicted {100 * (1 - ratio):.1f}% faster ({rival.step_time_s:.3g} s/step), within the tie tolerance, "
            f"but it sends {_gb(rival.inter_node_bytes)} across nodes vs {_gb(best.inter_node_bytes)}"
        ]
    exposed_gap = rival.exposed_comm_s - best.exposed_comm_s
    if abs(exposed_gap) > 0.01 * best.step_time_s:
        parts.append(f"{rival.exposed_comm_s:.3g} s exposed communication vs {best.exposed_comm_s:.3g}")
    if ratio >= 1 and rival.inter_node_bytes > 1.05 * best.inter_node_bytes:
        parts.append(f"{_gb(rival.inter_node_bytes)} across nodes vs {_gb(best.inter_node_bytes)}")
    if rival.compute_s > 1.001 * best.compute_s:
        parts.append("more recompute")
    if rival.memory.total < best.memory.total:
        parts.append(f"though it needs less memory ({gib_text(rival.memory.total)})")
    return "; ".join(parts) + "."
