import errno
import logging
import os
import threading

import pytest
import torch

import perf.checkpoint as ckpt
from perf.checkpoint import (Checkpointer, CheckpointWriteError, checkpoints, latest_valid_checkpoint,
                                          prune_checkpoints, read_checkpoint, remove_leftovers, verify,
                                          write_checkpoint)

SHARD = "__0_0.distcp"  # the tensors one writer wrote


def write(run_dir, step):
    return write_checkpoint(run_dir, step, {"model": {"w": torch.full((4,), float(step))}}, {"step": step})


def test_round_trip_and_manifest(tmp_path):
    path = write(tmp_path, 3)
    assert path.name == "step_00000003" and verify(path) is None
    tensors, meta = read_checkpoint(path)
    assert torch.equal(tensors["model"]["w"], torch.full((4,), 3.0)) and meta == {"step": 3}
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_corrupt_truncated_and_partial_checkpoints_are_skipped(tmp_path):
    for step in (1, 2, 3, 4):
        write(tmp_path, step)
    root = tmp_path / "checkpoints"
    (root / "step_00000004" / "manifest.json").unlink()  # interrupted before the manifest
    data = root / "step_00000003" / SHARD
    blob = bytearray(data.read_bytes())
    blob[-1] ^= 0xFF
    data.write_bytes(bytes(blob))  # flipped byte
    with open(root / "step_00000002" / SHARD, "r+b") as f:
        f.truncate(10)  # truncated
    (root / ".tmp-step_00000005").mkdir()  # a write in progress
    assert "manifest" in verify(root / "step_00000004")
    assert "checksum" in verify(root / "step_00000003")
    assert "bytes" in verify(root / "step_00000002")
    assert latest_valid_checkpoint(tmp_path) == root / "step_00000001"


def test_a_malformed_manifest_is_a_reason_not_a_crash(tmp_path):
    path = write(tmp_path, 1)
    (path / "manifest.json").write_text('{"files": [1, 2]}')
    assert "unreadable manifest" in verify(path)
    assert latest_valid_checkpoint(tmp_path) is None


def test_pruning_never_counts_invalid_later_steps(tmp_path):
    """A corrupt step_4 left by an earlier attempt must not push the just-written step_3 out."""
    for step in (1, 4):
        write(tmp_path, step)
    (tmp_path / "checkpoints" / "step_00000004" / "manifest.json").unlink()
    checkpointer = Checkpointer(tmp_path, keep_last=1, async_save=False, fail_on_error=True)
    assert checkpointer.last_complete.name == "step_00000001"
    checkpointer.save(3, {"model": {"w": torch.zeros(2)}}, {"step": 3}, {})
    checkpointer.close()
    assert [p.name for p in checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert latest_valid_checkpoint(tmp_path).name == "step_00000003"


def test_resave_of_a_valid_step_leaves_it_untouched(tmp_path):
    path = write(tmp_path, 2)
    before = os.stat(path / SHARD).st_mtime_ns
    write_checkpoint(tmp_path, 2, {"model": {"w": torch.zeros(4)}}, {"step": 2})
    assert os.stat(path / SHARD).st_mtime_ns == before


def test_prune_keeps_the_newest_and_leftovers_are_cleaned(tmp_path):
    for step in (1, 2, 3):
        write(tmp_path, step)
    prune_checkpoints(tmp_path, keep_last=2, newest=3)
    assert [p.name for p in checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_00000004").mkdir()  # a killed writer's leftovers
    (root / ".trash-step_00000001").mkdir()
    remove_leftovers(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]


# ------------------------------------------------------------------------------------------- async writer


def state_of(model):
    return {"model": model.state_dict()}


def test_snapshot_cannot_observe_a_later_optimizer_step(tmp_path, monkeypatch):
    release = threading.Event()
    real_write = ckpt.write_checkpoint

    def slow_write(*args, **kwargs):
        release.wait(timeout=30)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_checkpoint", slow_write)
    model = torch.nn.Linear(8, 8)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointer = Checkpointer(tmp_path, keep_last=2, async_save=True, fail_on_error=True)
    checkpointer.save(1, state_of(model), {"step": 1}, {})
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # changes the live tensors while the write has not even started
    assert not torch.equal(model.weight, at_save["weight"])
    release.set()
    checkpointer.close()
    tensors, _ = read_checkpoint(checkpointer.last_complete)
    assert all(torch.equal(tensors["model"][k], at_save[k]) for k in at_save)


def test_a_save_waits_for_the_one_in_flight(tmp_path, monkeypatch, caplog):
    real_write = ckpt.write_checkpoint
    started = []

    def slow_write(run_dir, step, *args, **kwargs):
        started.append(step)
        threading.Event().wait(0.5)
        return real_write(run_dir, step, *args, **kwargs)

    monkeypatch.setattr(ckpt, "write_checkpoint", slow_write)
    caplog.set_level(logging.INFO, logger="mmdit")
    model = torch.nn.Linear(4, 4)
    checkpointer = Checkpointer(tmp_path, keep_last=5, async_save=True, fail_on_error=True)
    checkpointer.save(1, state_of(model), {"step": 1}, {})
    assert checkpointer.last_stall_s < 0.4  # the training thread did not wait for the write
    checkpointer.save(2, state_of(model), {"step": 2}, {})
    assert checkpointer.last_stall_s >= 0.3  # back-pressure: waited for step 1 instead of skipping or queueing
    assert "waits for step 1" in caplog.text
    checkpointer.close()
    assert started == [1, 2] and [p.name for p in checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]


@pytest.mark.parametrize("async_save", [True, False])
def test_failed_write_is_reported_and_the_previous_checkpoint_stays(tmp_path, monkeypatch, caplog, async_save):
    model = torch.nn.Linear(4, 4)
    checkpointer = Checkpointer(tmp_path, keep_last=1, async_save=async_save, fail_on_error=False)
    checkpointer.save(1, state_of(model), {"step": 1}, {})
    checkpointer.wait()

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.dcp, "save", disk_full)
    checkpointer.save(2, state_of(model), {"step": 2}, {})
    checkpointer.wait()
    assert "step 2" in caplog.text and "No space left on device" in caplog.text and "step_00000001" in caplog.text
    assert checkpointer.last_error is not None
    assert [p.name for p in checkpoints(tmp_path)] == ["step_00000001"]  # not pruned, still valid
    assert verify(checkpoints(tmp_path)[0]) is None
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    monkeypatch.undo()
    checkpointer.save(2, state_of(model), {"step": 2}, {})  # a retry of the failed step is not skipped
    checkpointer.wait()
    assert checkpointer.last_error is None and [p.name for p in checkpoints(tmp_path)] == ["step_00000002"]
    checkpointer.save(3, state_of(model), {"step": 3}, {})
    checkpointer.close()
    assert checkpointer.last_error is None and [p.name for p in checkpoints(tmp_path)] == ["step_00000003"]


def test_unwritable_directory_is_fatal_when_asked(tmp_path):
    (tmp_path / "checkpoints").write_text("a file where the checkpoint directory should be")
    checkpointer = Checkpointer(tmp_path, keep_last=1, async_save=True, fail_on_error=True)
    checkpointer.save(1, state_of(torch.nn.Linear(2, 2)), {"step": 1}, {})
    with pytest.raises(CheckpointWriteError, match="checkpoints"):
        checkpointer.close()
