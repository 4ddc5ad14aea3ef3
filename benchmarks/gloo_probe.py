"""Intra-node collective throughput as the training ranks see it: ``ranks_per_node`` gloo processes
in one node's namespace all-reduce a buffer the size of one model unit, over loopback.

Started by ``emulated_cluster.py`` on every node at once (the nodes share the host's cores, as
the training ranks do). Rank 0 prints ``{"iterations", "seconds", "payload_bytes", "ranks"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", required=True, help="tcp://ADDRESS:PORT of the node's rank 0")
    parser.add_argument("--payload-bytes", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world)
    buffer = torch.ones(max(1, args.payload_bytes // 4), dtype=torch.float32)
    dist.all_reduce(buffer)  # connect and warm up
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(buffer)
    first = time.perf_counter() - start
    # Everyone runs the same count: rank 0's estimate of how many fit in the time budget.
    count = torch.tensor([max(2, int(args.seconds / max(first, 1e-6)))])
    dist.broadcast(count, 0)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(int(count)):
        dist.all_reduce(buffer)
    dist.barrier()
    seconds = time.perf_counter() - start
    if args.rank == 0:
        print(json.dumps({"iterations": int(count), "seconds": seconds, "payload_bytes": buffer.numel() * 4,
                          "ranks": args.world}), flush=True)
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
