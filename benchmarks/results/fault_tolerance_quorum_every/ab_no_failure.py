"""Interleaved A/B of the no-failure runs only (benchmarks/fault_tolerance.py's run_no_failure) on one emulated
cluster: ORDER (default plain,ft,ft,plain,plain,ft), CHECK = FaultTolerance(check_parameters_every), the rest of the
arguments as fault_tolerance.py's, e.g.

    sudo CHECK=50 python benchmarks/results/fault_tolerance_quorum_every/ab_no_failure.py --no-failure-steps 100 \
        --quorum-every 50
"""
import os
import sys
import tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks import fault_tolerance as b
from benchmarks.emulated_cluster import set_up_network, ClusterShape
from benchmarks.netns import EmulatedCluster
argv = sys.argv[1:]
order = os.environ.get("ORDER", "plain,ft,ft,plain,plain,ft").split(",")
args = b.parse_args(["--quick", "--inter-node-mbps", "50", *argv])
check = int(os.environ.get("CHECK", "10"))
with EmulatedCluster(b.NODES, mtu=args.mtu) as cluster, tempfile.TemporaryDirectory() as tmp:
    set_up_network(cluster, ClusterShape(b.NODES, b.RANKS_PER_NODE), args.link)
    bench = b.Bench(cluster, args, Path(tmp), cluster.add_switch_address())
    orig_job = bench.job
    bench.job = lambda *a, **k: orig_job(*a, **({"check_parameters_every": check} | k))
    times = {}
    for i, mode in enumerate(order):
        run = b.run_no_failure(bench, mode, f"{mode}-{i}")
        t = b.median_step_seconds(run)
        times.setdefault(mode, []).append(run)
        print(mode, f"{t:.4f}", "load", os.getloadavg()[0], flush=True)
    p = b.pooled_median_step_seconds(times["plain"])
    f = b.pooled_median_step_seconds(times["ft"])
    print("pooled plain", round(p, 4), "ft", round(f, 4), "overhead", round(f / p, 4))
