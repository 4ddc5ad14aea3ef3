"""Fault tolerance on one machine: a Lighthouse, replica groups of CPU ranks, one group killed and restarted.

    python examples/fault_tolerance_demo.py                       # 2 groups x 2 ranks, group 1 killed at 25 s
    python examples/fault_tolerance_demo.py --groups 3 --steps 120 --kill-after 40 --restart-after 10
    python examples/fault_tolerance_demo.py --smoke               # the same path in under a minute

Each run writes to a folder of its own (``outputs/fault_tolerance_demo/<date>-<time>``, or ``--out``, which must
be new or empty: the demo never writes over files it did not make).

Each replica group is its own job (its own ``torch.distributed`` world, as on a cluster) training the demo
GPT with ``MiCSStrategy(fault_tolerance=True)``; every rank appends one line per optimizer step to
``<out>/group<g>.jsonl`` (time, torchft step, live groups, loss). At ``--kill-after`` seconds the last group's
whole process group is killed (a lost node: SIGKILL, no cleanup); ``--restart-after`` seconds later it is
started afresh and heals from a live group. The run ends with a summary (outage, discarded steps, the step
the restarted group healed at) and ``<out>/fault_tolerance.png``: each group's step over time, and the loss.
Needs the ``[ft]`` and ``[examples]`` extras. Every process it starts is killed when it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ one group
def run_group(args: argparse.Namespace) -> None:
    """A replica group's job: Lightning starts its ranks (this script again) and trains with fault tolerance."""
    import lightning.pytorch as pl

    from examples.models import ByteCorpusDataModule, GPTLightningModule
    from lightning_mics import MiCSStrategy

    group = int(os.environ["MICS_REPLICA_GROUP"])
    out = Path(args.out)

    class StepLog(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            manager = trainer.strategy.engine.replica_group.manager
            loss = outputs["loss"].item() if isinstance(outputs, dict) else float(outputs)
            line = {"t": time.time(), "group": group, "rank": trainer.global_rank, "step": manager.current_step(),
                    "live": manager.num_participants(), "loss": loss}
            with open(out / f"group{group}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            if args.step_delay:
                time.sleep(args.step_delay)

    pl.seed_everything(1234)
    trainer = pl.Trainer(
        strategy=MiCSStrategy(fault_tolerance=True),
        accelerator="cpu", devices=args.ranks, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[StepLog()], num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(GPTLightningModule("tiny", warmup_steps=5), ByteCorpusDataModule(batch_size=4, max_bytes=200_000))


# ------------------------------------------------------------------------------------------------ the cluster
def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A process in a session of its own, so that it and everything it starts can be killed together."""
    return subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=30)


def launch_group(group: int, args: argparse.Namespace, lighthouse: str, out: Path, port: int) -> subprocess.Popen:
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse, MICS_REPLICA_GROUP=str(group),
               MICS_NUM_REPLICA_GROUPS=str(args.groups), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=str(ROOT))
    argv = [sys.executable, __file__, "--group", "--out", str(out), "--ranks", str(args.ranks),
            "--steps", str(args.steps), "--step-delay", str(args.step_delay)]
    return start(argv, env, out / f"group{group}-{int(time.time())}.log")


def output_folder(given: Optional[str]) -> Path:
    """A fresh folder for this run: ``given`` if it is new or empty, else a clear refusal (so that a run never
    writes over results someone keeps); by default a new ``outputs/fault_tolerance_demo/<date>-<time>``."""
    out = Path(given) if given else Path("outputs/fault_tolerance_demo") / time.strftime("%Y%m%d-%H%M%S")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"--out {out} exists and is not an empty folder: give a new one (the demo writes group logs, "
                         "summary.txt and a plot there and never over files it did not make).")
    out.mkdir(parents=True, exist_ok=True)
    return out


def orchestrate(args: argparse.Namespace) -> None:
    out = output_folder(args.out)
    lighthouse_bin = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    address = f"127.0.0.1:{args.port}"
    processes: list[subprocess.Popen] = []
    try:
        processes.append(start([lighthouse_bin, "--min_replicas", "1", "--bind", address, "--join_timeout_ms",
                                "30000", "--heartbeat_timeout_ms", "2000"], dict(os.environ), out / "lighthouse.log"))
        groups = {
            g: launch_group(g, args, f"http://{address}", out, args.port + 10 * (g + 1)) for g in range(args.groups)
        }
        processes += groups.values()
        started = time.time()
        victim = args.groups - 1
        events: dict[str, float] = {}
        # a busy machine starts the groups late: --kill-after-steps waits until the victim has trained with the
        # others, so that the kill always lands on a running group (and not on one still importing torch)
        while time.time() - started < args.kill_after or trained_steps(out, victim) < args.kill_after_steps:
            if groups[victim].poll() is not None:
                raise SystemExit(f"group {victim} exited with {groups[victim].returncode} before it was killed: "
                                 f"see {out}/group{victim}-*.log")
            time.sleep(0.2)
        kill(groups[victim])
        events["killed"] = time.time()
        print(f"killed group {victim} at {events['killed'] - started:.1f} s", flush=True)
        time.sleep(args.restart_after)
        groups[victim] = launch_group(victim, args, f"http://{address}", out, args.port + 10 * (victim + 1) + 5)
        processes.append(groups[victim])
        events["restarted"] = time.time()
        print(f"restarted group {victim} at {events['restarted'] - started:.1f} s", flush=True)
        for group, process in groups.items():
            process.wait(timeout=args.timeout)
            print(f"group {group} exited with {process.returncode}", flush=True)
    finally:
        for process in processes:
            kill(process)
    report(out, started, events, victim, args.groups)
    print(f"logs: {out}")


def trained_steps(out: Path, group: int) -> int:
    """How many optimizer steps rank 0 of ``group`` has logged so far."""
    path = out / f"group{group}.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]  # the last may be half written
    return sum(1 for line in lines if json.loads(line)["rank"] == 0)


# ------------------------------------------------------------------------------------------------ the report
def committed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of committed steps in one group's step log (time order): torchft's step advances when a step
    commits, so a row whose step repeats the one before it belongs to a discarded step."""
    kept, last = [], None
    for row in rows:
        if last is None or row["step"] > last:
            kept.append(row)
        last = row["step"]
    return kept


def outage(rows: list[dict[str, Any]], groups: int) -> Optional[tuple[float, float]]:
    """(start, end) of the outage one group saw: from its first step with fewer live groups than ``groups`` to its
    first committed step with all of them again (``end`` is ``nan`` if they never came back); ``None``: no step
    with fewer groups. A step under way at the kill, still in the old quorum, neither starts nor ends it."""
    start = next((r["t"] for r in rows if r["live"] < groups), None)
    if start is None:
        return None
    end = next((r["t"] for r in committed(rows) if r["t"] > start and r["live"] == groups), float("nan"))
    return start, end


def report(out: Path, started: float, events: dict[str, float], victim: int, groups: int) -> None:
    """Summary and plot from the groups' step logs (rank 0 of each group)."""
    rows = [json.loads(line) for g in range(groups) for line in (out / f"group{g}.jsonl").read_text().splitlines()]
    rows = sorted((r for r in rows if r["rank"] == 0), key=lambda r: r["t"])
    survivor = [r for r in rows if r["group"] == 0]
    after = [r for r in rows if r["group"] == victim and r["t"] > events["restarted"]]
    alone = [r for r in committed(survivor) if r["live"] < groups]
    discarded = len(survivor) - len(committed(survivor))
    seen = outage(survivor, groups)
    if seen is None:
        outage_line = "group 0 never trained without the others"
    elif seen[1] != seen[1]:  # nan: all groups never came back
        outage_line = f"outage seen by group 0: from {seen[0] - started:.1f} s on; the groups never all came back"
    else:
        outage_line = (f"outage seen by group 0: {seen[1] - seen[0]:.1f} s (from its first step with fewer groups at "
                       f"{seen[0] - started:.1f} s to its first committed step with all {groups} at "
                       f"{seen[1] - started:.1f} s)")
    lines = [
        f"group {victim} killed at {events['killed'] - started:.1f} s, "
        f"restarted at {events['restarted'] - started:.1f} s",
        f"group 0 trained alone for {len(alone)} steps; steps discarded on group 0: {discarded}",
        outage_line,
        restarted_line(after),
    ]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(out, rows, started, events, groups)


def restarted_line(after: list[dict[str, Any]]) -> str:
    """The restarted group's first step, and whether it healed: a group that took its state from a live group
    starts at that group's step; one that found none starts at step 1 with a fresh model."""
    if not after:
        return "the restarted group's first step: none (it never trained)"
    first = after[0]["step"]
    how = "healed from a live group" if first > 1 else "started afresh: no live group to heal from"
    return f"the restarted group's first step: {first} ({how})"


def plot(out: Path, rows: list[dict[str, Any]], started: float, events: dict[str, float], groups: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_step, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    for g in range(groups):
        mine = [r for r in rows if r["group"] == g]
        style = {"marker": "o" if g == 0 else "x", "markersize": 6 if g == 0 else 4, "linestyle": "none"}
        ax_step.plot([r["t"] - started for r in mine], [r["step"] for r in mine], label=f"group {g}", **style)
        ax_loss.plot([r["step"] for r in mine], [r["loss"] for r in mine], label=f"group {g}", **style)
    for name, t in events.items():
        ax_step.axvline(t - started, color="grey", linestyle="--")
        ax_step.text(t - started, 0, f" {name}", rotation=90, va="bottom")
    ax_step.set(xlabel="seconds", ylabel="torchft step (committed)", title="steps over time")
    ax_loss.set(xlabel="torchft step", ylabel="training loss", title="loss")
    ax_step.legend()
    fig.tight_layout()
    fig.savefig(out / "fault_tolerance.png", dpi=100)
    print(f"plot: {out / 'fault_tolerance.png'}")


#: --smoke's settings (each unless given on the command line). The step delay paces the survivor: alone it steps
#: fast, and it must still be training when the restarted group (a new process importing torch, ~8-15 s on a busy
#: 2-core machine) reaches its first quorum, or there is no live group left to heal from.
SMOKE: dict[str, Any] = {"ranks": 1, "steps": 40, "kill_after": 0.0, "kill_after_steps": 3, "restart_after": 0.5,
                         "step_delay": 0.3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", action="store_true", help=argparse.SUPPRESS)  # internal: run one group
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks per group")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--kill-after", type=float, default=25.0, help="seconds until the last group is killed")
    parser.add_argument("--restart-after", type=float, default=5.0, help="seconds until it is started again")
    parser.add_argument("--step-delay", type=float, default=0.2, help="seconds each step sleeps (a longer run)")
    parser.add_argument("--port", type=int, default=29510, help="the Lighthouse's; groups use the ones above it")
    parser.add_argument("--kill-after-steps", type=int, default=0,
                        help="also wait until the last group has trained this many steps before killing it")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None,
                        help="a new or empty folder for this run (default: outputs/fault_tolerance_demo/<date>-<time>)")
    parser.add_argument("--smoke", action="store_true",
                        help="the same path in under a minute (what the tests run): 1 rank per group, 40 steps, "
                             "the last group killed once it trained 3 steps and restarted 0.5 s later; "
                             "explicit options still win")
    args = parser.parse_args()
    if args.smoke:
        for name, value in SMOKE.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    if args.groups < 2 or args.ranks < 1 or args.steps < 1 or args.kill_after_steps < 0:
        parser.error("--groups must be at least 2 (one is killed), --ranks and --steps positive, "
                     "--kill-after-steps >= 0.")
    if args.group:
        run_group(args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
