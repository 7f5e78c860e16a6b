"""No orphans: every process of a launch ends within moments of the launcher, whatever ended it.

launch.sh starts torchrun through this file, and has torchrun start each worker through it too:

    python runtime/parent_death.py torchrun LAUNCHER_PID python -m torch.distributed.run ... --no-python \\
        python runtime/parent_death.py worker python -u SCRIPT.py ARGS

Each step asks Linux for SIGKILL when its parent ends (the parent-death signal), then execs the command: torchrun
in a session of its own (a terminal's Ctrl-C then reaches the launcher alone, which passes it on) that dies with
the launcher even when the launcher is SIGKILLed and can pass nothing on; each worker, which torchrun starts in a
session of its own and would leave running if killed itself, dies with torchrun. Any SCRIPT.py is covered. (With
one process the launcher execs the script: killing it kills the run.) The data loader's worker processes watch
their parent themselves (torch checks every 5 s), as do the compile workers of torch.compile.

SIGKILL rather than SIGTERM (which would checkpoint): a launcher traps SIGTERM, SIGINT and SIGHUP and passes them
on as a pre-emption (checkpoint, exit 128 + the signal), so it dies only of a signal it cannot trap: a user's
`kill -9`, the OOM killer. The user wants the run ended then, and a checkpoint is not safe to attempt: it needs
every rank at the same step, with torchrun (which ends the others when one fails) and the launcher (which reports
the outcome) gone.
A checkpoint is written so that a SIGKILL at any moment keeps the last complete one (perf/checkpoint.py), and the
run directory's lock dies with its holder (runtime/directory_lock.py): the same command resumes.

The parent-death signal survives exec (unless the program is set-user-ID) and belongs to the thread that started
the process (torchrun starts its workers from its main thread). A process whose parent died before it asked would
never get the signal, so each step then compares its parent with the one it expects (the launcher's pid, given on
the command line; torchrun's, which the first step leaves in MMDIT_TORCHRUN_PID, exec keeping the pid) and does
not start the command if that one is gone.

Under several nodes each node's launcher, torchrun and workers end together like this; the ranks of the other
nodes then fail at their next collective with the ranks that are gone (gloo: at once, the connection is closed;
NCCL: its watchdog, or `parallel.timeout_s`), and their torchrun ends them. Linux only (elsewhere the commands
just start).
"""

import ctypes
import os
import signal
import sys

TORCHRUN_PID = "MMDIT_TORCHRUN_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> bool:
    """SIGKILL this process when its parent ends; False when `parent` (its parent's pid) has already ended."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    return os.getppid() == parent  # asked before this check: a later end of the parent sends the signal


def start(role: str, command: list[str]) -> None:
    """Exec `command` as torchrun (`command[0]` is the launcher's pid) or as one of its workers."""
    if role == "torchrun":
        parent, command = int(command[0]), command[1:]
        os.setsid()
        os.environ[TORCHRUN_PID] = str(os.getpid())  # for its workers
    else:
        parent = int(os.environ[TORCHRUN_PID])
    if not die_with_parent(parent):
        raise SystemExit(f"{role}: its parent (pid {parent}) has ended; not starting {command[0]}")
    os.execvp(command[0], command)


if __name__ == "__main__":
    start(sys.argv[1], sys.argv[2:])
