"""Interleaved A/B of the no-failure runs only (plain, ft, ft, plain, plain, ft) on one emulated cluster."""
import sys, os, tempfile
from pathlib import Path
sys.path.insert(0, "/work/main")
from benchmarks import fault_tolerance as b
from benchmarks.emulated_cluster import set_up_network, ClusterShape
from benchmarks.netns import EmulatedCluster
args = b.parse_args(["--quick", "--inter-node-mbps", "50"])
with EmulatedCluster(b.NODES, mtu=args.mtu) as cluster, tempfile.TemporaryDirectory() as tmp:
    set_up_network(cluster, ClusterShape(b.NODES, b.RANKS_PER_NODE), args.link)
    switch = cluster.add_switch_address()
    times = {"plain": [], "ft": []}
    for i, mode in enumerate(["plain", "ft", "ft", "plain", "plain", "ft"]):
        (Path(tmp) / f"r{i}").mkdir()
        run = b.run_no_failure(b.Bench(cluster, args, Path(tmp) / f"r{i}", switch), mode)
        t = b.median_step_seconds(run)
        times[mode].append(t)
        print(mode, f"{t:.4f}", "load", os.getloadavg()[0], flush=True)
    print({k: [round(x, 4) for x in v] for k, v in times.items()})
