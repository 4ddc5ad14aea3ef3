"""One rank of the emulated-cluster benchmark: train the GPT with one strategy and measure it.

Started by ``emulated_cluster.py`` inside a node's network namespace as ``python -m benchmarks.emulated_worker
--job JOB`` (:func:`benchmarks.emulated_rows.run_strategy`), with Lightning's usual environment (``MASTER_ADDR``,
``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``) and ``GLOO_SOCKET_IFNAME=uplink``. Rank 0 writes one JSON record to
``--output``.

This file is the rank's entry point and its throughput run: :func:`run` (the Trainer rows) and
:func:`run_deepspeed` (DeepSpeed's own MiCS and ZeRO-3). What a rank trains with is
:mod:`benchmarks.emulated_strategies`'s; what it measures, and how rank 0 summarises it,
:mod:`benchmarks.emulated_probes`'s; a ``--convergence`` run is :mod:`benchmarks.convergence_worker`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from benchmarks.convergence_setup import ConvergenceSettings
from benchmarks.convergence_worker import run_convergence
from benchmarks.emulated_probes import StepProbe, counters, summarize
from benchmarks.emulated_strategies import measured_trainer, planner_choice
from benchmarks.scenarios import ClusterShape, StrategySpec, TrainingSetup
from examples.models import ByteCorpusDataModule, GPTConfig, GPTLightningModule
from lightning_mics.accounting import model_state_bytes
from lightning_mics.planner import live


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


IMPORT_RSS_BYTES = _rss_bytes()


# ---------------------------------------------------------------------------------- runs
def _mark(boundaries: list[dict[str, float]]) -> None:
    """:meth:`StepProbe._mark` without a Trainer: barrier, then time and counters."""
    dist.barrier()
    boundaries.append(counters())


def run_deepspeed(spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup, output: Optional[Path]) -> None:
    """The ``deepspeed-mics`` / ``deepspeed-zero3`` rows: DeepSpeed's own MiCS or ZeRO-3 driven directly (Lightning's
    ``DeepSpeedStrategy`` refuses CPU), measured as :class:`StepProbe` measures the Trainer rows:
    a barrier and the counters before the first micro-batch and after every optimizer step, the
    held gradient bytes after the first backward of each window. The gloo shim and the disabled
    shared-memory op (``benchmarks/deepspeed_peer.py``) exist only in this function's processes."""
    from benchmarks import deepspeed_peer

    reason = deepspeed_peer.unavailable_reason()
    if reason is not None:  # the orchestrator skips the row before launching; a direct call says why
        raise SystemExit(f"{spec.name}: {reason}")
    node, local = int(os.environ["NODE_RANK"]), int(os.environ["LOCAL_RANK"])
    rank = node * cluster.ranks_per_node + local
    # DeepSpeed's CPU accelerator reads the ranks per node from these (MiCS's group arithmetic)
    os.environ["NDEV_PER_NODE"] = os.environ["LOCAL_SIZE"] = str(cluster.ranks_per_node)
    deepspeed_peer.init_distributed(rank, cluster.world_size)
    built = deepspeed_peer.build(setup.model, spec.partition_size, setup.micro_batch, setup.accumulate,
                                 setup.total_steps, setup.corpus_bytes)
    boundaries: list[dict[str, float]] = []
    held: list[int] = []
    with deepspeed_peer.gloo_coalescing_shim():
        batches = iter(built.loader)
        _mark(boundaries)
        for _ in range(setup.total_steps):
            for micro in range(setup.accumulate):
                deepspeed_peer.micro_step(built.engine, next(batches))
                if micro == 0 and setup.accumulate > 1:
                    held.append(deepspeed_peer.held_gradient_bytes(built.engine))
                built.engine.step()  # DeepSpeed steps the optimizer at the window's last micro-step
            _mark(boundaries)
    record = {
        "rank": rank,
        "local_rank": local,
        "boundaries": boundaries,
        "held_grad_bytes": held,
        "peak_rss_bytes": _rss_bytes(),
        "import_rss_bytes": IMPORT_RSS_BYTES,
        "model_state_bytes": deepspeed_peer.model_state_bytes(built.engine),
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if rank == 0 and output is not None:
        output.write_text(json.dumps(summarize(gathered, spec, cluster, setup), indent=2))
    dist.barrier()


def run(spec: StrategySpec, cluster: ClusterShape, setup: TrainingSetup, output: Optional[Path]) -> None:
    if spec.family == "deepspeed":
        return run_deepspeed(spec, cluster, setup, output)
    pl.seed_everything(1234, workers=True, verbose=False)
    probe = StepProbe(setup.accumulate)
    trainer = measured_trainer(spec, cluster, setup, setup.total_steps, [probe], limit_val_batches=0)
    model = GPTLightningModule(setup.model, warmup_steps=0)
    data = ByteCorpusDataModule(seq_len=setup.model.seq_len, batch_size=setup.micro_batch, max_bytes=setup.corpus_bytes)
    trainer.fit(model, datamodule=data)
    states = model_state_bytes(model, trainer.optimizers)
    record = {
        "rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "boundaries": probe.boundaries,
        "held_grad_bytes": probe.held_grad_bytes,
        "peak_rss_bytes": _rss_bytes(),
        "import_rss_bytes": IMPORT_RSS_BYTES,
        "model_state_bytes": states["total"],
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    # what the planner measured at set-up (this process's cached measurement; asked on every rank, as
    # a measurement would be collective)
    measured = live.planner_cluster_for("calibrate", cluster.world_size, cluster.ranks_per_node, "cpu") \
        if spec.planned else None
    if trainer.global_rank == 0 and output is not None:
        summary = summarize(gathered, planner_choice(spec, trainer.strategy, cluster), cluster, setup)
        if measured is not None:  # what the planner measured and why it chose the layout (the layout log's words)
            summary["planner_cluster"] = live.describe_cluster(measured)
            summary["planner_cluster_spec"] = dataclasses.asdict(measured)
            summary["planner_reason"] = trainer.strategy.layout.settings.planner_reason
        output.write_text(json.dumps(summary, indent=2))
    dist.barrier()


# ---------------------------------------------------------------------------------- main
def main() -> None:
    # One intra-op thread per rank: 8 ranks share 2 cores, oversubscription would only add noise. Set here, before
    # any torch work, not at import: importing this module (the tests do) must not change the importer's threads.
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    parser = argparse.ArgumentParser(description="One rank of benchmarks/emulated_cluster.py (not run by hand).")
    parser.add_argument("--job", type=Path, required=True, help="JSON: strategy, cluster and training setup")
    parser.add_argument("--output", type=Path, help="where rank 0 writes the result record")
    args = parser.parse_args()
    job = json.loads(args.job.read_text())
    setup_fields = dict(job["setup"])
    setup_fields["model"] = GPTConfig(**setup_fields["model"])
    spec, cluster, setup = StrategySpec.from_dict(job["strategy"]), ClusterShape(**job["cluster"]), \
        TrainingSetup(**setup_fields)
    if job.get("convergence") is not None:
        row = job["convergence_run"]
        run_convergence(spec, cluster, setup, ConvergenceSettings(**job["convergence"]), int(row["seed"]),
                        int(row["steps"]), args.output)
    else:
        run(spec, cluster, setup, args.output)
    os._exit(0)  # skip interpreter teardown of gloo threads: the result is written, peers are done


if __name__ == "__main__":
    main()
