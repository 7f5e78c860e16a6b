"""Checkpoints as directories of safetensors files plus JSON, written atomically and verifiable, by a
background thread from a CPU snapshot.

A checkpoint is written into `.tmp-step_XXXXXXXX`, fsynced, given a manifest (sizes and sha256 of every file)
last, and only then renamed to `step_XXXXXXXX`. A directory without a valid manifest is never resumed from.

`Checkpointer.save` copies the whole training state into reused CPU buffers on the training thread (pinned,
non-blocking copies on CUDA, ordered before any later optimizer kernel by the stream), then hands the write
to one background thread. At most one save is in flight: a new save first waits for the previous one.
"""

import hashlib
import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger("mmdit")
MANIFEST = "manifest.json"


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(run_dir: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]], meta: dict,
                     extra_files: dict[str, str] = {}) -> Path:
    """tensors: file stem -> state dict (CPU tensors); meta: JSON-able loop state; extra_files: name -> text."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step_{step:08d}", root / f".tmp-step_{step:08d}"
    if final.exists() and verify(final) is None:  # same step, same state: keep what is on disk
        return final
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for stem, state in tensors.items():
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / f"{stem}.safetensors")
    (tmp / "state.json").write_text(json.dumps(meta, indent=1))
    for name, text in extra_files.items():
        (tmp / name).write_text(text)
    files = sorted(p for p in tmp.iterdir())
    for path in files:
        fsync_path(path)
    manifest = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=1))
    fsync_path(tmp / MANIFEST)
    fsync_path(tmp)  # the directory entries themselves, before the rename publishes them
    if final.exists():  # an invalid leftover of this step: replaced only now that the new one is complete
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root)
    return final


def verify(path: Path) -> str | None:
    """None if the checkpoint is complete and intact, else the reason it is not."""
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (incomplete write)"
    try:
        manifest = json.loads(manifest_path.read_text())["files"]
        for name, expected in manifest.items():
            file = Path(path) / name
            if not file.is_file():
                return f"missing file {name}"
            if file.stat().st_size != expected["bytes"]:
                return f"{name} has {file.stat().st_size} bytes, manifest says {expected['bytes']}"
            if sha256(file) != expected["sha256"]:
                return f"{name} checksum mismatch"
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        return f"unreadable manifest: {type(e).__name__}: {e}"
    return None


def checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoint directories, oldest first (temporary directories excluded)."""
    root = checkpoint_root(run_dir)
    return sorted(root.glob("step_[0-9]*")) if root.is_dir() else []


def latest_valid_checkpoint(run_dir: Path) -> Path | None:
    for path in reversed(checkpoints(run_dir)):
        problem = verify(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def find_checkpoint(path: Path) -> Path:
    """A checkpoint directory as given, or a run directory's newest complete checkpoint."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        problem = verify(path)
        if problem:
            raise ValueError(f"checkpoint {path} is not usable: {problem}")
        return path
    found = latest_valid_checkpoint(path)
    if found is None:
        raise ValueError(f"{path} is neither a checkpoint directory nor a run directory with a complete checkpoint")
    return found


def read_checkpoint(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    path = Path(path)
    tensors = {p.name.removesuffix(".safetensors"): load_file(p) for p in path.glob("*.safetensors")}
    return tensors, json.loads((path / "state.json").read_text())


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def prune_checkpoints(run_dir: Path, keep_last: int, newest: int) -> None:
    """Keep the `keep_last` checkpoints up to step `newest` (just completed); delete older ones. Directories
    of later steps (left invalid by an earlier attempt) are not counted: this run replaces them on its way."""
    for old in [p for p in checkpoints(run_dir) if step_of(p) <= newest][:-keep_last]:
        trash = old.with_name(f".trash-{old.name}")
        os.rename(old, trash)  # atomic: a kill mid-delete never leaves a half-deleted step_ directory
        shutil.rmtree(trash)


def remove_leftovers(run_dir: Path) -> None:
    """Temporary and half-deleted directories of an earlier process that was killed."""
    for path in checkpoint_root(run_dir).glob(".*-step_*"):
        log.info("removing leftover %s", path)
        shutil.rmtree(path, ignore_errors=True)


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state dict into flat CPU tensors (safetensors) and JSON-able metadata."""
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{key}"] = value.detach()
            else:
                scalars[f"{pid}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_tensors(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for flat, value in [*tensors.items(), *meta["scalars"].items()]:
        pid, key = flat.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


class CheckpointWriteError(RuntimeError):
    pass


class Checkpointer:
    """Snapshots on the training thread, writes in the background (or inline when `async_save` is off)."""

    def __init__(self, run_dir: Path, keep_last: int, async_save: bool, fail_on_error: bool):
        self.run_dir, self.keep_last, self.fail_on_error = Path(run_dir), keep_last, fail_on_error
        self.buffers: dict[str, dict[str, torch.Tensor]] = {}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint") if async_save else None
        self.pending: Future | None = None
        self.pending_step = -1
        remove_leftovers(run_dir)
        self.last_complete: Path | None = latest_valid_checkpoint(run_dir)
        self.last_stall_s = 0.0
        self.last_error: str | None = None

    def stage(self, tensors: dict[str, dict[str, torch.Tensor]]) -> tuple[dict, torch.cuda.Event | None]:
        """Copy into reused CPU buffers; returns the copies and, on CUDA, an event marking their completion."""
        on_cuda = any(t.is_cuda for state in tensors.values() for t in state.values())
        staged = {}
        for stem, state in tensors.items():
            buffers = self.buffers.setdefault(stem, {})
            for name, tensor in state.items():
                buf = buffers.get(name)
                if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                    buf = buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                                      pin_memory=on_cuda)
                buf.copy_(tensor.detach(), non_blocking=on_cuda)
            staged[stem] = {name: buffers[name] for name in state}
        event = None
        if on_cuda:
            event = torch.cuda.Event()
            event.record()
        return staged, event

    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for state in self.buffers.values() for t in state.values())

    def save(self, step: int, tensors: dict[str, dict[str, torch.Tensor]], meta: dict,
             extra_files: dict[str, str]) -> None:
        """Snapshot now, write (in the background when async). Waits first for a save still in flight."""
        if step == self.pending_step and self.last_error is None:
            return  # e.g. pre-empted right after a periodic save of the same step
        start = time.perf_counter()
        if self.pending is not None and not self.pending.done():
            self.wait(reason=f"save of step {step} waits for step {self.pending_step} still being written")
        self.report_errors()
        first = not self.buffers
        staged, event = self.stage(tensors)
        meta = json.loads(json.dumps(meta))  # a deep copy: the live dicts keep changing
        if first:
            log.info("checkpoint staging buffers: %.1f MiB of CPU memory", self.staging_bytes() / 2**20)
        self.pending_step = step
        if self.executor is None:
            self.pending = Future()
            try:
                self.pending.set_result(self.write(step, staged, event, meta, extra_files))
            except Exception as e:  # same error path as the background writer
                self.pending.set_exception(e)
            self.report_errors()
        else:
            self.pending = self.executor.submit(self.write, step, staged, event, meta, extra_files)
        self.last_stall_s = time.perf_counter() - start

    def write(self, step: int, staged: dict, event, meta: dict, extra_files: dict[str, str]) -> Path:
        if event is not None:
            event.synchronize()
        try:
            path = write_checkpoint(self.run_dir, step, staged, meta, extra_files)
        except Exception:
            shutil.rmtree(checkpoint_root(self.run_dir) / f".tmp-step_{step:08d}", ignore_errors=True)
            raise
        try:
            prune_checkpoints(self.run_dir, self.keep_last, newest=step)
        except OSError as e:  # the new checkpoint is complete; old ones linger until the next save
            log.warning("could not delete old checkpoints in %s: %s", checkpoint_root(self.run_dir), e)
        return path

    def report_errors(self) -> None:
        """Log (or raise, when fatal) the outcome of a finished save, once."""
        if self.pending is None or not self.pending.done():
            return
        future, self.pending = self.pending, None
        error = future.exception()
        if error is None:
            self.last_complete, self.last_error = future.result(), None
            log.info("checkpoint %s complete", self.last_complete)
            return
        message = (f"checkpoint of step {self.pending_step} into {checkpoint_root(self.run_dir)} failed: "
                   f"{type(error).__name__}: {error}; the last complete checkpoint is {self.last_complete}")
        self.last_error = message
        if self.fail_on_error:
            raise CheckpointWriteError(message) from error
        log.error("%s; training continues", message)

    def wait(self, reason: str = "") -> None:
        if self.pending is None:
            return
        start = time.perf_counter()
        try:
            self.pending.exception()  # blocks until done, never raises
        finally:
            if reason:
                log.info("%s: waited %.2fs", reason, time.perf_counter() - start)
        self.report_errors()

    def close(self) -> None:
        self.wait()
        if self.executor is not None:
            self.executor.shutdown(wait=True)


class NullCheckpointer:
    """What ranks other than 0 hold: the Checkpointer's interface, writing nothing."""

    last_complete: Path | None = None
    last_error: str | None = None
    last_stall_s = 0.0

    def save(self, step: int, tensors: dict, meta: dict, extra_files: dict[str, str]) -> None:
        pass

    def report_errors(self) -> None:
        pass

    def close(self) -> None:
        pass
