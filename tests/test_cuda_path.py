"""The CUDA path of ``MiCSStrategy``: four ranks sharing one GPU train the toy model exactly like one process
(tightly in ``32-true``, within bf16 precision in ``bf16-mixed``); skipped without a GPU.

What runs on CUDA and nowhere else: the strategy's device placement (``root_device`` a GPU, the
process group bound to it), autocast on ``cuda``, FSDP2's CUDA streams and events around its
all-gathers and reduce-scatters, and the GPU-path options (activation checkpointing, explicit
prefetch, compiled blocks). So four ranks share the one GPU a test machine has. NCCL refuses two
ranks on one device, hence gloo, which stages CUDA tensors through host memory: slow, but the
FSDP2 code path is the real one. A 2 x 2 layout (partition 2, two replicas) exercises both hops of
MiCS's gradient sync.

Lightning only knows one rank per device, and ``Trainer(accelerator="cuda", devices=4)`` is
refused on a one-GPU machine. The strategy is therefore given its devices directly --
``MiCSStrategy(parallel_devices=[cuda:0] * 4)``, which the accelerator connector takes over as is --
and ``devices=1`` only has to parse (Lightning parses it even when the strategy brings devices).

Every parameter is compared with the fp32 single-process reference of ``tests/toy.py``: tightly for
``32-true``, within bf16 precision for ``bf16-mixed``. Skipped without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from distributed import run_ranks
from torch.distributed.tensor import DTensor
from toy import RunConfig, ToyModule, assert_matches_reference, full_parameters, trainer_kwargs

from lightning_mics import MiCSStrategy

pytestmark = [
    pytest.mark.distributed,  # every test here spawns rank processes
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WORLD = 4
CLIP = 0.5  # the reference gradient norms are ~3-5, so this clips every step (see test_equivalence)
#: fp32 on GPU vs CPU: same maths, different summation orders in the kernels and in gloo's sums;
#: the CPU-only equivalence tests reach 1e-5, and bf16 is three orders of magnitude looser.
FP32_RTOL = 1e-4
#: bf16 compute, fp32 reduction and master weights: test_equivalence's bound for bf16-mixed on CPU.
BF16_RTOL = 3e-2


@dataclass(frozen=True)
class Variant:
    """One training run of the CUDA test: precision, layout and the strategy options it needs."""

    precision: str
    partition_size: int
    rtol: float
    accumulate: int = 1
    clip: Optional[float] = None
    #: ``MiCSStrategy`` options beyond the layout.
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def cfg(self) -> RunConfig:
        return RunConfig(world_size=WORLD, accumulate=self.accumulate, clip=self.clip)


VARIANTS: dict[str, Variant] = {
    "fp32": Variant("32-true", partition_size=2, rtol=FP32_RTOL),
    "bf16 accumulate+clip": Variant("bf16-mixed", partition_size=2, rtol=BF16_RTOL, accumulate=3, clip=CLIP),
    "bf16 zero3 checkpointing prefetch2": Variant(
        "bf16-mixed",
        partition_size=WORLD,
        rtol=BF16_RTOL,
        options=(("activation_checkpointing_policy", True), ("prefetch_depth", 2)),
    ),
    "bf16 compiled blocks": Variant(
        "bf16-mixed", partition_size=2, rtol=BF16_RTOL, options=(("compile_blocks", True), ("prefetch_depth", 1))
    ),
}


def fit_on_device(variant: Variant, device: torch.device) -> ToyModule:
    """Train ``ToyModule`` with this rank's strategy on ``device``, shared by all ranks."""
    cfg = variant.cfg
    strategy = MiCSStrategy(
        parallel_devices=[device] * cfg.world_size,
        process_group_backend="gloo",
        partition_size=variant.partition_size,
        **dict(variant.options),
    )
    kwargs = {**trainer_kwargs(cfg), "accelerator": device.type, "devices": 1, "precision": variant.precision}
    module = ToyModule(cfg)
    pl.Trainer(strategy=strategy, **kwargs).fit(module)
    return module


def _train_variants(rank: int, world: int, device_type: str, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """One rank: every runnable variant in turn (one spawn of ranks for all: start-up dominates)."""
    assert world == WORLD
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # every rank on GPU 0, before anything defaults to cuda:LOCAL_RANK
    results = {}
    for name in names:
        module = fit_on_device(VARIANTS[name], device)
        local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
        results[name] = {
            "params": full_parameters(module),
            "local_devices": {t.device.type for t in local},
            "master_dtypes": {t.dtype for t in local},
        }
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_train_variants, WORLD, "cuda", tuple(VARIANTS))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_ranks_on_one_gpu_match_single_process(per_rank, name):
    variant = VARIANTS[name]
    runs = [rank[name] for rank in per_rank]
    for run in runs:
        assert run["local_devices"] == {"cuda"}  # the shards live on the GPU, not left behind on CPU
        assert run["master_dtypes"] == {torch.float32}  # bf16-mixed keeps fp32 master weights
    assert_matches_reference([run["params"] for run in runs], variant.cfg, rtol=variant.rtol)
