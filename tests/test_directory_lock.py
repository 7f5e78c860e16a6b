"""One job per run or output directory (runtime/directory_lock.py): a second start into a directory in use exits 2
naming its holder and changes nothing; a dead holder never blocks (a start after a SIGKILL resumes:
tests/test_orphans.py)."""

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import precompute_latents
from errors import InputError
from runtime.directory_lock import LOCK_FILE, lock_directory
from tests.conftest import T5_TOKENS, assert_close, final_weights, image_folder, losses, spawn, train
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
