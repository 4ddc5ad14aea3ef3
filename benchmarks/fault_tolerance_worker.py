"""One rank of ``benchmarks/fault_tolerance.py``: train the GPT with plain MiCS or with fault tolerance and
log every optimizer step.

Started by the orchestrator inside its node's network namespace (with a UTS namespace whose hostname is the
node's address, so that what torchft advertises -- ``socket.gethostname()`` -- reaches this node from the
others), with Lightning's usual environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``NODE_RANK``,
``LOCAL_RANK``) and ``GLOO_SOCKET_IFNAME=uplink``. The job JSON says which run this is:

* ``mode="plain"``: one world of every node's ranks, ``MiCSStrategy(partition_size=ranks_per_node)``;
* ``mode="ft"``: this node's ranks are one replica group (its own world), ``MiCSStrategy(fault_tolerance=...)``.

Each rank appends one JSON line per training batch to ``<log_dir>/node<n>.rank<r>.jsonl``: wall time, the
committed step (torchft's step; plain: the global step), Lightning's global step, the live groups, the
steps discarded so far, whether this group's shards are current (``current``: false while a catch-up heal
downloads them) and its gradients count (``contributes``), the loss and -- when asked -- a SHA-256 of this
rank's shards of the model and the optimizer states (what "bit-identical after the heal" is checked on). A
line is written and closed at once, so that a SIGKILL loses nothing already logged.

With ``record_samples`` (fault tolerance, whose training data keeps its trajectory) each rank also appends one
line per training micro-step to ``<log_dir>/samples.node<n>.rank<r>.jsonl``: the micro-batch trained on
(``step``: its data step, torchft's committed-step count at the quorum; ``micro``; ``shares``), this rank's
sample indices in it (``engine.data_cursor.order.samples(key, rank)``), the loss on them, this group's place in
the step's contributing groups (``participant``: ``None`` outside them -- outside the quorum, or catching up
after a catch-up heal, when its gradient is not summed; ``participants``) and whether the step then committed
(in a line of its own after the step: ``{"commit": true|false}``, torchft's step count grew past ``step``). The
record is written before the backward, the commit line after the optimizer step: a rank SIGKILLed between its
group's commit and its own log line still has its samples recorded, and the analysis takes the commit of such
an attempt from the other groups of its quorum (a step commits in all of them or in none).
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: One intra-op thread per rank: 6 ranks share the host's cores, oversubscription would only add noise.
torch.set_num_threads(1)
torch.set_num_interop_threads(1)

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from examples.models import ByteCorpusDataModule, GPTConfig, GPTLightningModule
from lightning_mics import FaultTolerance, MiCSStrategy


@dataclass(frozen=True)
class Job:
    """What one run trains and how; the same for every rank of the run (written by the orchestrator)."""

    mode: str  #: "plain" or "ft"
    steps: int  #: max_steps
    nodes: int  #: nodes of this rank's world (plain: all; ft: 1, the replica group)
    ranks_per_node: int
    num_groups: int  #: replica groups when all are alive (ft), or the nodes (plain)
    model: dict[str, Any]  #: GPTConfig fields
    batch_size: int
    corpus_bytes: int
    log_dir: str
    lighthouse: str | None = None  #: ft: the Lighthouse's address
    checkpoint_dir: str | None = None  #: ModelCheckpoint(save_last=True) every checkpoint_every steps
    checkpoint_every: int = 0
    digests: bool = False  #: log a hash of this rank's model and optimizer shards every step
    save_params: bool = False  #: save this rank's parameter shards at the end (the no-failure comparison)
    start_barrier: str | None = None  #: a directory: wait for every rank of every group before the first step
    timeout: float = 10.0  #: ft: seconds a cross-group collective / commit / heal may take
    record_samples: bool = False  #: ft: log every micro-step's sample indices, loss and commit (module docstring)
    accumulate: int = 1  #: Trainer(accumulate_grad_batches=...)
    async_save: bool = False  #: MiCSStrategy(async_save=...): checkpoints written in the background
    #: ft: FaultTolerance's options besides the Lighthouse, the group indices and the timeouts; empty: its defaults,
    #: as a user constructs it (the benchmark's headline runs)
    ft_options: dict[str, Any] = field(default_factory=dict)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _loss(outputs: Any) -> float:
    return float(outputs["loss"] if isinstance(outputs, dict) else outputs)


def shard_digest(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> str:
    """SHA-256 of this rank's shards of every parameter and optimizer state, in a fixed order: equal digests on
    the same rank index of two groups mean bit-identical model and optimizer states."""
    digest = hashlib.sha256()
    for name, param in sorted(module.named_parameters()):
        digest.update(name.encode())
        digest.update(_local(param).detach().contiguous().numpy().tobytes())
    for optimizer in optimizers:
        for index, state in sorted(optimizer.state_dict()["state"].items()):
            for key, value in sorted(state.items()):
                digest.update(f"{index}.{key}".encode())
                if isinstance(value, torch.Tensor):
                    digest.update(_local(value).detach().contiguous().numpy().tobytes())
                else:
                    digest.update(repr(value).encode())
    return digest.hexdigest()


class LossKeepingGPT(GPTLightningModule):
    """The example GPT, keeping its last training loss: the loop's own pass is the last one before its backward
    (``exact_trajectory`` runs a lost group's shares first), where the sample record is written."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        output = super().training_step(batch, batch_idx)
        self.last_training_loss = output["loss"] if isinstance(output, dict) else output
        return output


class StepLog(pl.Callback):
    """One JSON line per training batch (see the module docstring); the optional start barrier."""

    def __init__(self, job: Job, node: int, local_rank: int) -> None:
        self.job = job
        self.node = node
        self.local_rank = local_rank
        self.path = Path(job.log_dir) / f"node{node}.rank{local_rank}.jsonl"
        self.samples_path = Path(job.log_dir) / f"samples.node{node}.rank{local_rank}.jsonl"

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Notes when this process is set up and about to ask for its first quorum, in
        ``events.node<n>.rank<r>.jsonl`` (a restarted group's heal starts here). With a start barrier: every
        group's Manager exists (and heartbeats) before any group asks for its first quorum, so the first quorum
        holds every group -- not whichever started first."""
        with (Path(self.job.log_dir) / f"events.node{self.node}.rank{self.local_rank}.jsonl").open("a") as handle:
            handle.write(json.dumps({"t": time.time(), "event": "train_start", "pid": os.getpid()}) + "\n")
        if self.job.start_barrier is None:
            return
        barrier = Path(self.job.start_barrier)
        (barrier / f"node{self.node}.rank{self.local_rank}").touch()
        expected = self.job.num_groups * self.job.ranks_per_node
        deadline = time.monotonic() + 600
        while len(list(barrier.iterdir())) < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"start barrier: {len(list(barrier.iterdir()))} of {expected} ranks after 600 s")
            time.sleep(0.02)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        line: dict[str, Any] = {"t": time.time(), "node": self.node, "rank": self.local_rank,
                                "global_step": trainer.global_step, "loss": _loss(outputs),
                                "cpu": time.process_time()}  # every thread of this rank's process
        replica_group = getattr(trainer.strategy.engine, "replica_group", None)
        if replica_group is not None:
            manager = replica_group.manager
            line |= {"step": manager.current_step(), "live": manager.num_participants(),
                     "discarded": replica_group.discarded_steps, "current": replica_group.catch_up is None,
                     "contributes": replica_group.contributes}
        else:
            line |= {"step": trainer.global_step, "live": self.job.num_groups, "discarded": 0}
        if self.job.digests:
            line["digest"] = shard_digest(pl_module, [o for o in trainer.optimizers])
        if self.job.record_samples:
            self.record_commit(trainer)
        with self.path.open("a") as handle:
            handle.write(json.dumps(line) + "\n")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.job.record_samples:
            self.record_samples(trainer, pl_module)

    def record_samples(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """This micro-step's line of ``samples.node<n>.rank<r>.jsonl`` (module docstring): what the rank trains
        on, read from the strategy's data cursor (the loader's ``batch`` may be a prediction the quorum
        overruled), before its backward."""
        engine = trainer.strategy.engine
        cursor, replica_group = engine.data_cursor, engine.replica_group
        if cursor is None or cursor.current is None or replica_group is None:
            return
        key = cursor.current
        _, participant, participants = replica_group.participation()  # a catching-up group's gradient is not summed
        record = {"t": time.time(), "node": self.node, "rank": self.local_rank, "pid": os.getpid(),
                  "step": key.step, "micro": key.micro, "shares": list(key.shares),
                  "samples": cursor.order.samples(key, cursor.rank), "loss": float(pl_module.last_training_loss),
                  "participant": participant, "participants": participants, "committed": None,
                  "reloaded": cursor.reloaded}
        if cursor.separate_shares:  # exact_trajectory: one pass, and one loss, per share (the loop's is the first)
            losses = [record["loss"]] + [float(cursor.other_share_losses[share]) for share in key.shares[1:]]
            record["share_losses"] = losses
            record["loss"] = sum(losses) / len(losses)
        with self.samples_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def record_commit(self, trainer: pl.Trainer) -> None:
        """After a step's last micro-step: whether it committed, in a line of its own."""
        cursor, replica_group = trainer.strategy.engine.data_cursor, trainer.strategy.engine.replica_group
        if cursor is None or cursor.current is None or replica_group is None:
            return
        key = cursor.current
        if key.micro != cursor.order.accumulate - 1:
            return
        line = {"node": self.node, "rank": self.local_rank, "pid": os.getpid(), "step": key.step,
                "commit": replica_group.manager.current_step() > key.step}
        with self.samples_path.open("a") as handle:
            handle.write(json.dumps(line) + "\n")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.job.save_params:
            shards = {name: _local(p).detach().clone() for name, p in pl_module.named_parameters()}
            torch.save(shards, self.path.with_suffix(".params.pt"))


#: FaultTolerance(quorum_timeout=...) of every fault-tolerant run
QUORUM_TIMEOUT_S = 60.0


def build_strategy(job: Job, node: int) -> MiCSStrategy:
    """Plain MiCS over every node (partition = one node), or one replica group of the fault-tolerant job."""
    if job.mode == "plain":
        return MiCSStrategy(partition_size=job.ranks_per_node, ranks_per_node=job.ranks_per_node,
                            process_group_backend="gloo", async_save=job.async_save)
    ft = FaultTolerance(lighthouse=job.lighthouse, replica_group=node, num_replica_groups=job.num_groups,
                        timeout=job.timeout, quorum_timeout=QUORUM_TIMEOUT_S, **job.ft_options)
    return MiCSStrategy(fault_tolerance=ft, process_group_backend="gloo", async_save=job.async_save)


def run(job: Job, node: int, local_rank: int) -> None:
    """Train ``job.steps`` optimizer steps (from the last checkpoint when there is one)."""
    pl.seed_everything(1234, workers=True, verbose=False)
    callbacks: list[pl.Callback] = [StepLog(job, node, local_rank)]
    if job.checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=job.checkpoint_dir, save_last=True, save_top_k=0,
                                         every_n_train_steps=job.checkpoint_every))
    trainer = pl.Trainer(
        accelerator="cpu", devices=job.ranks_per_node, num_nodes=job.nodes, strategy=build_strategy(job, node),
        max_steps=job.steps, accumulate_grad_batches=job.accumulate, callbacks=callbacks, logger=False,
        enable_checkpointing=job.checkpoint_dir is not None,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    config = GPTConfig(**job.model)
    model = LossKeepingGPT(config, warmup_steps=2)
    data = ByteCorpusDataModule(seq_len=config.seq_len, batch_size=job.batch_size, max_bytes=job.corpus_bytes)
    resume = "last" if job.checkpoint_dir is not None else None
    trainer.fit(model, datamodule=data, ckpt_path=resume)


def main() -> None:
    parser = argparse.ArgumentParser(description="One rank of benchmarks/fault_tolerance.py (not run by hand).")
    parser.add_argument("--job", type=Path, required=True, help="JSON: the run's Job")
    parser.add_argument("--node", type=int, required=True, help="this rank's node (= replica group with ft)")
    args = parser.parse_args()
    # a rank that dies by a signal (a heap corruption's SIGABRT, a segfault) leaves every thread's Python stack in
    # its log: the orchestrator only sees the exit code
    faulthandler.enable(all_threads=True)
    job = Job(**json.loads(args.job.read_text()))
    run(job, args.node, int(os.environ["LOCAL_RANK"]))
    os._exit(0)  # skip interpreter teardown of gloo and torchft threads: the logs are written


if __name__ == "__main__":
    main()
