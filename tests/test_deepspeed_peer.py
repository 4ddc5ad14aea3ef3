"""DeepSpeed's own MiCS and plain ZeRO-3 (the benchmark's ``deepspeed-mics`` and ``deepspeed-zero3`` peer rows)
train the benchmark's GPT exactly as plain data-parallel training does; skipped without DeepSpeed (the ``[peers]``
extra), which CI does not install.

4 ranks as 2 "nodes" x 2, ``mics_shard_size=2`` (shard groups {0,1} and {2,3}, replicas {0,2} and {1,3}) or ZeRO-3
over all 4, 3 micro-batches per step, 3 plain-SGD steps; the gathered parameters must match a single-process loop
over all ranks' micro-batches to 1e-6 relative."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("deepspeed")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from distributed import run_ranks  # noqa: E402

from benchmarks import deepspeed_peer  # noqa: E402
from examples.models import GPTConfig  # noqa: E402
from examples.models.gpt import GPT  # noqa: E402

pytestmark = pytest.mark.distributed

if deepspeed_peer.unavailable_reason() is not None:
    pytest.skip(deepspeed_peer.unavailable_reason(), allow_module_level=True)

WORLD, SHARD, ACCUMULATE, STEPS, MICRO_BATCH, LR = 4, 2, 3, 3, 2, 0.5
#: d_model 192: the attention and MLP matrices (> 1e5 elements) are partitioned and all-gathered
#: by MiCS; the rest stays under DeepSpeed's default persistence threshold (gathered once per step).
CONFIG = GPTConfig(seq_len=8, d_model=192, n_layers=2, n_heads=2)
CORPUS_BYTES = 20_000


def _train(rank: int, world: int, shard: int) -> dict:
    os.environ["NDEV_PER_NODE"] = os.environ["LOCAL_SIZE"] = str(2)  # 2 "nodes" x 2 ranks
    deepspeed_peer.init_distributed(rank, world)
    run = deepspeed_peer.build(CONFIG, shard, MICRO_BATCH, ACCUMULATE, None, CORPUS_BYTES, optimizer="sgd", sgd_lr=LR)
    batches = []
    with deepspeed_peer.gloo_coalescing_shim():
        loader = iter(run.loader)
        for _ in range(STEPS * ACCUMULATE):
            batch = next(loader)
            batches.append(batch)
            deepspeed_peer.micro_step(run.engine, batch)
            run.engine.step()
        params = deepspeed_peer.full_parameters(run.module)
    return {"params": params, "batches": batches, "shard_numel": {
        name: p.ds_tensor.numel() for name, p in run.module.named_parameters()}}


def _reference(batches_per_rank: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Plain data-parallel SGD in one process: the mean loss over every rank's micro-batches."""
    torch.manual_seed(deepspeed_peer.SEED)
    model = GPT(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank_batches in batches_per_rank:
            for tokens, targets in rank_batches[step * ACCUMULATE : (step + 1) * ACCUMULATE]:
                logits = model(tokens)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
                (loss / (ACCUMULATE * len(batches_per_rank))).backward()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("shard", [SHARD, WORLD], ids=["mics", "zero3"])
def test_deepspeed_matches_plain_data_parallel_sgd(shard: int) -> None:
    ranks = run_ranks(_train, WORLD, shard)
    # the layout is the row's: the large matrices are split in two (MiCS's shard group) or four (ZeRO-3)
    numels = {name: p.numel() for name, p in ranks[0]["params"].items()}
    partitioned = [n for n in ranks[0]["shard_numel"] if numels[n] > 100_000]
    assert partitioned
    for name in partitioned:
        assert ranks[0]["shard_numel"][name] == -(-numels[name] // shard)
    # different ranks saw different data
    assert not torch.equal(ranks[0]["batches"][0][0], ranks[2]["batches"][0][0])
    expected = _reference([r["batches"] for r in ranks])
    torch.manual_seed(deepspeed_peer.SEED)
    initial = {name: p.detach() for name, p in GPT(CONFIG).named_parameters()}
    for rank in ranks:
        for name, value in expected.items():
            got = rank["params"][name]
            assert got.dtype == torch.float32, name  # fp32 training, as every other row
            scale = value.abs().max().clamp_min(1e-12)
            assert (got - value).abs().max() / scale < 1e-6, name
    moved = max(((expected[n] - initial[n]).abs().max() / expected[n].abs().max()).item() for n in expected)
    assert moved > 1e-3  # the training moved the parameters far more than the tolerance
