"""What the ranks of :func:`conftest.four_rank_collective_runs` run: the compressed hop's checks, then (in a
fresh world, as Lightning sets up its own) the hierarchical AVG checks."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def run_both(rank: int, world: int) -> dict[str, Any]:
    import test_compressed_hop
    import test_hierarchical_avg

    hop = test_compressed_hop._run(rank, world)
    dist.destroy_process_group()
    return {"hop": hop, "avg": test_hierarchical_avg._run(rank, world)}
