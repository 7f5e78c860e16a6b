"""One job per directory: the process that writes a run directory (or a precompute's output directory) holds a
lock on it for the job's life, and a second start into it is refused, before it computes or changes anything,
with the holder named.

The lock is a POSIX record lock (fcntl F_SETLK: Python's `fcntl.lockf`) on `<directory>/.lock`, a file that says
who holds it (pid, host, start time, command) and is there only while it is held. Why this kind of lock:
- The kernel releases it when its process dies, however it dies: a dead holder never blocks and there is no stale
  lock to clean up. (A `.lock` left by a killed holder is harmless: the next start locks and rewrites it.)
- It belongs to the process, not to an open file: the data loader's forked workers, which inherit every open
  descriptor, do not hold it. (An flock() lock, or an OFD lock, would live on in them after the trainer died.)
  The price: a process drops its POSIX locks on a file as soon as it closes *any* descriptor of that file, so only
  this module opens the lock file, once per holder, and a second lock of the same directory in the holder's
  own process is refused here (the kernel would grant it).
- It is the lock network filesystems implement best (below).
The holder removes `.lock` while it still holds it, then releases; a starter checks that the file it locked is
still the one at `.lock` (else it locks the new one), so two starters never hold two files. A start that failed
leaves nothing: the directories it created for itself are removed again if nothing else was written there.

Only one process of a job locks: global rank 0 (of training, which writes the run directory's config, metrics and
samples, and whose checkpoints the other ranks write shards of; of a precompute, whose other ranks write their
units' shards while rank 0 holds the directory). Its refusal stops every rank alike
(runtime/distributed.py:stop_together). Under several nodes that one lock is taken from global rank 0's node on
the shared directory, so it keeps a second job out only as far as the filesystem's locks reach:
- a local disk (ext4, xfs, ...): the node.
- NFS: every client (the server holds POSIX locks: NLM for NFSv3, the protocol itself for v4), unless a client
  mounted it with `nolock` or `local_lock=posix|all` (its locks are then its own). A holder whose node crashed
  keeps the lock until the server gives up on it (NFSv4: its lease, 90 s by default; NFSv3: the client's reboot).
- Lustre: every client with the mount option `-o flock`; one node with `-o localflock`; without either (the
  default, or `noflock`) locking fails.
- BeeGFS: one node, unless the clients set `tuneUseGlobalFileLocks = true`.
- CephFS, GPFS (Spectrum Scale): every client.
Where locking fails (ENOLCK, ENOSYS, EOPNOTSUPP), the job warns that nothing keeps a second one out and runs.

A directory that cannot be created or written (no permission, a read-only filesystem, a file in its path, no space
left) is the user's to fix: `lock_directory` and `writable_directory` refuse it with the OS's reason, before the
job computes anything. They find out by writing (the lock file, a probe file): permission bits say nothing for root,
and only a write sees a read-only mount or a full disk.
"""

import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from errors import InputError

log = logging.getLogger("mmdit")
LOCK_FILE = ".lock"
UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP}  # the filesystem does not lock (see above)
ATTEMPTS = 100  # to lock the file at `.lock` while other starts and ends replace it: one or two in practice
COMMAND_CHARS = 300  # of the holder's command, in the refusal
held: set[tuple[int, int]] = set()  # the lock files this process holds, as (device, inode)


class DirectoryLock:
    """A held lock (from `lock_directory`), released by `close()` or the end of a `with` block."""

    def __init__(self, directory: Path, fd: int | None, created: list[Path]):
        self.directory, self.fd, self.created = directory, fd, created  # created: the directories made, deepest first

    def close(self) -> None:
        if self.fd is not None:
            held.discard(identity(self.fd))
            (self.directory / LOCK_FILE).unlink(missing_ok=True)  # still locked: see the module's docstring
            os.close(self.fd)  # releases the lock
            self.fd = None
        remove_if_empty(self.created)  # the start failed before writing anything
        self.created = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def lock_directory(directory: Path, label: str, error: type[InputError] = InputError) -> DirectoryLock:
    """Lock `directory` (created if need be) for this process, or raise `error` naming it as `label` (e.g.
    "logging.output_dir=runs/x") and its holder, having changed nothing."""
    refuse_a_file_on_the_path(directory, label, error)
    path = directory / LOCK_FILE
    for _ in range(ATTEMPTS):
        created = missing(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if identity(path) in held:  # never a second descriptor in the holder: it would drop the lock
                raise error(f"{label} is in use by this process (pid {os.getpid()})")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:  # a start that failed removed the directory it had created: create it again
            continue
        except OSError as e:  # a parent is a file, no permission, a read-only filesystem
            remove_if_empty(created)
            raise error(unwritable(label, directory, e)) from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = read_holder(fd) if e.errno in (errno.EACCES, errno.EAGAIN) else None
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise error(f"{label} is in use by {describe(holder)}; let it finish or stop it, or use another "
                            f"directory (nothing was changed)") from None
            if e.errno not in UNSUPPORTED:
                raise
            log.warning("%s cannot be locked on this filesystem (%s): nothing keeps a second job from writing "
                        "into it at the same time (runtime/directory_lock.py)", directory, os.strerror(e.errno))
            path.unlink(missing_ok=True)
            return DirectoryLock(directory, None, created)
        if identity(path) == identity(fd):
            break
        os.close(fd)  # its holder removed it while this start opened it: lock the file there now
    else:
        raise RuntimeError(f"{path} was replaced {ATTEMPTS} times while this process tried to lock it")
    lock = DirectoryLock(directory, fd, created)
    held.add(identity(fd))
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder_info()).encode(), 0)
    except OSError as e:  # no space left
        lock.close()
        raise error(unwritable(label, directory, e)) from None
    return lock


def writable_directory(directory: Path, label: str, error: type[InputError] = InputError) -> None:
    """Create `directory` if need be and write a file in it, or raise `error` naming it as `label` (e.g. "--out x")
    with the OS's reason, having changed nothing."""
    refuse_a_file_on_the_path(directory, label, error)
    created = missing(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory) as probe:  # gone when closed, even if this process is killed
            probe.write(b"probe")
            probe.flush()
    except OSError as e:
        remove_if_empty(created)
        raise error(unwritable(label, directory, e)) from None


def refuse_a_file_on_the_path(directory: Path, label: str, error: type[InputError]) -> None:
    for parent in [directory, *directory.parents]:
        if parent.exists() and not parent.is_dir():
            raise error(f"{label}: {parent} is a file, not a directory")


def missing(directory: Path) -> list[Path]:
    """`directory` and its parents that do not exist, deepest first: what creating it creates."""
    return [d for d in [directory, *directory.parents] if not d.exists()]


def unwritable(label: str, directory: Path, e: OSError) -> str:
    """The refusal of a directory that cannot be created or written: the OS's reason, and where when that is one
    of the parents it would create."""
    where = Path(e.filename) if e.filename else directory
    at = "" if directory in (where, *where.parents) else f" (at {where})"
    return f"{label}: cannot create or write into {directory}{at}: {e.strerror}"


def remove_if_empty(directories: list[Path]) -> None:
    """Remove the directories a failed start created (deepest first), each only while empty."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            break


def identity(file: Path | int) -> tuple[int, int] | None:
    """(device, inode) of a path or an open descriptor; None where there is no such file."""
    try:
        stat = os.stat(file)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def holder_info() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join(sys.orig_argv)}


def read_holder(fd: int) -> dict | None:
    """What the holder wrote into the lock file; None while it has not yet (it writes just after locking)."""
    for _ in range(20):
        try:
            return json.loads(os.pread(fd, 1 << 16, 0))
        except ValueError:
            time.sleep(0.05)
    return None


def describe(holder: dict | None) -> str:
    if holder is None:
        return "another job (it has not yet written who it is)"
    command = " ".join(holder["command"].split())  # one line
    command = command if len(command) <= COMMAND_CHARS else command[:COMMAND_CHARS] + "..."
    return f"pid {holder['pid']} on {holder['host']}, started {holder['started']} ({command})"
