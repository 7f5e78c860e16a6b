"""Real processes: SIGTERM gives a checkpoint and exit 143 (SIGINT: 130), not the 0 of a finished run; SIGKILL at
random moments never loses the run."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perf.checkpoint import checkpoints, read_checkpoint, read_meta, verify
from tests.conftest import TINY, assert_close, final_weights, spawn, start_run, trains, wait_for
from train_mmdit_stable import main

ROOT = Path(__file__).resolve().parents[1]


def start(run_dir: Path, log: Path, *extra: str):
    return start_run([*TINY, f"logging.output_dir={run_dir}", "checkpoint.every=10", "sampling.steps=1", *extra], log)


def test_sigterm_checkpoints_and_exits_143(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(run_dir, log, "training.max_steps=100000")
    assert " loss " in wait_for(proc, log, " loss "), log.read_text()
    proc.terminate()  # SIGTERM
    proc.join(timeout=60)
    out = log.read_text()
    assert proc.exitcode == 143, out
    assert "pre-empted: checkpoint of step" in out and "exit 143 (not finished: the same command resumes)" in out
    last = checkpoints(run_dir)[-1]
    assert verify(last) is None
    _, meta = read_checkpoint(last)
    assert 0 < meta["step"] < 100000 and last.name == f"step_{meta['step']:08d}"


@pytest.mark.full  # the kills at fixed moments (test_checkpoint.py, the family matrix) run in `make test`
def test_sigkill_at_random_moments_never_loses_the_run(tmp_path):
    steps = 100  # ~35 ms each: every kill below lands somewhere in the first 40 steps after a (re)start
    assert main([*TINY, f"logging.output_dir={tmp_path / 'reference'}", "checkpoint.every=10", "sampling.steps=1",
                 f"training.max_steps={steps}"]) == 0

    rng = random.Random(1234)
    run_dir, kills, resumes = tmp_path / "killed", 0, 0
    for attempt in range(6):
        log = tmp_path / f"attempt{attempt}.log"
        proc = start(run_dir, log, f"training.max_steps={steps}")
        if attempt < 2:
            wait_for(proc, log, " loss ")  # a restart after the last step has no step to log
            time.sleep(rng.uniform(0.0, 1.5))
            if proc.is_alive():
                proc.kill()
                kills += 1
        proc.join(timeout=300)
        out = log.read_text()
        if proc.is_alive():  # hung: not left running beside the next attempt
            proc.kill()
            raise AssertionError(f"attempt {attempt} still running after 300 s:\n{out[-3000:]}")
        resumes += "resumed from" in out
        if proc.exitcode == 0:
            break
        for path in checkpoints(run_dir):  # after every kill, every step_ directory is complete and intact
            assert verify(path) is None, path
    assert proc.exitcode == 0, out
    assert kills == 2 and resumes >= 1, f"the test must interrupt training ({kills} kills, {resumes} resumes)"
    assert_close(final_weights(run_dir), final_weights(tmp_path / "reference"))


def train_with_sigterm_to_rank_1(overrides: list[str]) -> dict:
    """main() on one rank of two, rank 1 alone sent SIGTERM as its loop begins: a node a scheduler pre-empts, beside
    one it does not."""
    from runtime.preemption import PreemptionHandler
    install = PreemptionHandler.__init__

    def signalled_on_rank_1(self, *args):
        install(self, *args)
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGTERM)

    PreemptionHandler.__init__ = signalled_on_rank_1  # in this rank's process only
    return {"status": main(overrides)}


def test_every_rank_exits_with_the_signal_one_rank_received(tmp_path):
    """The ranks agree on the signal as they agree on the step: rank 0, never signalled, exits 143 too (under the
    launcher, its node's launcher then does)."""
    run = [*TINY, "training.train_batch_size=4", "training.max_steps=6", f"logging.output_dir={tmp_path}"]
    assert spawn(2, train_with_sigterm_to_rank_1, run, tmp_path=tmp_path) == [{"status": 143}] * 2
    assert read_meta(checkpoints(tmp_path)[-1])["step"] < 6


# The signal comes at the first logged step. A run that must then resume and finish has 23 steps left (~0.1 s
# each, and slower on a busy machine): enough for the signal to arrive first (with 11, the run once finished first).
STEPS = 24
LAUNCHED = [*TINY, "training.train_batch_size=4", "checkpoint.every=1000", "sampling.steps=1"]
# MAX_RESTARTS: a pre-empted worker exits 0 to torchrun, which must not restart it (it would resume and train on)
LAUNCHER_ENV = {**os.environ, "PYTHON": sys.executable, "NPROC_PER_NODE": "2", "PYTHONUNBUFFERED": "1",
                "MAX_RESTARTS": "1"}


def launch(run_dir: Path, steps: int = STEPS) -> list[str]:
    return [str(ROOT / "train_mmdit_stable.sh"), *LAUNCHED, f"training.max_steps={steps}",
            f"logging.output_dir={run_dir}"]


def signal_a_launch(run_dir: Path, send, status: int, steps: int = STEPS) -> str:
    """Two workers under the launcher (in a session of its own, as a terminal runs a command); once they train,
    `send(launcher)`. The launcher must exit with `status` (128 + the signal) after both checkpointed, with no
    traceback; returns its output."""
    import threading
    # with SIGINT as a terminal leaves it: a process started with a signal ignored keeps it ignored, and bash cannot
    # trap it (from a pytest process that ignores SIGINT, the launch trained on, unsignalled)
    proc = subprocess.Popen(launch(run_dir, steps), env=LAUNCHER_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not any(" loss " in line for line in lines) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    send(proc)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()  # the launcher's end takes torchrun and the workers with it (runtime/parent_death.py)
        raise AssertionError(f"the launch did not stop:\n{''.join(lines)[-3000:]}") from None
    reader.join(timeout=10)
    output = "".join(lines)
    assert proc.returncode == status, output[-3000:]
    assert f"pre-empted: all 2 local worker(s) checkpointed; exit {status}" in output, output[-3000:]
    assert "SignalException" not in output and "Traceback" not in output and "resumed" not in output, output[-3000:]
    last = checkpoints(run_dir)[-1]
    assert verify(last) is None and 0 < read_meta(last)["step"] < steps
    return output


def test_sigterm_to_the_launcher_of_two_processes_exits_143_and_resumes_exactly(tmp_path):
    """What a scheduler does to a torchrun job: SIGTERM to the launcher. Both workers checkpoint and exit (0 to
    torchrun, which restarts neither), the launcher exits 143 (not torchrun's SignalException, not the 0 of a
    finished run), and the same command then finishes, exit 0, with the weights of an uninterrupted run."""
    trains(2, [*LAUNCHED, f"training.max_steps={STEPS}", f"logging.output_dir={tmp_path / 'straight'}"],
           tmp_path)  # the same math, quicker
    signal_a_launch(tmp_path / "run", lambda proc: proc.send_signal(signal.SIGTERM), 143)
    last = checkpoints(tmp_path / "run")[-1]
    again = subprocess.run(launch(tmp_path / "run"), env=LAUNCHER_ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and f"resumed from {last}" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert_close(final_weights(tmp_path / "run"), final_weights(tmp_path / "straight"))


def test_ctrl_c_under_the_launcher_of_two_processes_exits_130_without_a_traceback(tmp_path):
    """What a terminal does on Ctrl-C: SIGINT to every process of the foreground group (the launcher, torchrun and
    the workers, unless torchrun is in a group of its own). torchrun answered it with SignalException, exit 1."""
    output = signal_a_launch(tmp_path / "run", lambda proc: os.killpg(proc.pid, signal.SIGINT), 130, steps=100000)
    assert "received SIGINT" in output
