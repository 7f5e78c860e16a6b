"""No orphans (runtime/parent_death.py): a launcher killed by SIGKILL, which it cannot pass on, takes torchrun and
every worker with it; the run directory's lock goes with them, so the same run resumes."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from runtime.directory_lock import LOCK_FILE
from tests.conftest import TINY, free_port
from train_mmdit_stable import main

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 15  # torch's data loader workers look for their parent every 5 s; everything else ends at once
LAUNCHED = [*TINY, "training.max_steps=100000", "checkpoint.every=2"]


def stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state, parent, ...); None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2:].split()


def alive(process: tuple[int, str]) -> bool:
    """Whether (pid, start time) still runs: a process killed but not yet reaped by its new parent is a zombie
    ("Z"), dead, once its last thread has ended (its main thread shows "Z" while others still exit, holding its
    open files and so its locks); a new process that reuses the pid has another start time."""
    fields = stat(process[0])
    if fields is None or fields[19] != process[1]:
        return False
    return fields[0] != "Z" or int(fields[17]) > 1  # fields[17]: the number of threads


def command(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:3]
    except FileNotFoundError:
        return []


class Launch:
    """train_mmdit_stable.sh in a session of its own (as a terminal starts a command), its output read aside."""

    def __init__(self, overrides: list[str], **env: str):
        env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1", **env}
        self.proc = subprocess.Popen([str(ROOT / "train_mmdit_stable.sh"), *overrides], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()

    def wait_for(self, marker: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(marker in line for line in self.lines):
            assert time.monotonic() < deadline and self.proc.poll() is None, "".join(self.lines)[-3000:]
            time.sleep(0.05)

    def processes(self) -> list[tuple[int, str]]:
        """The launcher and everything it started (torchrun, the workers, their data loader workers), each as
        (pid, start time)."""
        fields = {int(p.name): stat(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append((pid, fields[pid][19]))
            todo += [child for child, f in fields.items() if f is not None and int(f[1]) == pid]
        return found


def kill_launcher_and_wait(launches: list[Launch], expected: int) -> None:
    """SIGKILL the first launcher; no process of any launch may be left after DEADLINE_S."""
    processes = [p for launch in launches for p in launch.processes()]
    assert len(processes) == expected, [command(pid) for pid, _ in processes]
    launches[0].proc.kill()
    deadline = time.monotonic() + DEADLINE_S
    while any(alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [(p[0], command(p[0])) for p in processes if alive(p)]
    for pid, _ in left:  # the test leaves nothing running, whatever it found
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running {DEADLINE_S}s after the launcher was killed: {left}"


def test_sigkill_of_the_launcher_of_two_processes_leaves_no_process_and_the_run_resumes(tmp_path, caplog):
    """torchrun runs in a session of its own and each worker in one of its own: before the parent-death signals,
    all three trained on, orphaned. A start into the same run directory then resumes: the lock died with rank 0."""
    run_dir = tmp_path / "run"
    launch = Launch([*LAUNCHED, "training.train_batch_size=4", f"logging.output_dir={run_dir}"], NPROC_PER_NODE="2")
    launch.wait_for("step_00000002 complete")  # a checkpoint to resume from
    kill_launcher_and_wait([launch], expected=4)  # the launcher, torchrun, two workers
    assert (run_dir / LOCK_FILE).is_file()  # left by the killed rank 0: harmless
    caplog.set_level(logging.INFO, logger="mmdit")
    assert main([*TINY, "training.max_steps=20", f"logging.output_dir={run_dir}"]) == 0  # 8 x 1 = 4 x 2 per step
    assert "resumed from" in caplog.text and not (run_dir / LOCK_FILE).exists()


def test_sigkill_of_the_launcher_of_one_process_leaves_no_process(tmp_path):
    """One process: the launcher execs the trainer, so the kill ends it, and its data loader worker follows."""
    launch = Launch([*LAUNCHED, "data.num_workers=1", f"logging.output_dir={tmp_path}"])
    launch.wait_for(" loss ")
    kill_launcher_and_wait([launch], expected=2)  # the trainer (the launcher, exec'd) and its loader worker


def test_sigkill_of_one_nodes_launcher_ends_every_node(tmp_path):
    """Two launcher nodes of one process each: node 0's launcher is killed; its torchrun and worker die with it, and
    node 1's worker fails at its next collective with rank 0 (gloo: the connection is closed), ending node 1."""
    port = str(free_port())
    nodes = [Launch([*LAUNCHED, "training.train_batch_size=4", f"logging.output_dir={tmp_path}"], NNODES="2",
                    NODE_RANK=str(rank), NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
             for rank in (0, 1)]
    nodes[0].wait_for(" loss ")
    kill_launcher_and_wait(nodes, expected=6)  # per node: the launcher, torchrun, one worker
    assert nodes[1].proc.wait(timeout=10) == 1


def test_a_process_whose_parent_has_ended_does_not_start():
    """Where the launcher, or torchrun, died before its child could ask for the parent-death signal (which would
    then never come), the child does not start its command; with its parent alive, it does."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    wrapper = [sys.executable, str(ROOT / "runtime" / "parent_death.py")]
    torchrun = subprocess.run([*wrapper, "torchrun", str(gone.pid), "echo", "started"], capture_output=True,
                              text=True, timeout=60)
    assert torchrun.returncode == 1 and torchrun.stdout == "", torchrun
    assert f"torchrun: its parent (pid {gone.pid}) has ended; not starting echo" in torchrun.stderr
    worker = subprocess.run([*wrapper, "worker", "echo", "started"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "MMDIT_TORCHRUN_PID": str(gone.pid)})
    assert worker.returncode == 1 and worker.stdout == "", worker
    assert f"worker: its parent (pid {gone.pid}) has ended; not starting echo" in worker.stderr
    assert subprocess.run([*wrapper, "torchrun", str(os.getpid()), "echo", "started"], capture_output=True,
                          text=True, timeout=60).stdout == "started\n"
    assert subprocess.run([*wrapper, "worker", "echo", "started"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MMDIT_TORCHRUN_PID": str(os.getpid())}).stdout == "started\n"
