"""One job per run or output directory (runtime/directory_lock.py): a second start into a directory in use exits 2
naming its holder and changes nothing; a dead holder never blocks (a start after a SIGKILL resumes:
tests/test_orphans.py)."""

import errno
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import precompute_latents
from configs.run_dir import prepare_run_dir
from configs.schema import load_config
from data.precompute.inputs import PrecomputeError
from data.precompute.job import start_output_directory
from errors import ConfigError, InputError
from runtime.directory_lock import LOCK_FILE, lock_directory, writable_directory
from tests.conftest import (SYSFS_NEW, T5_TOKENS, assert_close, final_weights, image_folder, losses, needs_sysfs,
                            spawn, train)
from train_mmdit_stable import main

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
LOCK = ("import os, sys, time; from pathlib import Path; from runtime.directory_lock import lock_directory; "
        "lock = lock_directory(Path(sys.argv[1]), 'x')")  # python -c LOCK DIRECTORY


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def holding(directory: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until `proc` holds the lock on `directory`, then stop it there (SIGSTOP): it holds the lock, writes
    nothing, and cannot end, until SIGCONT."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads((directory / LOCK_FILE).read_text())["pid"] == proc.pid:
                proc.send_signal(signal.SIGSTOP)
                assert (directory / LOCK_FILE).is_file(), "the holder ended before it could be stopped"
                return
        except (FileNotFoundError, ValueError):  # not yet locked, or the holder is writing its name
            pass
        time.sleep(0.01)
    raise AssertionError(f"the holder never locked {directory} (exit {proc.poll()})")


def test_a_second_training_into_a_busy_run_directory_exits_2_and_changes_nothing(tiny, tmp_path, caplog):
    """The first training holds its run directory; a second start (one process, and two ranks) is refused with
    the holder named, before it writes anything; the first then ends with the weights of an undisturbed run."""
    run_dir, overrides = tmp_path / "run", tiny("training.max_steps=6", "checkpoint.every=3")
    assert main(tiny("training.max_steps=6", "checkpoint.every=3", run="straight")) == 0
    first = subprocess.Popen([sys.executable, "train_mmdit_stable.py", *overrides], cwd=ROOT, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        holding(run_dir, first)
        before = files(run_dir)
        assert main(overrides) == 2
        assert f"logging.output_dir={run_dir} is in use by pid {first.pid} on " in caplog.text
        assert "train_mmdit_stable.py" in caplog.text and "nothing was changed" in caplog.text
        two_ranks = [o.replace("training.train_batch_size=8", "training.train_batch_size=4") for o in overrides]
        assert spawn(2, train, two_ranks, tmp_path=tmp_path) == [{"status": 2}] * 2  # the same global batch
        assert files(run_dir) == before
    finally:
        first.send_signal(signal.SIGCONT)
        out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out[-3000:]
    assert_close(final_weights(run_dir), final_weights(tmp_path / "straight"))
    assert losses(run_dir) == losses(tmp_path / "straight")
    assert not (run_dir / LOCK_FILE).exists()  # there only while held


def test_a_precompute_into_a_busy_output_directory_exits_2_and_changes_nothing(sd3_dir, tmp_path, caplog):
    images = image_folder(tmp_path / "images", [(16, 16), (20, 18)])
    args = ["--model", str(sd3_dir), "--images", str(images), "--resolution", "16", "--batch-size", "2",
            "--shard-size", "2", "--dtype", "fp32", "--max-sequence-length", str(T5_TOKENS)]
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "precompute_latents.py", *args, "--out", str(out)], cwd=ROOT, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        holding(out, first)
        before = files(out)
        assert precompute_latents.main([*args, "--out", str(out)]) == 2
        assert f"--out {out} is in use by pid {first.pid} on " in caplog.text
        assert files(out) == before
    finally:
        first.send_signal(signal.SIGCONT)
        output, _ = first.communicate(timeout=120)
    assert first.returncode == 0, output[-3000:]
    assert precompute_latents.main([*args, "--out", str(tmp_path / "straight")]) == 0
    assert files(out) == files(tmp_path / "straight")  # no .lock left, and the dataset of an undisturbed run


def test_the_lock_is_the_holders_alone(tmp_path):
    """A second lock in the holder's own process is refused (the kernel would grant it, and the second descriptor's
    close would drop the first lock); a process the holder forked (a data loader worker) does not hold the lock
    once the holder is dead. The directory a lock created is removed on release when nothing else was written."""
    directory = tmp_path / "new" / "run"
    with lock_directory(directory, "run"):
        with pytest.raises(InputError, match=rf"run is in use by this process \(pid {os.getpid()}\)"):
            lock_directory(directory, "run")
        refused = subprocess.run([sys.executable, "-c", LOCK, str(directory)], cwd=ROOT, capture_output=True,
                                 text=True, timeout=60)
        assert f"x is in use by pid {os.getpid()}" in refused.stderr  # still held after the refused second lock
    assert not (tmp_path / "new").exists()

    fork = "; child = os.fork(); time.sleep(60 if child == 0 else 0.2); print(child, flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", LOCK + fork, str(directory)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    child = int(holder.stdout.readline())
    holder.kill()
    holder.wait()
    try:
        os.kill(child, 0)  # the forked child lives on
        with lock_directory(directory, "run"):
            pass
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_filesystem_without_locks_warns_and_trains(tiny, tmp_path, caplog, monkeypatch):
    """Lustre without -o flock, NFS without a lock daemon: the run goes on, said to be unprotected."""
    def no_locks(*args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(fcntl, "lockf", no_locks)
    assert main(tiny("training.max_steps=1")) == 0
    assert "cannot be locked on this filesystem (No locks available)" in caplog.text
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def full_tmpfs(tmpfs) -> Path:
    full = tmpfs("full", "size=4k")
    (full / "fill").write_bytes(bytes(4096))
    return full


UNWRITABLE = {  # how a directory cannot be written: (directory, the refusal after the label)
    "read-only filesystem": lambda tmp_path, tmpfs: (
        tmpfs("ro", "ro"), f"cannot create or write into {tmp_path / 'ro'}: Read-only file system"),
    "new folders on a read-only filesystem": lambda tmp_path, tmpfs: (
        tmpfs("ro", "ro") / "new" / "run",
        f"cannot create or write into {tmp_path / 'ro/new/run'} (at {tmp_path / 'ro/new'}): Read-only file system"),
    "no space left": lambda tmp_path, tmpfs: (
        full_tmpfs(tmpfs) / "run", f"cannot create or write into {tmp_path / 'full/run'}: No space left on device"),
    "sysfs, new folders": pytest.param(lambda tmp_path, tmpfs: (
        SYSFS_NEW / "run", f"cannot create or write into {SYSFS_NEW / 'run'} (at {SYSFS_NEW}): Operation not permitted"),
        marks=needs_sysfs),
    "sysfs, a folder": pytest.param(lambda tmp_path, tmpfs: (
        Path("/sys/kernel"), "cannot create or write into /sys/kernel: Permission denied"), marks=needs_sysfs),
    "a file in the path": lambda tmp_path, tmpfs: (
        tmp_path / "notes.txt" / "run", f"{tmp_path / 'notes.txt'} is a file, not a directory"),
}


@pytest.mark.parametrize("case", UNWRITABLE.values(), ids=UNWRITABLE.keys())
def test_a_directory_that_cannot_be_written_is_refused_with_the_reason_and_left_as_it_was(tmp_path, tmpfs, case):
    """Root ignores permission bits, so the lock (a job's output directory) and `writable_directory` (the folders it
    writes into, the output of sample and export) find out by writing; either names the directory and the reason
    in one line and leaves nothing behind."""
    (tmp_path / "notes.txt").write_text("keep me")
    directory, refusal = case(tmp_path, tmpfs)
    before = {path: path.stat().st_size for path in tmp_path.rglob("*")}
    for check in (lock_directory, writable_directory):
        with pytest.raises(InputError) as info:
            check(directory, "--out x")
        assert str(info.value) == f"--out x: {refusal}"
        assert {path: path.stat().st_size for path in tmp_path.rglob("*")} == before


def test_training_and_precompute_refuse_an_output_they_cannot_write_in_one_line(tiny, tmp_path, tmpfs, caplog):
    """Training into a full disk (the lock's write fails: it was a traceback), a run directory on a read-only
    mount (prepare_run_dir), a precompute whose reports folder is read-only (its units would have failed at their
    end): each is the user's directory, refused in one line before anything is computed."""
    full = full_tmpfs(tmpfs)
    assert main(tiny(run="full/run")) == 2
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        f"config error: logging.output_dir={full / 'run'}: cannot create or write into {full / 'run'}: No space left "
        f"on device"]
    assert sorted(full.iterdir()) == [full / "fill"]

    run_dir = tmpfs("ro", "ro")  # a run directory copied to a read-only mount, say: the lock would refuse it too
    with pytest.raises(ConfigError) as info:
        prepare_run_dir(load_config(overrides=tiny(run="ro")), world_size=1)
    assert str(info.value) == f"logging.output_dir={run_dir}: cannot create or write into {run_dir}: Read-only file system"

    out = tmp_path / "out"
    reports = tmpfs("out/reports", "ro")
    with pytest.raises(PrecomputeError) as info:
        start_output_directory(out, {"resolution": 16})
    assert str(info.value) == f"--out {out}: cannot create or write into {reports}: Read-only file system"
