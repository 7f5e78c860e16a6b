"""No orphans: every process of a launch ends within moments of the launcher, whatever ended it.

launch.sh starts torchrun through this file, `python runtime/parent_death.py LAUNCHER_PID COMMAND ...`: in a
session of its own (a terminal's Ctrl-C then reaches the launcher alone, which passes it on) and with Linux's
parent-death signal set to SIGKILL, so that torchrun dies with the launcher even when the launcher is SIGKILLed
and can pass nothing on. torchrun starts each worker in a session of its own and leaves them running when it is
killed itself; so each worker asks, first thing (`end_with_torchrun`), for the same signal when torchrun dies.
(With one process the launcher execs the worker: killing it kills the run.) The data loader's worker processes
watch their parent themselves (torch checks every 5 s), as do the compile workers of torch.compile.

SIGKILL rather than SIGTERM (which would checkpoint): a launcher traps SIGTERM, SIGINT and SIGHUP and passes them
on as a pre-emption (checkpoint, exit 0), so it dies only of a signal it cannot trap: a user's `kill -9`, the OOM
killer. The user wants the run ended then, and a checkpoint is not safe to attempt: it needs every rank at the same
step, with torchrun (which ends the others when one fails) and the launcher (which reports the outcome) gone.
A checkpoint is written so that a SIGKILL at any moment keeps the last complete one (perf/checkpoint.py), and the
run directory's lock dies with its holder (runtime/directory_lock.py): the same command resumes.

The parent-death signal survives exec (unless the program is set-user-ID) and belongs to the thread that started
the process (torchrun starts its workers from its main thread). A process whose parent died before it asked would
never get the signal: each step compares its parent with the one it expects (the launcher's pid, given on the
command line; torchrun's, which this file leaves in MMDIT_TORCHRUN_PID) and ends at once if that one is gone.

Under several nodes each node's launcher, torchrun and workers end together like this; the ranks of the other
nodes then fail at their next collective with the ranks that are gone (gloo: at once, the connection is closed;
NCCL: its watchdog, or `parallel.timeout_s`), and their torchrun ends them. Linux only (elsewhere: a no-op).
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


def end_with_torchrun() -> None:
    """First thing in a worker of launch.sh's torchrun: end when torchrun does (nothing elsewhere)."""
    parent = os.environ.get(TORCHRUN_PID)
    if parent is not None and not die_with_parent(int(parent)):
        raise SystemExit(f"torchrun (pid {parent}) has ended before this worker started; exiting")


def main(argv: list[str]) -> None:
    """Start a command (torchrun) in a session of its own, to end with the launcher `argv[0]`."""
    launcher, command = int(argv[0]), argv[1:]
    os.setsid()
    if not die_with_parent(launcher):
        raise SystemExit(f"the launcher (pid {launcher}) has ended; not starting {command[0]}")
    os.environ[TORCHRUN_PID] = str(os.getpid())  # exec keeps the pid: torchrun's, for its workers
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
