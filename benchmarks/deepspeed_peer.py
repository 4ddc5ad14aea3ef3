"""DeepSpeed's own MiCS (ZeRO-3 with ``mics_shard_size``) and its plain ZeRO-3 as peer rows of the
emulated benchmark.

``deepspeed-mics`` shards in one node (``mics_shard_size`` = ranks per node). ``deepspeed-zero3`` is
plain ZeRO-3 (``deepspeed.zero.Init``, no MiCS keys, shard over all ranks): the baseline of the MiCS
paper's comparisons, which lets "MiCS / ZeRO-3" be read against DeepSpeed's ZeRO-3 as well as against
our own FSDP2 ``zero3`` row.

Lightning's ``DeepSpeedStrategy`` refuses CPU, so DeepSpeed is driven directly: the GPT is built
under ``deepspeed.zero.MiCS_Init`` (parameters are partitioned in the shard group as they are
created), wrapped by ``deepspeed.initialize`` with the same AdamW settings and learning-rate
schedule as ``GPTLightningModule``, and trained on the same corpus windows (a ``DistributedSampler``
seeded as Lightning seeds it) with DeepSpeed's own gradient accumulation.

Only the pinned DeepSpeed works (``pip install -e ".[peers]"``, ``DS_BUILD_OPS=0``):

* 0.19.7 removed MiCS (its config raises, pointing at deepspeedai/DeepSpeed#8489);
* 0.19.3--0.19.6 take the partition rank from the world group instead of the MiCS shard group,
  so ranks of the second partition skip the replica all-reduce and hang;
* 0.19.2 works once the two CPU/gloo gaps below are bridged.

Two things are changed, both inside the DeepSpeed row's own rank processes and only on DeepSpeed
objects (torch is not patched):

* **gloo shim** (:func:`gloo_coalescing_shim`): gloo has no coalescing manager, so DeepSpeed's
  ``all_gather_coalesced`` (MiCS's parameter all-gather) fails with "Backend gloo does not
  implement startCoalescing". The shim replaces that one method of DeepSpeed's communication
  backend object with one async ``all_gather_into_tensor`` per tensor (the same bytes on the
  wire; only the batching into one coalesced call is lost) and restores it on exit;
* **no shared-memory op**: DeepSpeed's ``TorchBackend`` JIT-builds a CPU shared-memory all-reduce
  op (``deepspeed_shm_comm``, ~5 min here) whenever the op counts as compatible; no environment
  variable turns it off, so it is marked incompatible in ``deepspeed.ops.__compatible_ops__``
  before DeepSpeed's backend is created. Beyond the build time, network namespaces share
  ``/dev/shm``, so a shared-memory all-reduce would bypass the emulated network altogether.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from examples.models import ByteCorpusDataModule, GPTConfig
from examples.models.gpt import GPT, GPTLightningModule, warmup_cosine

#: The DeepSpeed release this row needs (module docstring: why exactly this one).
PINNED_VERSION = "0.19.2"
#: The seed ``emulated_worker`` gives ``seed_everything``; Lightning seeds its DistributedSampler with it.
SEED = 1234


def unavailable_reason() -> Optional[str]:
    """Why the DeepSpeed row cannot run here, or ``None`` when it can. Reads package metadata only:
    importing DeepSpeed is slow and needs ``DS_ACCELERATOR`` set first."""
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return (f"DeepSpeed is not installed; `DS_BUILD_OPS=0 pip install -e '.[peers]'` "
                f"(deepspeed=={PINNED_VERSION}) to run this row")
    if version != PINNED_VERSION:
        return (f"DeepSpeed {version} is installed but this row needs {PINNED_VERSION} (MiCS was removed in "
                f"0.19.7; 0.19.3-0.19.6 hang in the replica all-reduce)")
    return None


def _import_deepspeed() -> Any:
    """Import DeepSpeed on its CPU accelerator (gloo), with the shared-memory op switched off."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see the module docstring
    return deepspeed


def uses_mics(shard_size: int, world_size: int) -> bool:
    """A shard group smaller than the world is DeepSpeed's MiCS; one spanning it is plain ZeRO-3."""
    return shard_size < world_size


def ds_config(shard_size: int, micro_batch: int, accumulate: int, world_size: int) -> dict[str, Any]:
    """ZeRO-3 (+ MiCS when ``shard_size < world_size``), fp32, DeepSpeed's defaults otherwise (what a
    user switching to it would get).

    ``mics_hierarchical_params_gather`` stays off: one partition is one node here, so the
    hierarchical all-gather has nothing to do (as ``hierarchical=False`` in our ``mics`` row)."""
    zero: dict[str, Any] = {"stage": 3}
    if uses_mics(shard_size, world_size):
        zero.update(mics_shard_size=shard_size, mics_hierarchical_params_gather=False)
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulate,
        "train_batch_size": micro_batch * accumulate * world_size,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


class _AllGathers:
    """A handle over several async all-gathers: ``wait`` waits for all of them."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _all_gather_each(
    output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], group: Any = None, async_op: bool = False
) -> Optional[_AllGathers]:
    """``all_gather_coalesced`` without a coalescing manager: one async all-gather per tensor."""
    works = [dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
             for out, inp in zip(output_tensors, input_tensors)]
    handle = _AllGathers(works)
    if async_op:
        return handle
    handle.wait()
    return None


@contextlib.contextmanager
def gloo_coalescing_shim() -> Iterator[None]:
    """While active, DeepSpeed's communication backend all-gathers tensor by tensor (module docstring).

    Set on the backend *instance* DeepSpeed created in this process and removed on exit: torch and
    every other strategy are untouched."""
    from deepspeed.comm import comm as ds_comm

    backend = ds_comm.cdb
    if backend is None:
        raise RuntimeError("deepspeed.init_distributed() must run before the gloo shim is installed")
    backend.all_gather_coalesced = _all_gather_each  # instance attribute shadows the method
    try:
        yield
    finally:
        del backend.all_gather_coalesced


def init_distributed(rank: int, world_size: int) -> Any:
    """torch.distributed (gloo, ``env://``) first, then DeepSpeed's backend on top of it."""
    deepspeed = _import_deepspeed()
    os.environ["RANK"] = str(rank)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)
    return deepspeed


def _decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """``GPTLightningModule``'s AdamW groups: decay on matrices only. Under ZeRO-3 a parameter's
    tensor is a partition, so its rank comes from ``ds_shape``."""
    params = [p for p in module.parameters() if p.requires_grad]
    is_matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
    return [
        {"params": [p for p, m in zip(params, is_matrix) if m], "weight_decay": weight_decay},
        {"params": [p for p, m in zip(params, is_matrix) if not m], "weight_decay": 0.0},
    ]


def _lightning_module_defaults() -> dict[str, Any]:
    """The benchmark's ``GPTLightningModule(config, warmup_steps=0)`` hyper-parameters."""
    defaults = {name: p.default for name, p in inspect.signature(GPTLightningModule.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {**defaults, "warmup_steps": 0}


@dataclass
class DeepSpeedRun:
    """A built DeepSpeed engine and what it trains on."""

    engine: Any
    module: nn.Module
    loader: DataLoader


def build(
    model_config: GPTConfig,
    shard_size: int,
    micro_batch: int,
    accumulate: int,
    total_steps: Optional[int],
    corpus_bytes: int,
    optimizer: str = "adamw",
    sgd_lr: float = 0.1,
) -> DeepSpeedRun:
    """Build the MiCS engine for the GPT (``init_distributed`` must have run); with ``shard_size``
    equal to the world size, plain ZeRO-3 (``deepspeed.zero.Init``).

    ``optimizer="adamw"`` is the benchmark's setting (``GPTLightningModule``'s defaults and cosine
    schedule over ``total_steps``); ``"sgd"`` (plain, constant ``sgd_lr``) is for the equivalence test,
    where Adam's normalisation would hide gradient errors."""
    import deepspeed

    world = dist.get_world_size()
    config = ds_config(shard_size, micro_batch, accumulate, world)
    torch.manual_seed(SEED)
    # No dtype argument: with one, 0.19.2's ``Init._set_dtype`` reads ``dtype or fp16 if fp16 supported
    # else bf16 ...`` (operator precedence) and picks bf16 on CPU; from the config it picks fp32.
    partitioned_init = deepspeed.zero.MiCS_Init if uses_mics(shard_size, world) else deepspeed.zero.Init
    with partitioned_init(config_dict_or_path=config):
        module = GPT(model_config)
    hp = _lightning_module_defaults()
    scheduler_fn = None
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(
            _decay_groups(module, hp["weight_decay"]), lr=hp["learning_rate"], betas=tuple(hp["betas"])
        )
        scheduler_fn = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: warmup_cosine(step, hp["warmup_steps"], total_steps, hp["min_lr_ratio"])
        )
    elif optimizer == "sgd":
        opt = torch.optim.SGD(module.parameters(), lr=sgd_lr)
    else:
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}.")
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, lr_scheduler=scheduler_fn, config=config)
    data = ByteCorpusDataModule(seq_len=model_config.seq_len, batch_size=micro_batch, max_bytes=corpus_bytes)
    dataset = data.train_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=dist.get_rank(), shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)
    return DeepSpeedRun(engine, module, loader)


def micro_step(engine: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Forward and backward of one micro-batch, with ``GPTLightningModule``'s loss; DeepSpeed scales
    it by 1 / accumulation, as Lightning does."""
    tokens, targets = batch
    logits = engine(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    engine.backward(loss)
    return loss


def held_gradient_bytes(engine: Any) -> int:
    """Gradient storage this rank holds between micro-steps: ZeRO-3's flat buffer of gradient
    partitions, plus any ``.grad`` still attached to the module (none, normally)."""
    storages: dict[int, int] = {}
    flat = getattr(engine.optimizer, "grad_partitions_flat_buffer", None)
    if isinstance(flat, torch.Tensor):
        storages[flat.untyped_storage().data_ptr()] = flat.untyped_storage().nbytes()
    for param in engine.module.parameters():
        if param.grad is not None and param.grad.numel():
            storages[param.grad.untyped_storage().data_ptr()] = param.grad.untyped_storage().nbytes()
    return sum(storages.values())


def model_state_bytes(engine: Any) -> int:
    """Bytes of model states this rank holds: parameter partitions, the optimizer's fp32 partitions
    and states, the gradient partitions (best effort over ZeRO-3's attributes)."""
    total = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.module.parameters()
                if hasattr(p, "ds_tensor"))
    optimizer = engine.optimizer
    for flat in getattr(optimizer, "fp32_partitioned_groups_flat", []) or []:
        total += flat.numel() * flat.element_size()
    inner = getattr(optimizer, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    return total + held_gradient_bytes(engine)


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered in full (a collective: all ranks call it)."""
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().clone() for name, p in params.items()}
