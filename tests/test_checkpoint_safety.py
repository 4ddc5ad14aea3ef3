"""Checkpoints are untrusted input: hostile or damaged files are refused with one clear error, before
anything is read into the model, and nothing in a checkpoint can make a save write or delete
outside it. Also background (async) saves: same atomicity, failures and integrity as foreground ones."""

from __future__ import annotations

import errno
import json
import os
import pickle
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from checkpoint_helpers import WideModule, assert_same_tensors, fit_errors, plain_toy_optimizer
from distributed import run_ranks
from toy import RunConfig, ToyModule

from lightning_mics import checkpoint as ckpt
from lightning_mics import consolidate
from lightning_mics.checkpoint import atomic, integrity
from lightning_mics.checkpoint.format import METADATA_FILE, TRAINER_STATE_FILE


class _Trap:
    """Unpickling this runs code (here: creates a file), as a malicious checkpoint would."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path(self.marker).touch, ())


def _save_toy(path: Path, saver: Optional[ckpt.AsyncCheckpointSaver] = None) -> ToyModule:
    """A toy model and its SGD-momentum state, saved sharded in this process."""
    module = ToyModule(RunConfig())
    optimizer, _ = plain_toy_optimizer(module)
    checkpoint = {
        "state_dict": ckpt.model_state_dict(module),
        "optimizer_states": [ckpt.optimizer_state_dict(module, optimizer)],
        "global_step": 0,
    }
    ckpt.save(path, checkpoint, saver=saver)
    if saver is not None:
        saver.wait()
    return module


def _data_dir(path: Path) -> Path:
    return path / ckpt.read_record(path).data


def _record(path: Path) -> dict[str, Any]:
    return json.loads((path / ckpt.MANIFEST_FILE).read_text())


def _write_record(path: Path, record: dict[str, Any]) -> None:
    (path / ckpt.MANIFEST_FILE).write_text(json.dumps(record))


def _forge(path: Path, name: str, data: bytes) -> None:
    """Replace a file of the checkpoint and update its integrity record, as an attacker would."""
    target = _data_dir(path) / name
    target.write_bytes(data)
    record = _record(path)
    record["files"][name] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    _write_record(path, record)


def _hostile_metadata(path: Path, marker: Path) -> None:
    """A ``.metadata`` whose unpickling runs code, with a matching integrity record."""
    metadata = ckpt_metadata(path)
    metadata.storage_meta.checkpoint_id = _Trap(marker)  # type: ignore[assignment]
    _forge(path, METADATA_FILE, pickle.dumps(metadata))


def ckpt_metadata(path: Path) -> Any:
    with open(_data_dir(path) / METADATA_FILE, "rb") as handle:
        return pickle.load(handle)  # our own, just written: trusted here


def _parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def _fresh_toy_with_optimizer() -> tuple[ToyModule, torch.optim.Optimizer]:
    torch.manual_seed(1234)  # other values than the saved model's
    module = ToyModule(RunConfig())
    with torch.no_grad():
        for param in module.parameters():
            param.normal_()
    optimizer, _ = plain_toy_optimizer(module)
    ckpt.optimizer_state_dict(module, optimizer)  # creates the momentum buffers
    return module, optimizer


def _momentum(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {str(i): s["momentum_buffer"].clone() for i, s in optimizer.state_dict()["state"].items()}


def _assert_refused_and_untouched(path: Path, match: str, verify: ckpt.VerifyMode = "checksum") -> str:
    """``ckpt.load`` raises a CheckpointError matching ``match`` and leaves model and optimizer bit-identical."""
    module, optimizer = _fresh_toy_with_optimizer()
    before, momentum_before = _parameters(module), _momentum(optimizer)
    with pytest.raises(ckpt.CheckpointError, match=match) as raised:
        ckpt.load(path, module, [optimizer], restore_rng=True, verify=verify)
    assert_same_tensors(_parameters(module), before)
    assert_same_tensors(_momentum(optimizer), momentum_before)
    return str(raised.value)


# ---------------------------------------------------------------------------------------------------------------------
# code execution


def test_hostile_metadata_never_runs_in_any_consumer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ckpt.load (hence resume), read_full_state and the consolidation CLI refuse it; its code never runs."""
    marker = tmp_path / "code-ran"
    path = tmp_path / "hostile.ckpt"
    _save_toy(path)
    _hostile_metadata(path, marker)

    message = _assert_refused_and_untouched(path, "could run arbitrary code")
    assert "is not part of checkpoint metadata" in message and "Do not use this checkpoint" in message, message
    with pytest.raises(ckpt.CheckpointError, match="could run arbitrary code"):
        ckpt.read_full_state(path)
    with pytest.raises(SystemExit) as exited:  # the consolidation command line
        consolidate.main([str(path), str(tmp_path / "out.pt")])
    assert exited.value.code == 2 and "could run arbitrary code" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
    pickle.loads((_data_dir(path) / METADATA_FILE).read_bytes())  # the trap is real: plain unpickling runs it
    assert marker.exists()


def test_integrity_record_catches_an_unforged_hostile_metadata(tmp_path: Path) -> None:
    """Replaced without updating the record, the same file is reported as damaged before it is read."""
    marker = tmp_path / "code-ran"
    path = tmp_path / "hostile.ckpt"
    _save_toy(path)
    metadata = ckpt_metadata(path)
    metadata.storage_meta.checkpoint_id = _Trap(marker)  # type: ignore[assignment]
    (_data_dir(path) / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    _assert_refused_and_untouched(path, r"is damaged[\s\S]*\.metadata")
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------------------------------
# paths in the commit record


@pytest.mark.parametrize(
    "named",
    ["absolute", "../outside", ".", "..", "state-step000000001-ab/../..", "nested/state-step000000001-ab", ""],
)
def test_record_naming_a_path_outside_is_refused_and_saves_stay_inside(tmp_path: Path, named: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    path = tmp_path / "ckpts" / "last.ckpt"
    path.parent.mkdir()
    module = _save_toy(path)
    record = _record(path)
    record["data"] = str(outside) if named == "absolute" else named
    _write_record(path, record)
    before = sorted(str(p) for p in tmp_path.rglob("*") if "last.ckpt" not in str(p))

    for call in (ckpt.inspect_checkpoint, ckpt.read_full_state):
        with pytest.raises(ckpt.CheckpointError, match="is damaged: its field 'data'"):
            call(path)
    _assert_refused_and_untouched(path, "nothing was read, written or deleted")

    # the next save replaces the damaged checkpoint, touching nothing outside it
    _save_toy(path)
    assert sorted(str(p) for p in tmp_path.rglob("*") if "last.ckpt" not in str(p)) == before
    assert (outside / "precious.txt").read_text() == "keep me"
    fresh, optimizer = _fresh_toy_with_optimizer()
    ckpt.load(path, fresh, [optimizer])
    assert_same_tensors(_parameters(fresh), _parameters(module))


def test_symlinked_data_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    _save_toy(path)
    data = _data_dir(path)
    elsewhere = tmp_path / "elsewhere"
    data.rename(elsewhere)
    data.symlink_to(elsewhere, target_is_directory=True)
    _assert_refused_and_untouched(path, "symbolic link")
    _save_toy(path)  # replaces the link, never what it points to
    assert (elsewhere / METADATA_FILE).is_file()
    assert not _data_dir(path).is_symlink()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("global_step", "abc"),
        ("epoch", 1.5),
        ("num_optimizers", -1),
        ("layout", {"world_size": "4", "partition_size": 2, "ranks_per_node": 4}),
        ("format_version", "1"),
        ("files", {"../x": {"size": 1, "crc32": "00000000"}}),
        ("files", {METADATA_FILE: {"size": "big", "crc32": "00000000"}}),
        ("files", []),
    ],
)
def test_record_with_wrong_typed_fields_is_one_clear_error(tmp_path: Path, field: str, value: Any) -> None:
    path = tmp_path / "last.ckpt"
    _save_toy(path)
    record = _record(path)
    record[field] = value
    _write_record(path, record)
    message = _assert_refused_and_untouched(path, f"is damaged: its field '{field}")
    assert "load an earlier checkpoint" in message


def test_unreadable_record_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    _save_toy(path)
    (path / ckpt.MANIFEST_FILE).write_text('{"format": "lightning-mics-sharded", "data": ')
    _assert_refused_and_untouched(path, "unreadable or corrupt")


# ---------------------------------------------------------------------------------------------------------------------
# damaged files


def _shard(data_dir: Path) -> str:
    return next(p.name for p in sorted(data_dir.glob("*.distcp")))


_FILES: dict[str, Callable[[Path], str]] = {
    "shard": _shard,
    "metadata": lambda _: METADATA_FILE,
    "trainer state": lambda _: TRAINER_STATE_FILE,
    "rng": lambda _: "rng/rank00000.pt",
}


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 3] = bytes(b ^ 0xFF for b in data[middle : middle + 3])
    file.write_bytes(bytes(data))


def _flip_inside_tensor_values(file: Path, tensors: Iterable[torch.Tensor]) -> None:
    """Flip bytes inside the stored values of the largest of ``tensors`` found in ``file``, so that
    the file's structure stays readable: torch 2.11's DCP writes each tensor as its own
    ``torch.save`` archive, where a flip at an arbitrary offset can hit an archive header. Values
    stored twice (tied weights: one of the copies may be the one loaded) are passed over."""
    data = bytearray(file.read_bytes())
    for tensor in sorted(tensors, key=torch.Tensor.numel, reverse=True):
        values = tensor.detach().cpu().contiguous().numpy().tobytes()
        if data.count(values) == 1:
            start = data.find(values)
            middle = start + len(values) // 2
            data[middle : middle + 3] = bytes(b ^ 0xFF for b in data[middle : middle + 3])
            file.write_bytes(bytes(data))
            return
    raise AssertionError(f"none of the tensors' values are stored verbatim in {file}")


_DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (_truncate, "truncated"),
    "flipped": (_flip, "its bytes changed"),
    "deleted": (Path.unlink, "missing"),
}


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
@pytest.mark.parametrize("which", sorted(_FILES))
def test_damaged_file_is_named_and_nothing_is_loaded(tmp_path: Path, which: str, damage: str) -> None:
    path = tmp_path / "last.ckpt"
    _save_toy(path)
    name = _FILES[which](_data_dir(path))
    how, symptom = _DAMAGE[damage]
    how(_data_dir(path) / name)
    message = _assert_refused_and_untouched(path, "is damaged; nothing was loaded")
    assert f"{name}: " in message and symptom in message and "pass another ckpt_path" in message, message
    with pytest.raises(ckpt.CheckpointError, match=symptom):
        ckpt.read_full_state(path)


@pytest.mark.parametrize("which", sorted(_FILES))
def test_damage_found_without_checksums_still_loads_nothing(tmp_path: Path, which: str) -> None:
    """With verification off (or an old checkpoint without a record), a truncated file fails while
    reading -- with an error naming it -- and the module and optimizer keep their values."""
    path = tmp_path / "last.ckpt"
    _save_toy(path)
    name = _FILES[which](_data_dir(path))
    _truncate(_data_dir(path) / name)
    message = _assert_refused_and_untouched(path, "damaged|Reading the shards", verify="none")
    assert "Traceback" not in message
    if which != "shard":  # DCP reports shard failures per item, not per file
        assert name.split("/")[-1] in message, message


def test_size_only_verification_finds_truncation_but_not_flips(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    module = _save_toy(path)
    shard = _data_dir(path) / _shard(_data_dir(path))
    original = shard.read_bytes()
    _flip_inside_tensor_values(shard, _parameters(module).values())
    fresh, optimizer = _fresh_toy_with_optimizer()
    ckpt.load(path, fresh, [optimizer], verify="size")  # the documented trade-off: flips pass
    assert not all(torch.equal(fresh.state_dict()[n], v) for n, v in _parameters(module).items())  # and load
    _truncate(shard)
    _assert_refused_and_untouched(path, "truncated", verify="size")
    shard.write_bytes(original)
    fresh, optimizer = _fresh_toy_with_optimizer()
    ckpt.load(path, fresh, [optimizer])
    assert_same_tensors(_parameters(fresh), _parameters(module))
    with pytest.raises(ValueError, match="verify='sha'"):
        ckpt.load(path, fresh, verify="sha")  # type: ignore[arg-type]


def test_checkpoint_without_integrity_record_still_loads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "old.ckpt"
    module = _save_toy(path)
    record = _record(path)
    del record["files"], record["checksum"]
    _write_record(path, record)
    fresh, optimizer = _fresh_toy_with_optimizer()
    with caplog.at_level("INFO", logger="lightning_mics.checkpoint.integrity"):
        ckpt.load(path, fresh, [optimizer])
    assert_same_tensors(_parameters(fresh), _parameters(module))
    assert "has no integrity record" in caplog.text


def test_record_lists_every_file_with_its_digest(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    _save_toy(path)
    data_dir = _data_dir(path)
    files = ckpt.read_record(path).files
    assert files is not None
    assert sorted(files) == integrity.all_files(data_dir)
    assert {METADATA_FILE, TRAINER_STATE_FILE, "rng/rank00000.pt"} <= set(files)
    for name, digest in files.items():
        data = (data_dir / name).read_bytes()
        assert digest == ckpt.FileDigest(size=len(data), crc32=f"{zlib.crc32(data):08x}")


def test_plain_sgd_checkpoint_consolidates(tmp_path: Path) -> None:
    """An optimizer without per-parameter state (SGD without momentum) saves no ``state`` entry."""
    module = ToyModule(RunConfig())
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    checkpoint = {
        "state_dict": ckpt.model_state_dict(module),
        "optimizer_states": [ckpt.optimizer_state_dict(module, optimizer)],
        "global_step": 0,
    }
    ckpt.save(tmp_path / "sgd.ckpt", checkpoint)
    out = consolidate.consolidate(tmp_path / "sgd.ckpt", tmp_path / "sgd.pt", with_optimizer=True)
    full = torch.load(out, weights_only=True)
    assert full["optimizer_states"][0]["state"] == {} and full["optimizer_states"][0]["param_groups"][0]["lr"] == 0.1


# ---------------------------------------------------------------------------------------------------------------------
# failed and background saves


def _disk_full_on(name_part: str, monkeypatch: pytest.MonkeyPatch) -> None:
    original = atomic.write_durably

    def full_disk(path: Path, data: Any) -> None:
        if name_part in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        original(path, data)

    monkeypatch.setattr(atomic, "write_durably", full_disk)


def _tree_bytes(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_disk_full_during_save_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    saver = ckpt.AsyncCheckpointSaver() if background else None
    path = tmp_path / "last.ckpt"
    _save_toy(path, saver)
    before = _tree_bytes(path)
    with monkeypatch.context() as patch:
        _disk_full_on("rank00000", patch)
        with pytest.raises(ckpt.CheckpointError, match="No space left on device") as raised:
            _save_toy(path, saver)
    assert "not committed" in str(raised.value)
    assert _tree_bytes(path) == before  # byte-identical, and the failed save's staging is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    _save_toy(path, saver)  # the saver is usable after a failure
    if saver is not None:
        saver.close()


def test_background_save_returns_before_commit_and_keeps_the_values_of_its_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saver = ckpt.AsyncCheckpointSaver()
    module = WideModule()
    at_save = _parameters(module)
    release, worker_threads = threading.Event(), []
    original = atomic.commit_sharded

    def held_commit(*args: Any) -> None:
        worker_threads.append(threading.current_thread().name)
        assert release.wait(60)
        original(*args)

    monkeypatch.setattr(atomic, "commit_sharded", held_commit)
    path = tmp_path / "async.ckpt"
    ckpt.save(path, {"state_dict": ckpt.model_state_dict(module), "global_step": 3}, saver=saver)
    assert saver.in_flight == path
    with torch.no_grad():  # training goes on and changes the parameters in place
        for param in module.parameters():
            param.add_(1.0)
    with pytest.raises(FileNotFoundError):
        ckpt.inspect_checkpoint(path)  # not committed yet
    release.set()
    saver.close()
    assert worker_threads and worker_threads[0].startswith("mics-checkpoint")
    assert ckpt.inspect_checkpoint(path).global_step == 3
    reloaded = WideModule()
    ckpt.load(path, reloaded)
    assert_same_tensors(_parameters(reloaded), at_save)


# ---------------------------------------------------------------------------------------------------------------------
# through the Trainer, on two ranks


@pytest.mark.distributed
def test_hostile_and_damaged_checkpoints_given_to_fit(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    hostile, flipped, traversal = tmp_path / "hostile.ckpt", tmp_path / "flipped.ckpt", tmp_path / "traversal.ckpt"
    for path in (hostile, flipped, traversal):
        _save_toy(path)
    _hostile_metadata(hostile, marker)
    _flip(_data_dir(flipped) / _shard(_data_dir(flipped)))
    record = _record(traversal)
    record["data"] = "../outside"
    _write_record(traversal, record)
    cases = {"hostile": ("toy", str(hostile)), "flipped": ("toy", str(flipped)), "traversal": ("toy", str(traversal))}
    outcomes = run_ranks(fit_errors, 2, cases)
    assert outcomes[0] == outcomes[1]  # every rank fails the same way: none waits for the others
    errors = outcomes[0]
    assert errors["hostile"].startswith("CheckpointError") and "could run arbitrary code" in errors["hostile"]
    assert "is damaged; nothing was loaded" in errors["flipped"] and "its bytes changed" in errors["flipped"]
    assert "is damaged: its field 'data'" in errors["traversal"]
    assert not marker.exists()


@pytest.mark.parametrize("keep_previous", [False, True])
def test_a_save_can_keep_the_data_it_replaces_for_a_reader_that_opened_it(
    tmp_path: Path, keep_previous: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """With fault tolerance a restarted group may be loading ``last`` while live groups save it, several times
    while it reads when they save every second: with ``keep_previous`` the data the reader's record named stays
    whole through later saves (for SUPERSEDED_GRACE_S after its switch, at most MAX_SUPERSEDED generations) and
    loading warns about nothing; without, it is deleted at the switch."""
    from lightning_mics.checkpoint.atomic import MAX_SUPERSEDED, SUPERSEDED_GRACE_S

    path = tmp_path / "last.ckpt"
    module = ToyModule(RunConfig())
    optimizer, _ = plain_toy_optimizer(module)

    def save(step: int) -> None:
        checkpoint = {"state_dict": ckpt.model_state_dict(module), "global_step": step}
        checkpoint["optimizer_states"] = [ckpt.optimizer_state_dict(module, optimizer)]
        ckpt.save(path, checkpoint, keep_previous=keep_previous)

    def generations() -> list[Path]:
        return sorted(p for p in path.iterdir() if p.name.startswith("state-step"))

    save(1)
    opened = _data_dir(path)  # a reader read the record just before the next save switched it
    files = {f.relative_to(opened): f.read_bytes() for f in opened.rglob("*") if f.is_file()}
    save(2)
    assert opened.is_dir() == keep_previous
    if not keep_previous:
        return
    save(3)  # a second save while the reader still reads: its data stays
    assert {f.relative_to(opened): f.read_bytes() for f in opened.rglob("*") if f.is_file()} == files
    fresh = ToyModule(RunConfig(seed=5))
    with caplog.at_level("WARNING", logger="lightning_mics"):
        ckpt.load(path, fresh)
    assert not [r for r in caplog.records if "interrupted save" in r.getMessage()]
    for step in range(4, MAX_SUPERSEDED + 4):  # saves every second: the oldest go beyond MAX_SUPERSEDED
        save(step)
    assert len(generations()) == MAX_SUPERSEDED + 1 and not opened.exists()  # the current one and the kept
    superseded = [p for p in generations() if p != _data_dir(path)]
    long_ago = time.time() - SUPERSEDED_GRACE_S - 1
    for old in superseded[:-2]:  # superseded over a grace period ago: the next save removes them
        os.utime(old, (long_ago, long_ago))
    current = _data_dir(path)
    with caplog.at_level("INFO", logger="lightning_mics"):
        save(100)
    removals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Removing")]
    assert len(removals) == len(superseded) - 2
    assert all("the previous save's" in m and "interrupted" not in m for m in removals), removals
    assert set(generations()) == {*superseded[-2:], current, _data_dir(path)}  # the recent ones stay


def test_background_saves_stage_into_the_last_saves_host_buffers_with_the_new_values() -> None:
    """A save's states are copied into the previous save's host buffers when the structure is the same (no new
    allocation), carrying this save's values -- tensors and the rest (a learning rate that moved) alike; a new
    structure gets new buffers."""
    from lightning_mics.checkpoint.saving import AsyncCheckpointSaver

    saver = AsyncCheckpointSaver()
    optim = {"param_groups": [{"lr": 0.1}], "state": {0: {"step": torch.tensor(1.0)}}}
    payload = {"model": {"w": torch.ones(3)}, "optim": optim}
    first = saver.stage(payload)
    assert torch.equal(first["model"]["w"], torch.ones(3)) and first["model"]["w"] is not payload["model"]["w"]
    payload["model"]["w"].fill_(2.0)
    payload["optim"]["param_groups"][0]["lr"] = 0.05
    payload["optim"]["state"][0]["step"].fill_(5.0)
    assert torch.equal(first["model"]["w"], torch.ones(3))  # a staged copy, not a view of the live state
    second = saver.stage(payload)
    assert second["model"]["w"] is first["model"]["w"]  # the same host buffer, refilled
    assert torch.equal(second["model"]["w"], torch.full((3,), 2.0))
    assert second["optim"]["state"][0]["step"].item() == 5.0
    assert second["optim"]["param_groups"][0]["lr"] == 0.05
    grown = saver.stage({"model": {"w": torch.ones(4)}})
    assert grown["model"]["w"].shape == (4,)


def _load_with_rank_1_a_generation_behind(rank: int, world_size: int, path: str, patch: bool) -> dict[str, float]:
    """Two saves with ``keep_previous`` (both generations on disk); rank 1 read the commit record before the
    second save switched it (its ``read_record`` answers the first record), rank 0 after."""
    import torch.distributed as dist

    from lightning_mics.checkpoint import loading

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    target = Path(path)
    module = ToyModule(RunConfig())
    records = []
    for step, value in ((1, 1.0), (2, 2.0)):
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.fill_(value)
        ckpt.save(target, {"state_dict": ckpt.model_state_dict(module), "global_step": step}, keep_previous=True)
        records.append(ckpt.read_record(target))
    if patch and rank == 1:
        loading.read_record = lambda where: records[0]
    fresh = ToyModule(RunConfig(seed=5))
    state = ckpt.load(target, fresh)
    values = {value for parameter in fresh.parameters() for value in parameter.detach().flatten().tolist()}
    return {"values": sorted(values), "global_step": state.get("global_step")}


@pytest.mark.distributed
def test_every_rank_loads_rank_0s_generation_when_a_save_switched_it_between_their_reads(tmp_path: Path) -> None:
    """A live fault-tolerant group saves ``last`` while a restarted group's ranks read its record, one before the
    switch and one after: both load rank 0's generation (the second save's weights, 2.0), not each its own."""
    results = run_ranks(_load_with_rank_1_a_generation_behind, 2, str(tmp_path / "last.ckpt"), True, timeout=120)
    assert [r["values"] for r in results] == [[2.0], [2.0]]
    assert [r["global_step"] for r in results] == [2, 2]
