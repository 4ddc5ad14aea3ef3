"""Hop 2: the cross-replica sum at the accumulation boundary, in one place.

* :mod:`~lightning_mics.hop2.mode` -- *who* runs it and *when* (:class:`Hop2`, decided once per layout by
  :func:`decide_hop2`; pure Python, read by the planner too);
* :mod:`~lightning_mics.hop2.pipeline` -- what the engine runs: pack each unit's gradient shards, start their
  average behind backward (or after it), finish before clipping and the step, unpack, commit or drop;
* :mod:`~lightning_mics.hop2.transport` -- *over what*: the replication process group (fp32 or a compressed
  wire) or torchft's Manager across fault domains.

Only :mod:`~lightning_mics.hop2.mode` is imported here, so that the planner reads the rule without the
runtime; the engine imports the pipeline and transports from their modules.
"""

from lightning_mics.hop2.mode import Hop2, Hop2Schedule, decide_hop2, hop2_can_overlap

__all__ = ["Hop2", "Hop2Schedule", "decide_hop2", "hop2_can_overlap"]
