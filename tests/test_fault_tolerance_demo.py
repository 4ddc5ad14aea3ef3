"""The fault-tolerance demo (``examples/fault_tolerance_demo.py``): its summary and output folder on hand-made step
logs, and its smoke run as a user starts it (a Lighthouse, two groups, one killed and restarted)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from distributed import free_port, run_script

from examples.fault_tolerance_demo import committed, output_folder, outage

REPO = Path(__file__).resolve().parents[1]


def _row(t: float, step: int, live: int) -> dict:
    return {"t": t, "group": 0, "rank": 0, "step": step, "live": live, "loss": 1.0}


def test_the_outage_runs_from_the_first_step_with_fewer_groups_to_the_first_committed_one_with_all() -> None:
    # two groups; the other is killed at 10.5 s, mid-step: the step under way (logged at 11.0 s, still in the old
    # quorum: live 2) is discarded, so its step repeats; the survivor trains alone from 16 s; the restarted group
    # joins at 30 s, and the first step with both (31 s) is discarded once more before 32 s commits with both
    rows = [_row(9.0, 4, 2), _row(10.0, 5, 2), _row(11.0, 5, 2), _row(16.0, 6, 1), _row(17.0, 7, 1),
            _row(30.0, 8, 1), _row(31.0, 8, 2), _row(32.0, 9, 2), _row(33.0, 10, 2)]
    assert [r["t"] for r in committed(rows)] == [9.0, 10.0, 16.0, 17.0, 30.0, 32.0, 33.0]
    assert outage(rows, groups=2) == (16.0, 32.0)  # not 0.5 s from the kill to the discarded row at 11.0 s
    assert outage(rows[:3], groups=2) is None
    start, end = outage(rows[:6], groups=2)
    assert start == 16.0 and end != end  # nan: never all back


def test_each_run_writes_to_a_fresh_folder_and_never_over_kept_files(tmp_path: Path, monkeypatch) -> None:
    kept = tmp_path / "results"
    kept.mkdir()
    (kept / "fault_tolerance.json").write_text("{}")
    with pytest.raises(SystemExit, match="exists and is not an empty folder: give a new one"):
        output_folder(str(kept))
    assert (kept / "fault_tolerance.json").read_text() == "{}"
    assert output_folder(str(tmp_path / "new")).is_dir()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert output_folder(str(empty)) == empty
    # the default: a new dated folder under outputs/, which git ignores, so a run leaves `git status` clean
    monkeypatch.chdir(tmp_path)
    default = output_folder(None)
    assert default.parent == Path("outputs/fault_tolerance_demo") and default.is_dir()
    ignored = subprocess.run(["git", "check-ignore", "-q", str(default / "group0.jsonl")], cwd=REPO)
    assert ignored.returncode == 0


@pytest.mark.entry_point
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_fault_tolerance_demo_kills_and_heals_a_group(tmp_path: Path) -> None:
    status = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    output = run_script("examples/fault_tolerance_demo.py", "--smoke", "--port", str(free_port()), "--out",
                  str(tmp_path), "--timeout", "180", timeout=220, cwd=REPO)
    # everything it wrote is in its own folder
    assert subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout == status
    assert "killed group 1" in output and "restarted group 1" in output
    healed = re.search(r"the restarted group's first step: (\d+) \(healed from a live group\)", output)
    assert healed is not None, output[-2000:]
    assert int(healed.group(1)) > 3  # it took the survivor's step, not a fresh start
    assert re.search(r"group 0 trained alone for [1-9]\d* steps", output), output[-2000:]
    assert (tmp_path / "summary.txt").read_text() in output
    assert (tmp_path / "fault_tolerance.png").stat().st_size > 0
    # what each group's console shows of the failure after its start-up lines: a few lines, once per group --
    # no torchft INFO, no traceback (the survivor: discarded, left, joined; the restarted group: joined, caught up)
    logs = sorted(tmp_path.glob("group*-*.log"))
    assert len(logs) == 3, logs
    for log in logs:
        lines = log.read_text().splitlines()
        assert not [line for line in lines if "[INFO]" in line or "Traceback" in line], log
        start_up_end = max(i for i, line in enumerate(lines) if "process groups created by this layout" in line)
        after = [line for line in lines[start_up_end + 1:] if not line.startswith("`Trainer.fit` stopped")]
        assert len(after) <= 10, (log, after)
    survivor = next(log for log in logs if log.name.startswith("group0")).read_text()
    # once per group: at most one line for the loss (none when the kill fell between the survivor's quorums and the
    # restarted group was back by the next one) and one for the step it discarded
    assert survivor.count("replica group(s) left at step") <= 1 and survivor.count("discarded (") <= 1
