"""The checkpointer alone: publishing, verification and what a resume does with damaged checkpoints, staging
that training cannot disturb, back-pressure, failures that leave the last checkpoint intact, and where the
staged copy lives."""

import json
import logging
import os
import re
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_saver as dcp_saver

from errors import ConfigError, InputError
from perf.checkpoint import (Checkpointer, CheckpointWriteError, checkpoints, prune_checkpoints,
                             read_checkpoint, read_meta, remove_leftovers, verify)
from tests.conftest import RunsCode, assert_close, checkpoint_disk_full, reseal

SHARD = "__0_0.distcp"  # the tensors one writer wrote


class Weights:
    """A part of the training state: a dict of live tensors, loaded in place."""

    def __init__(self, value: float = 0.0, size: int = 4):
        self.tensors = {"w": torch.full((size,), value), "b": torch.arange(3.0) + value}

    def state_dict(self):
        return self.tensors

    def load_state_dict(self, state):
        for key, tensor in state.items():
            self.tensors[key].copy_(tensor)


class Counter:
    """A part without tensors (like the batch sizer's state)."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def checkpointer(run_dir, states=None, every=1, keep_last=5, async_save=False, fail_on_error=True):
    cfg = SimpleNamespace(every=every, keep_last=keep_last, async_save=async_save, fail_on_error=fail_on_error)
    states = states if states is not None else {"model": Weights(), "loop": Counter()}
    return Checkpointer(run_dir, cfg, states, {"kind": "test"}, {"config.yaml": "a: 1\n"}, torch.device("cpu"))


def write(run_dir, *steps):
    weights = Weights()
    ckpt = checkpointer(run_dir, {"model": weights})
    for step in steps:
        weights.tensors["w"].fill_(float(step))
        ckpt.save(step)
    ckpt.close()


def test_round_trip_manifest_and_cadence(tmp_path):
    weights, counter = Weights(), Counter()
    ckpt = checkpointer(tmp_path, {"model": weights, "loop": counter}, every=2)
    for step in (1, 2, 3):
        counter.count = step
        weights.tensors["w"].fill_(float(step))
        ckpt.save(step)  # only step 2 is due
    ckpt.save(3, last=True)
    ckpt.close()
    assert [p.name for p in checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    path = checkpoints(tmp_path)[-1]
    assert verify(path) is None and not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert sorted(json.loads((path / "manifest.json").read_text())["files"]) == sorted(
        [".metadata", SHARD, "state.json", "config.yaml"])
    tensors, meta = read_checkpoint(path, ("model",))
    assert_close(tensors["model"], {"w": torch.full((4,), 3.0), "b": torch.arange(3.0)})
    assert meta == {"kind": "test", "step": 3, "format": 2}
    fresh_weights, fresh_counter = Weights(), Counter()
    assert checkpointer(tmp_path, {"model": fresh_weights, "loop": fresh_counter}).resume() == 3
    assert_close(fresh_weights.tensors, weights.tensors) and fresh_counter.count == 3


def damage(root):
    (root / "step_00000004" / "manifest.json").unlink()  # interrupted before the manifest
    data = root / "step_00000003" / SHARD
    blob = bytearray(data.read_bytes())
    blob[-1] ^= 0xFF
    data.write_bytes(bytes(blob))  # flipped byte
    with open(root / "step_00000002" / SHARD, "r+b") as f:
        f.truncate(10)  # truncated


def test_damaged_checkpoints_are_named_and_set_aside_never_deleted(tmp_path, caplog):
    write(tmp_path, 1, 2, 3, 4)
    root = tmp_path / "checkpoints"
    damage(root)
    (root / ".tmp-step_00000005").mkdir()  # a write in progress when the process was killed
    assert "manifest" in verify(root / "step_00000004")
    assert "checksum" in verify(root / "step_00000003")
    assert "bytes" in verify(root / "step_00000002")
    weights = Weights()
    ckpt = checkpointer(tmp_path, {"model": weights}, keep_last=1)
    assert ckpt.resume() == 1 and weights.tensors["w"][0] == 1
    assert [p.name for p in checkpoints(tmp_path)] == ["step_00000001"]
    aside = sorted(p.name.split("-")[0] for p in (root / "damaged").iterdir())
    assert aside == ["step_00000002", "step_00000003", "step_00000004"]
    assert "step_00000004 is damaged (no manifest" in caplog.text and not (root / ".tmp-step_00000005").exists()
    for step in (2, 3, 4, 5):  # the run redoes those steps; keep-last prunes its own checkpoints, not these
        ckpt.save(step)
    ckpt.close()
    assert [p.name for p in checkpoints(tmp_path)] == ["step_00000005"]
    assert len(list((root / "damaged").iterdir())) == 3


def test_a_run_whose_checkpoints_are_all_damaged_refuses_to_start_and_changes_nothing(tmp_path):
    write(tmp_path, 2, 3, 4)
    root = tmp_path / "checkpoints"
    damage(root)
    before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}
    with pytest.raises(ConfigError) as error:
        checkpointer(tmp_path).resume()
    message = str(error.value)
    for name, problem in [("step_00000004", "no manifest"), ("step_00000003", "checksum mismatch"),
                          ("step_00000002", "bytes")]:
        assert re.search(rf"{name}: [^;]*{problem}", message), (name, message)
    assert "nothing was changed" in message
    assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")} == before


def test_a_malformed_manifest_is_a_reason_not_a_crash(tmp_path):
    write(tmp_path, 1)
    path = checkpoints(tmp_path)[0]
    (path / "manifest.json").write_text('{"files": [1, 2]}')
    assert "unreadable manifest" in verify(path)


def test_resaving_an_intact_step_leaves_it_untouched(tmp_path):
    write(tmp_path, 2)
    path = checkpoints(tmp_path)[0]
    before = os.stat(path / SHARD).st_mtime_ns
    ckpt = checkpointer(tmp_path)
    ckpt.save(2, last=True)
    ckpt.close()
    assert os.stat(path / SHARD).st_mtime_ns == before and ckpt.last_complete == path


def test_prune_keeps_the_newest_and_leftovers_are_cleaned(tmp_path):
    write(tmp_path, 1, 2, 3)
    prune_checkpoints(tmp_path, keep_last=2, newest=3)
    assert [p.name for p in checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_00000004").mkdir()  # a killed writer's leftovers
    (root / ".trash-step_00000001").mkdir()
    remove_leftovers(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]


class Companion:
    """Files made from each complete checkpoint (a LoRA run's LoRA files): says where each was made."""

    def __init__(self, run_dir):
        self.folder, self.made = run_dir / "made", []

    def write(self, path):
        assert verify(path) is None  # complete
        self.made.append((path.name, threading.current_thread().name, torch.get_num_threads()))
        self.folder.mkdir(exist_ok=True)
        (self.folder / path.name).write_text("made")

    def ensure(self, path):
        if not (self.folder / path.name).exists():
            self.write(path)

    def remove(self, step):
        (self.folder / f"step_{step:08d}").unlink()


def test_a_companion_is_made_from_each_complete_checkpoint_off_the_training_thread_and_pruned_with_it(tmp_path,
                                                                                                   caplog):
    """Made in the writer thread on one torch thread (as the stager's copies: tests below), deleted with its
    checkpoint, made again for the checkpoint a run resumes from if it is missing; one that fails leaves its
    checkpoint complete, and is said."""
    suite_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        companion = Companion(tmp_path)
        cfg = SimpleNamespace(every=1, keep_last=2, async_save=True, fail_on_error=True)
        ckpt = Checkpointer(tmp_path, cfg, {"model": Weights()}, {}, {}, torch.device("cpu"), companion=companion)
        for step in (1, 2, 3):
            ckpt.save(step)
        ckpt.close()
    finally:
        torch.set_num_threads(suite_threads)
    assert [(name, thread.split("_")[0], threads) for name, thread, threads in companion.made] == \
        [(f"step_0000000{step}", "checkpoint", 1) for step in (1, 2, 3)]
    assert sorted(p.name for p in companion.folder.iterdir()) == ["step_00000002", "step_00000003"]
    (companion.folder / "step_00000003").unlink()  # killed between the checkpoint and its companion
    ckpt = Checkpointer(tmp_path, cfg, {"model": Weights()}, {}, {}, torch.device("cpu"), companion=companion)
    assert ckpt.resume() == 3 and (companion.folder / "step_00000003").is_file()

    def fail(path):
        raise RuntimeError("a bug")
    companion.write = fail
    ckpt.save(4)
    ckpt.close()
    assert ckpt.last_error is None and verify(checkpoints(tmp_path)[-1]) is None
    assert f"the files made from {checkpoints(tmp_path)[-1]} were not written (the checkpoint is complete)" in caplog.text


def test_resume_checks_every_part_and_a_missing_part_starts_fresh(tmp_path, caplog):
    write(tmp_path, 1)
    with pytest.raises(ConfigError, match=r"other model state than this run: missing \['x'\], unexpected \['b'\]"):
        weights = Weights()
        weights.tensors = {"w": weights.tensors["w"], "x": torch.zeros(2)}
        checkpointer(tmp_path, {"model": weights}).resume()
    counter = Counter()
    counter.count = 7
    assert checkpointer(tmp_path, {"model": Weights(), "loop": counter}).resume() == 1
    assert "holds no loop state: it starts fresh" in caplog.text and counter.count == 7


def test_a_value_that_is_not_plain_data_is_refused_unread(tmp_path):
    """DCP unpickles a state's non-tensor values with torch.load(weights_only=False): one that would run code
    (here, create a marker file) is refused on resume, naming the checkpoint and the value, and nothing runs."""
    marker = tmp_path / "ran"
    write(tmp_path / "run", 1)
    path = checkpoints(tmp_path / "run")[0]
    crafted = {"model": Weights().tensors, "loop": {"count": RunsCode(marker)}}  # written as DCP writes a counter
    (path / ".metadata").unlink()  # rewritten below (DCP warns before overwriting one)
    dcp.save(crafted, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    reseal(path)
    with pytest.raises(InputError, match=rf"^{re.escape(str(path))}: the value of loop\.count is not plain data; "
                                         r"refused unread: unpickling it could run code"):
        checkpointer(tmp_path / "run", {"model": Weights(), "loop": Counter()}).resume()
    assert not marker.exists()


def test_a_checkpoint_of_an_earlier_format_is_named(tmp_path):
    write(tmp_path, 1)
    path = checkpoints(tmp_path)[0]
    (path / "state.json").write_text(json.dumps({"step": 1}))
    with pytest.raises(InputError, match=r"earlier version of this trainer \(format 1; this version reads"):
        read_meta(path)


# ------------------------------------------------------------------------------------------- staging


def test_the_snapshot_cannot_observe_a_later_optimizer_step(tmp_path, monkeypatch):
    """The copy to host memory runs in the background (slowed down here) and the write after it; the optimizer
    step that follows the save waits for the copy (the pre-hook the training loop registers), so the checkpoint
    holds the weights of the step it names."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    release, real_save, real_stage = threading.Event(), dcp_saver.save, StateDictStager.stage

    def slow_stage(self, *args, **kwargs):
        threading.Event().wait(0.3)
        return real_stage(self, *args, **kwargs)

    def held_save(*args, **kwargs):  # the background write starts only after the weights changed
        release.wait(timeout=30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(StateDictStager, "stage", slow_stage)
    monkeypatch.setattr(dcp_saver, "save", held_save)
    model = torch.nn.Linear(8, 8)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = checkpointer(tmp_path, {"model": model}, async_save=True)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    opt.register_step_pre_hook(ckpt.wait_for_staging)
    ckpt.save(1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # changes the live tensors while the write waits
    assert not torch.equal(model.weight, at_save["weight"])
    release.set()
    ckpt.close()
    assert_close(read_checkpoint(checkpoints(tmp_path)[-1], ("model",))[0]["model"], at_save)


def test_the_staging_thread_leaves_the_training_threads_openmp_team_alone(tmp_path):
    """The stager's copy thread runs torch on one thread (a second OpenMP team alive beside the training
    thread's made libgomp stop spinning: the default run trained 35 % slower after its first save); the
    training thread, and threads started later, keep their count."""
    suite_threads, threads = torch.get_num_threads(), 2  # the suite runs on one (tests/conftest.py)
    torch.set_num_threads(threads)
    try:
        ckpt = checkpointer(tmp_path, {"model": torch.nn.Linear(64, 64)}, async_save=True)
        ckpt.save(1)
        ckpt.wait()
        assert ckpt.stager._staging_executor.submit(torch.get_num_threads).result() == 1
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert torch.get_num_threads() == threads and later == [threads]
        ckpt.close()
    finally:
        torch.set_num_threads(suite_threads)


def test_a_save_waits_for_the_one_in_flight(tmp_path, monkeypatch, caplog):
    real_publish, started = Checkpointer.publish, []

    def slow_publish(self, step, *args):
        started.append(step)
        threading.Event().wait(0.5)
        return real_publish(self, step, *args)

    monkeypatch.setattr(Checkpointer, "publish", slow_publish)
    caplog.set_level(logging.INFO, logger="mmdit")
    ckpt = checkpointer(tmp_path, async_save=True)
    ckpt.save(1)
    first_stall = ckpt.last_stall_s
    ckpt.save(2)
    assert "save of step 2 waits for step 1 still being written" in caplog.text  # back-pressure, no queue
    assert first_stall < ckpt.last_stall_s  # the first save returned before its write; the second waited for it
    ckpt.close()
    assert started == [1, 2] and [p.name for p in checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_write_is_reported_and_the_previous_checkpoint_stays(tmp_path, monkeypatch, caplog, async_save):
    ckpt = checkpointer(tmp_path, keep_last=1, async_save=async_save, fail_on_error=False)
    ckpt.save(1)
    ckpt.wait()
    checkpoint_disk_full(monkeypatch)
    ckpt.save(2)
    ckpt.wait()
    assert (f"checkpoint of step 2 into {tmp_path / 'checkpoints'} failed: rank 0: OSError: [Errno 28] No space left "
            f"on device") in caplog.text
    assert "the last complete checkpoint is" in caplog.text and "step_00000001" in caplog.text
    assert ckpt.last_error is not None
    assert [p.name for p in checkpoints(tmp_path)] == ["step_00000001"]  # not pruned, still intact
    assert verify(checkpoints(tmp_path)[0]) is None and not list((tmp_path / "checkpoints").glob(".tmp-*"))
    monkeypatch.undo()
    ckpt.save(2)  # a retry of the failed step is not skipped
    ckpt.wait()
    assert ckpt.last_error is None and [p.name for p in checkpoints(tmp_path)] == ["step_00000002"]
    ckpt.close()


def test_an_unwritable_directory_is_fatal_when_asked(tmp_path):
    (tmp_path / "checkpoints").write_text("a file where the checkpoint directory should be")
    with pytest.raises(CheckpointWriteError, match="checkpoints"):
        checkpointer(tmp_path, fail_on_error=True).save(1)


def test_staging_copies_sharded_state_to_host_memory_without_touching_the_mesh_device(tmp_path, monkeypatch):
    """An FSDP shard on a CUDA mesh: its staged copy must stay in host memory. (The hand-written staging this
    replaced wrapped the host copy with `DTensor.from_local`, which moves it to the mesh's device: a second
    device copy of the state during every write. On this CUDA-less machine that attempt raises.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from tests.conftest import free_port
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
        local = torch.arange(12.0).view(6, 2)
        spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(local.shape, local.stride(), local.dtype))
        shard = DTensor(local, spec, requires_grad=False)
        with pytest.raises((AssertionError, RuntimeError)):  # the mechanism: from_local goes to the mesh device
            DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False)
        weights = Weights()
        weights.tensors = {"w": shard}
        ckpt = checkpointer(tmp_path / "run", {"model": weights})
        ckpt.save(1)
        ckpt.close()
        assert ckpt.staging_bytes == local.untyped_storage().nbytes() == 48  # exactly the shard's bytes
        assert ckpt.last_error is None
    finally:
        dist.destroy_process_group()
    assert_close(read_checkpoint(checkpoints(tmp_path / "run")[-1], ("model",))[0]["model"], {"w": local})
