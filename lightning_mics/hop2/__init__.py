"""Hop 2 -- what crosses the replication groups -- in one place: every cross-replica schedule, one module each.

* :mod:`~lightning_mics.hop2.mode` -- *who* runs it and *when* (:class:`Hop2`, decided once per layout by
  :func:`decide_hop2`; pure Python, read by the planner too);
* :mod:`~lightning_mics.hop2.attach` -- the step hook each optimizer gets from its schedule (:func:`attach
  <lightning_mics.hop2.attach.attach>`, which the engine calls);
* the schedules: :mod:`~lightning_mics.hop2.pipeline` (behind or after backward: pack each unit's gradient shards,
  start their average, finish before clipping and the step, unpack, commit or drop; :mod:`~lightning_mics.hop2.
  shares` keeps the data shares apart for ``exact_trajectory``), :mod:`~lightning_mics.hop2.optimizer_states`
  (AMSP: the gradients reduce-scattered into optimizer-state slices across replicas), :mod:`~lightning_mics.hop2.
  diloco` (DiLoCo and streaming DiLoCo: an outer synchronisation every H steps) and :mod:`~lightning_mics.hop2.
  fsdp` (FSDP2's own all-reduce on its 2-D mesh);
* :mod:`~lightning_mics.hop2.transport` -- *over what*: the replication process group (fp32 or a compressed
  wire) or torchft's Manager across fault domains;
* :mod:`~lightning_mics.hop2.diloco_options` -- ``cross_replica_sync`` and DiLoCo's options, declared without the
  runtime.

Only :mod:`~lightning_mics.hop2.mode` is imported here, so that the planner reads the rule without the
runtime; the engine imports the rest from their modules.
"""

from lightning_mics.hop2.mode import Hop2, Hop2Schedule, decide_hop2, hop2_can_overlap

__all__ = ["Hop2", "Hop2Schedule", "decide_hop2", "hop2_can_overlap"]
