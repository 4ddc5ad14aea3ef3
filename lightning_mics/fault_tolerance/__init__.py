"""Partition groups as fault domains: a lost node costs a step, not the job (torchft).

Every MiCS partition group holds a complete copy of the model states, and only hop 2 -- the
cross-replica all-reduce at the accumulation boundary -- joins the groups. With
``MiCSStrategy(fault_tolerance=FaultTolerance(...))`` each replica group is launched as its own job whose
``torch.distributed`` world is one partition, and hop 2 runs through a torchft ``Manager``:

* every optimizer step starts with a quorum (the Lighthouse says which groups are alive); a group that
  joins -- restarted or new -- first takes the live state (model, optimizer, schedulers, step count) from a
  peer over torchft's checkpoint transport;
* at the boundary the gradient shards are averaged over the groups that took part in the step
  (:class:`lightning_mics.hop2.transport.ManagedTransport`, behind backward like every other hop 2), and the
  optimizer steps only if the quorum commits; a step a failure interrupted is discarded (its gradients
  dropped, nothing updated) and the next one runs with the groups still alive.

One module per idea:

* :mod:`~.config` -- :class:`FaultTolerance` (options and environment) and the layouts that cannot lose a
  group (:func:`check_fault_tolerant_layout`);
* :mod:`~.group` -- :class:`ReplicaGroup`, the group's Manager: quorum, heal, commit, and its watchdog;
* :mod:`~.agreement` -- what every group must share and the per-quorum check that it does;
* :mod:`~.heal_state` -- what a joining group takes from a live one and how it loads it;
* :mod:`~.counters` -- the Trainer's step counters kept to committed steps;
* :mod:`~.errors` -- how a group ends when it cannot go on.

``torchft`` itself is imported only when a :class:`ReplicaGroup` is created, and the names below load their module
on first access (PEP 562): :mod:`~.config` (what :mod:`lightning_mics.options` declares ``fault_tolerance`` with)
is read without the runtime that runs a group.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it (imported on first access)
_PUBLIC: dict[str, str] = {
    "AGREEMENT_BYTES": "lightning_mics.fault_tolerance.config",
    "CommittedStepCounters": "lightning_mics.fault_tolerance.counters",
    "DIGEST_CHUNKS": "lightning_mics.fault_tolerance.config",
    "DataEpochs": "lightning_mics.fault_tolerance.counters",
    "FaultTolerance": "lightning_mics.fault_tolerance.config",
    "GroupConfiguration": "lightning_mics.fault_tolerance.agreement",
    "LIGHTHOUSE_ENV": "lightning_mics.fault_tolerance.config",
    "LighthouseUnavailable": "lightning_mics.fault_tolerance.errors",
    "MAX_REPLICA_GROUPS": "lightning_mics.fault_tolerance.config",
    "NUM_REPLICA_GROUPS_ENV": "lightning_mics.fault_tolerance.config",
    "REPLICA_GROUP_ENV": "lightning_mics.fault_tolerance.config",
    "ReplicaGroup": "lightning_mics.fault_tolerance.group",
    "ReplicaGroupRefused": "lightning_mics.fault_tolerance.errors",
    "Watchdog": "lightning_mics.fault_tolerance.group",
    "agreement_message": "lightning_mics.fault_tolerance.agreement",
    "agreement_verdict": "lightning_mics.fault_tolerance.agreement",
    "check_catch_up_heal": "lightning_mics.fault_tolerance.config",
    "check_exact_trajectory": "lightning_mics.fault_tolerance.config",
    "check_fault_tolerant_layout": "lightning_mics.fault_tolerance.config",
    "check_healed_whole": "lightning_mics.fault_tolerance.agreement",
    "load_training_state": "lightning_mics.fault_tolerance.heal_state",
    "local_state": "lightning_mics.fault_tolerance.heal_state",
    "model_signature": "lightning_mics.fault_tolerance.agreement",
    "run_configuration": "lightning_mics.fault_tolerance.agreement",
    "state_hooks": "lightning_mics.fault_tolerance.heal_state",
    "trainer_state_hooks": "lightning_mics.fault_tolerance.counters",
    "training_state": "lightning_mics.fault_tolerance.heal_state",
}

if TYPE_CHECKING:
    from lightning_mics.fault_tolerance.agreement import (
        GroupConfiguration,
        agreement_message,
        agreement_verdict,
        check_healed_whole,
        model_signature,
        run_configuration,
    )
    from lightning_mics.fault_tolerance.config import (
        AGREEMENT_BYTES,
        DIGEST_CHUNKS,
        FaultTolerance,
        LIGHTHOUSE_ENV,
        MAX_REPLICA_GROUPS,
        NUM_REPLICA_GROUPS_ENV,
        REPLICA_GROUP_ENV,
        check_catch_up_heal,
        check_exact_trajectory,
        check_fault_tolerant_layout,
    )
    from lightning_mics.fault_tolerance.counters import CommittedStepCounters, DataEpochs, trainer_state_hooks
    from lightning_mics.fault_tolerance.errors import LighthouseUnavailable, ReplicaGroupRefused
    from lightning_mics.fault_tolerance.group import ReplicaGroup, Watchdog
    from lightning_mics.fault_tolerance.heal_state import load_training_state, local_state, state_hooks, training_state


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:  # an AttributeError lets ``from lightning_mics.fault_tolerance import <submodule>`` import it
        raise AttributeError(f"module 'lightning_mics.fault_tolerance' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = [
    "AGREEMENT_BYTES",
    "DIGEST_CHUNKS",
    "LIGHTHOUSE_ENV",
    "MAX_REPLICA_GROUPS",
    "NUM_REPLICA_GROUPS_ENV",
    "REPLICA_GROUP_ENV",
    "CommittedStepCounters",
    "DataEpochs",
    "FaultTolerance",
    "GroupConfiguration",
    "LighthouseUnavailable",
    "ReplicaGroup",
    "ReplicaGroupRefused",
    "Watchdog",
    "agreement_message",
    "agreement_verdict",
    "check_catch_up_heal",
    "check_exact_trajectory",
    "check_fault_tolerant_layout",
    "check_healed_whole",
    "load_training_state",
    "local_state",
    "model_signature",
    "run_configuration",
    "state_hooks",
    "trainer_state_hooks",
    "training_state",
]
