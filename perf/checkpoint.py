"""Checkpoints: one directory per step in torch.distributed.checkpoint (DCP) format, written atomically and
verifiably from a CPU snapshot by a background thread, and resumable under any world size and strategy.

A checkpoint holds one state dict, {"model": trained weights, "ema": their averages, "optimizer": AdamW state
keyed by parameter name}, plus `state.json` (the loop's own state) and `config.yaml`. Under DDP or one
process, rank 0 writes all of it; under FSDP/HSDP every rank writes its own shards in parallel. Either way
DCP records the global shape of every tensor, so a checkpoint loads into any sharding: 2 FSDP ranks -> 1
process, 1 process -> 4 HSDP ranks, and so on.

Publishing: everything is written into `.tmp-step_XXXXXXXX`, every file is fsynced, each writer hashes its
own files, rank 0 adds `manifest.json` (sizes and sha256 of every file) last and only then renames the
directory to `step_XXXXXXXX`. A directory without a valid manifest is never resumed from.

`Checkpointer.save` copies the state into reused CPU buffers on the training thread (pinned, non-blocking
copies on CUDA, ordered before any later optimizer kernel by the stream), then hands the write to one
background thread. At most one save is in flight: a new save first waits for the previous one.
"""

import copy
import hashlib
import json
import logging
import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

log = logging.getLogger("mmdit")
# DCP says so at every save and load of one process; that is what `no_dist` asks for, not news
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
MANIFEST = "manifest.json"
STATE = "state.json"
DCP_METADATA = ".metadata"


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


def file_record(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def group_rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def write_checkpoint(run_dir: Path, step: int, state: dict, meta: dict, extra_files: dict[str, str] | None = None,
                     group: dist.ProcessGroup | None = None) -> Path:
    """Write `state` (nested dicts of tensors; DTensors contribute their local shards) as the checkpoint of
    `step`. Every rank of `group` calls this with its part (one process: group None); rank 0 also writes
    `meta` (JSON) and `extra_files` (name -> text) and publishes. Returns the published path."""
    rank, extra_files = group_rank(group), extra_files or {}
    root = checkpoint_root(run_dir)
    final, tmp = root / f"step_{step:08d}", root / f".tmp-step_{step:08d}"
    decision = None
    if rank == 0:  # every rank learns rank 0's decision, so a failure here never leaves one waiting
        try:
            root.mkdir(parents=True, exist_ok=True)
            decision = "keep" if final.exists() and verify(final) is None else "write"  # same step, same state
            if decision == "write":
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
        except OSError as e:
            decision = f"{type(e).__name__}: {e}"
    decision = broadcast(decision, group)
    if decision == "keep":
        return final
    if decision != "write":
        raise OSError(f"cannot prepare {tmp}: {decision}")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), process_group=group,
             no_dist=group is None)  # a rank failing inside DCP fails it on every rank
    try:
        own = {p.name: file_record(p) for p in tmp.iterdir()
               if p.name.startswith(f"__{rank}_") or (rank == 0 and p.name == DCP_METADATA)}
    except OSError as e:
        own = {"error": f"rank {rank}: {type(e).__name__}: {e}"}
    records = gather(own, group)  # every writer hashed its own files, in parallel
    if "error" in records:
        raise OSError(f"{tmp}: {records['error']}")
    if rank != 0:
        return final
    (tmp / STATE).write_text(json.dumps(meta, indent=1))
    for name, text in extra_files.items():
        (tmp / name).write_text(text)
    for name in [STATE, *extra_files]:
        fsync_path(tmp / name)
        records[name] = file_record(tmp / name)
    missing = sorted(p.name for p in tmp.iterdir()) != sorted(records)
    if missing:
        raise RuntimeError(f"{tmp} holds {sorted(p.name for p in tmp.iterdir())}, the writers reported "
                           f"{sorted(records)}")
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": records}, indent=1))
    fsync_path(tmp / MANIFEST)
    fsync_path(tmp)  # the directory entries themselves, before the rename publishes them
    if final.exists():  # an invalid leftover of this step: replaced only now that the new one is complete
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root)
    return final


def broadcast(value, group):
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def gather(records: dict, group) -> dict:
    if group is None:
        return dict(records)
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, records, group=group)
    return {name: record for part in parts for name, record in part.items()}


def verify(path: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """None if the checkpoint is complete and intact, else the reason it is not. With several ranks, each one
    hashes every `world_size`-th file from its `rank`, so the files are read in parallel."""
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (incomplete write)"
    try:
        manifest = json.loads(manifest_path.read_text())["files"]
        for i, (name, expected) in enumerate(sorted(manifest.items())):
            file = Path(path) / name
            if not file.is_file():
                return f"missing file {name}"
            if file.stat().st_size != expected["bytes"]:
                return f"{name} has {file.stat().st_size} bytes, manifest says {expected['bytes']}"
            if i % world_size == rank and sha256(file) != expected["sha256"]:
                return f"{name} checksum mismatch"
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        return f"unreadable manifest: {type(e).__name__}: {e}"
    return None


def checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoint directories, oldest first (temporary directories excluded)."""
    root = checkpoint_root(run_dir)
    return sorted(root.glob("step_[0-9]*")) if root.is_dir() else []


def latest_valid_checkpoint(run_dir: Path, group: dist.ProcessGroup | None = None) -> Path | None:
    """The newest checkpoint that verifies; every rank of `group` takes part in checking each candidate, from
    rank 0's listing (a rank's own listing may lag on a network filesystem, and the ranks must agree on how
    many collectives follow)."""
    rank, world = (group_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    for path in broadcast(list(reversed(checkpoints(run_dir))), group):
        problems = gather({rank: verify(path, rank, world)}, group)
        problem = next((p for p in problems.values() if p), None)
        if problem is None:
            return path
        if rank == 0:
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


def stored_names(path: Path, part: str) -> set[str]:
    """The tensor names a checkpoint holds under `part` ("model", "ema"), from its metadata alone."""
    path = Path(path)
    if not (path / DCP_METADATA).is_file():
        from safetensors import safe_open
        with safe_open(path / f"{part}.safetensors", "pt") as f:
            return set(f.keys())
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {nesting[1] for nesting in metadata.planner_data.values() if nesting[0] == part}


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / STATE).read_text())


def read_checkpoint(path: Path, parts: tuple[str, ...] = ("model", "ema")) -> tuple[dict, dict]:
    """Whole (unsharded) tensors of the given parts of a checkpoint, however many ranks wrote it, and its
    state.json; in this process alone. Checkpoints of earlier versions (safetensors files) read too."""
    path = Path(path)
    if not (path / DCP_METADATA).is_file():
        from safetensors.torch import load_file
        return {part: load_file(path / f"{part}.safetensors") for part in parts
                if (path / f"{part}.safetensors").is_file()}, read_meta(path)
    metadata = dcp.FileSystemReader(path).read_metadata()
    leaves = {metadata.planner_data[key]: torch.empty(item.size, dtype=item.properties.dtype)  # the nesting of
              if hasattr(item, "size") else None for key, item in metadata.state_dict_metadata.items()}  # each key
    template = nest({nesting: leaf for nesting, leaf in leaves.items() if nesting[0] in parts})
    dcp.load(template, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return template, read_meta(path)


def nest(leaves: dict[tuple, object]):
    """{("a", 0, "b"): x} -> {"a": [{"b": x}]}: the structure DCP flattened (lists by position)."""
    if () in leaves:
        return leaves[()]
    children: dict = {}
    for (head, *rest), leaf in leaves.items():
        children.setdefault(head, {})[tuple(rest)] = leaf
    nested = {key: nest(child) for key, child in children.items()}
    return [nested[i] for i in range(len(nested))] if nested and all(isinstance(k, int) for k in nested) else nested


def load_checkpoint(path: Path, state: dict, group: dist.ProcessGroup | None = None) -> None:
    """Fill `state` (the live tensors: DTensors get their own shards) from a checkpoint of any sharding.
    Without a group (one process, or DDP) every rank reads the whole checkpoint by itself."""
    path = Path(path)
    if (path / DCP_METADATA).is_file():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=group, no_dist=group is None)
        return
    fill_from_full(state, read_earlier_format(path, state))


def read_earlier_format(path: Path, state: dict) -> dict:
    """A checkpoint of an earlier version: model/ema/optimizer safetensors, the optimizer keyed by position
    (`{index}.{key}`) as `Optimizer.state_dict()` numbers parameters; mapped onto `state`'s names."""
    full, meta = read_checkpoint(path, ("model", "ema", "optimizer"))
    names = [name for group in state["optimizer"]["param_groups"] for name in group["params"]]
    optimizer = {}
    for flat, tensor in [*full["optimizer"].items(), *meta["optimizer"]["scalars"].items()]:
        index, key = flat.split(".", 1)
        optimizer.setdefault(names[int(index)], {})[key] = torch.as_tensor(tensor)
    return {"model": full["model"], "ema": full["ema"],
            "optimizer": {"state": optimizer, "param_groups": state["optimizer"]["param_groups"]}}


def fill_from_full(state, full) -> None:
    """Copy whole tensors into `state` in place (a DTensor takes its own shard of the whole tensor)."""
    if isinstance(state, dict):
        for key, value in state.items():
            if key in full and isinstance(value, (dict, torch.Tensor)):
                fill_from_full(value, full[key])
        return
    with torch.no_grad():
        if isinstance(state, DTensor):
            from torch.distributed.tensor import distribute_tensor
            full = distribute_tensor(full.to(state.dtype), state.device_mesh, state.placements, src_data_rank=None)
            state.to_local().copy_(full.to_local())
        else:
            state.copy_(full)


def prune_checkpoints(run_dir: Path, keep_last: int, newest: int) -> None:
    """Keep the `keep_last` checkpoints up to step `newest` (just completed); delete older ones. Directories
    of later steps (left invalid by an earlier attempt) are not counted: this run replaces them on its way."""
    for old in [p for p in checkpoints(run_dir) if step_of(p) <= newest][:-keep_last]:
        trash = old.with_name(f".trash-{old.name}")
        os.rename(old, trash)  # atomic: a kill mid-delete never leaves a half-deleted step_ directory
        shutil.rmtree(trash)


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def remove_leftovers(run_dir: Path) -> None:
    """Temporary and half-deleted directories of an earlier process that was killed."""
    for path in checkpoint_root(run_dir).glob(".*-step_*"):
        log.info("removing leftover %s", path)
        shutil.rmtree(path, ignore_errors=True)


class CheckpointWriteError(RuntimeError):
    pass


class Checkpointer:
    """Snapshots on the training thread, writes in the background (or inline when `async_save` is off).
    With a `group`, every rank of it is a writer of its own shards (FSDP/HSDP); without, this process
    writes the whole state (one process, or rank 0 under DDP)."""

    def __init__(self, run_dir: Path, keep_last: int, async_save: bool, fail_on_error: bool,
                 group: dist.ProcessGroup | None = None):
        self.run_dir, self.keep_last, self.fail_on_error, self.group = Path(run_dir), keep_last, fail_on_error, group
        self.buffers: dict[str, torch.Tensor] = {}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint") if async_save else None
        self.pending: Future | None = None
        self.pending_step = -1
        if group_rank(group) == 0:
            remove_leftovers(run_dir)
        if group is not None:
            dist.barrier(group=group)
        self.last_complete: Path | None = latest_valid_checkpoint(run_dir, group)
        self.last_stall_s = 0.0
        self.last_error: str | None = None

    def stage(self, tree, name: str = ""):
        """Copy a state tree into reused CPU buffers (DTensors keep their sharding, with CPU shards) and return
        the copy; on CUDA the copies are non-blocking (`save` records an event the writer waits for)."""
        if isinstance(tree, dict):
            return {key: self.stage(value, f"{name}.{key}") for key, value in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self.stage(value, f"{name}.{i}") for i, value in enumerate(tree))
        if not isinstance(tree, torch.Tensor):
            return copy.deepcopy(tree)
        local = tree.to_local() if isinstance(tree, DTensor) else tree
        buf = self.buffers.get(name)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            buf = self.buffers[name] = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                                                   pin_memory=local.is_cuda)
        buf.copy_(local.detach(), non_blocking=local.is_cuda)
        self.on_cuda |= local.is_cuda
        if isinstance(tree, DTensor):
            return DTensor.from_local(buf, tree.device_mesh, tree.placements, run_check=False, shape=tree.shape,
                                      stride=tree.stride())
        return buf

    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def save(self, step: int, state: dict, meta: dict, extra_files: dict[str, str]) -> None:
        """Snapshot now, write (in the background when async). Waits first for a save still in flight."""
        if step == self.pending_step:  # e.g. pre-empted right after a periodic save of the same step
            self.wait()  # its outcome decides: done, or written again below
            if self.last_error is None:
                return
        start = time.perf_counter()
        if self.pending is not None and not self.pending.done():
            self.wait(reason=f"save of step {step} waits for step {self.pending_step} still being written")
        self.report_errors()
        first, self.on_cuda = not self.buffers, False
        staged = self.stage(state)
        event = None
        if self.on_cuda:
            event = torch.cuda.Event()
            event.record()
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
            path = write_checkpoint(self.run_dir, step, staged, meta, extra_files, self.group)
        except Exception:
            if group_rank(self.group) == 0:
                shutil.rmtree(checkpoint_root(self.run_dir) / f".tmp-step_{step:08d}", ignore_errors=True)
            raise
        if group_rank(self.group) == 0:
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
    """What ranks other than 0 hold under DDP: the Checkpointer's interface, writing nothing."""

    last_complete: Path | None = None
    last_error: str | None = None
    last_stall_s = 0.0

    def save(self, step: int, state: dict, meta: dict, extra_files: dict[str, str]) -> None:
        pass

    def report_errors(self) -> None:
        pass

    def close(self) -> None:
        pass
