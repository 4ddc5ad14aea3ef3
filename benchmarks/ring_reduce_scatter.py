"""Gloo's own reduce-scatter (an all-reduce of the whole input) against our ring reduce-scatter, on
one host's loopback; with ``--all-gather``, gloo's ``all_gather_into_tensor`` against our direct
exchange (:func:`lightning_mics.collectives.direct_all_gather`, what MiCS uses inside a node).

    python benchmarks/ring_reduce_scatter.py [--ranks 2,4,8] [--sizes-kb 16,256,1024,4096,16384] [--repeats 20]
        [--all-gather]

Prints, per group size and input size, the median time of each over ``--repeats`` calls (after one
warm-up call each; both run back to back, alternating, so that load drifts hit both alike) and the
speed-up. Results are checked to agree before timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_mics.collectives import all_gather_flat, direct_all_gather, reduce_scatter_flat  # noqa: E402

_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    # the slowest rank sets a collective's time
    slowest = torch.tensor(samples)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def _all_gathers(rank: int, world: int, sizes_kb: list[int], repeats: int) -> None:
    """``--all-gather``: gloo's all-gather against the direct exchange; sizes are the gathered output."""
    for size_kb in sizes_kb:
        numel = max(world, size_kb * 1024 // 4 // world * world)
        shard = torch.randn(numel // world, generator=torch.Generator().manual_seed(rank))
        ours, gloos = torch.empty(numel), torch.empty(numel)
        direct_all_gather(ours, shard, None)
        all_gather_flat(gloos, shard, None)
        torch.testing.assert_close(ours, gloos, rtol=0, atol=0)
        native_s = _time(lambda: all_gather_flat(gloos, shard, None), repeats)
        direct_s = _time(lambda: direct_all_gather(ours, shard, None), repeats)
        if rank == 0:
            print(
                f"{world:>5}  {size_kb:>9,}  {native_s * 1e3:>12.2f}  {direct_s * 1e3:>9.2f}  "
                f"{native_s / direct_s:>7.2f}x",
                flush=True,
            )


def _worker(rank: int, world: int, port: int, sizes_kb: list[int], repeats: int, all_gather: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if all_gather:
        _all_gathers(rank, world, sizes_kb, repeats)
        dist.destroy_process_group()
        return
    for size_kb in sizes_kb:
        numel = max(world, size_kb * 1024 // 4 // world * world)
        data = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        ours, gloos = torch.empty(numel // world), torch.empty(numel // world)
        reduce_scatter_flat(ours, data, dist.ReduceOp.SUM, None)
        _native(gloos, data.clone(), op=dist.ReduceOp.SUM)
        torch.testing.assert_close(ours, gloos, rtol=1e-5, atol=1e-5)
        native_s = _time(lambda: _native(gloos, data, op=dist.ReduceOp.SUM), repeats)
        ring_s = _time(lambda: reduce_scatter_flat(ours, data, dist.ReduceOp.SUM, None), repeats)
        if rank == 0:
            print(
                f"{world:>5}  {size_kb:>9,}  {native_s * 1e3:>12.2f}  {ring_s * 1e3:>9.2f}  {native_s / ring_s:>7.2f}x",
                flush=True,
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4,8", help="group sizes, comma-separated")
    parser.add_argument("--sizes-kb", default="16,256,1024,4096,16384", help="input sizes per rank in KB")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--all-gather", action="store_true", help="time all-gathers (gloo's vs direct) instead")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_kb.split(",")]
    ours, size = ("direct ms", "output KB") if args.all_gather else ("ring ms", "input KB")
    print(f"{'ranks':>5}  {size:>9}  {'gloo ms':>12}  {ours:>9}  {'speed-up':>8}")
    for offset, world in enumerate(int(r) for r in args.ranks.split(",")):
        mp.start_processes(_worker, args=(world, 29750 + offset, sizes, args.repeats, args.all_gather), nprocs=world,
                           start_method="spawn")


if __name__ == "__main__":
    main()
