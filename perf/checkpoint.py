"""Checkpoints: one directory per step in torch.distributed.checkpoint (DCP) format, staged to host memory
by torch's stager, written in the background by every rank, published atomically, verified before use, and
resumable under any world size and strategy.

The `Checkpointer` owns a run's checkpoints. It is given the parts of the training state, each an object with
`state_dict()` / `load_state_dict()` (model weights, EMA, optimizer, grad scaler, batch sizer, ...), and decides
when to save (`save(step)` at every `checkpoint.every`-th step; `save(step, last=True)` always), where to
resume from (`resume()`), and which old checkpoints to delete.

- Writing: `dcp.async_save` with a `DefaultStager`, which copies the state into host buffers it keeps for the
  next save, in a thread of its own while training goes on: on CUDA pinned buffers (pinned by registering plain
  host memory, so they hold exactly the state's bytes, not the power-of-two blocks of the pinned caching
  allocator) filled on a side stream. The optimizer waits for that copy before it next changes the weights (a
  step pre-hook, `wait_for_staging`). Every rank writes what it owns: its shards under FSDP/HSDP; under DDP DCP
  spreads the replicated tensors over the ranks, each written once.
- Publishing: files go into `.tmp-step_XXXXXXXX`, each fsynced; each rank hashes its own files; rank 0 adds
  `state.json` (the step, and what export needs), `config.yaml` and, last, `manifest.json` (size and sha256 of
  every file), then renames the directory to `step_XXXXXXXX`. At most one save is in flight.
- Resuming: the newest checkpoint that verifies (every rank hashes a share of the files). Damaged newer ones
  are moved to `checkpoints/damaged/`, never deleted. If checkpoints exist but none verifies, the run refuses
  to start, naming each one and what is wrong, and changes nothing on disk.
- Reading (resume, export, sampling): DCP unpickles a checkpoint's `.metadata` and its non-tensor values;
  unpickling runs whatever code a file's author put in it, and run directories are passed around. So both are
  read by unpicklers that admit only what DCP writes there (`CheckpointReader`, `PlainDataPlanner`); the
  manifest guards against cut writes, not against an author.
"""

import json
import logging
import os
import pickle
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from errors import ConfigError, InputError
from formats import check_format, sha256
from perf.parallel import unwrap
from runtime.distributed import gather_objects, host_group, is_distributed

log = logging.getLogger("mmdit")
# DCP says so at every save and load of one process; that is what `no_dist` asks for, not news
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
MANIFEST = "manifest.json"
STATE = "state.json"
DCP_METADATA = ".metadata"
FORMAT = 2  # state.json's "format": what this version writes and reads


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


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


def broadcast(value, group):
    """Rank 0's value on every rank of `group` (the value itself without a group)."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def gather(records: dict, group) -> dict:
    """Every rank's dict, merged, on every rank."""
    if group is None:
        return dict(records)
    return {name: record for part in gather_objects(records, group) for name, record in part.items()}


def verify(path: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """None if the checkpoint is complete and intact, else the reason it is not. With several ranks, each one
    hashes every `world_size`-th file from its `rank`, so the files are read in parallel."""
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (an interrupted write)"
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
    """Published checkpoint directories, oldest first."""
    root = checkpoint_root(run_dir)
    return sorted(root.glob("step_[0-9]*")) if root.is_dir() else []


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def find_checkpoint(path: Path) -> Path:
    """A checkpoint directory as given, or a run directory's newest complete checkpoint (one process)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        problem = verify(path)
        if problem:
            raise InputError(f"checkpoint {path} is not usable: {problem}")
        return path
    found = next((p for p in reversed(checkpoints(path)) if verify(p) is None), None)
    if found is None:
        raise InputError(f"{path} is neither a checkpoint directory nor a run directory with a complete checkpoint")
    return found


# What DCP's .metadata pickle is made of (torch 2.13's checkpoint/metadata.py and filesystem.py), besides
# torch's dtypes; nothing else may be unpickled from it
METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # how torch pickles a layout (torch.strided)
    "pathlib": {"PosixPath"},  # StorageMeta.checkpoint_id
}
UNTRUSTED = "refused unread: unpickling it could run code its author chose (docs/checkpoints.md)"


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it holds {module}.{name}, which DCP's metadata never does")


class CheckpointReader(dcp.FileSystemReader):
    """DCP's file reader, unpickling `.metadata` with `MetadataUnpickler`; a file that holds anything else is
    refused (an `InputError` naming it) before any of it is built."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as file:
                metadata = MetadataUnpickler(file).load()
        except pickle.UnpicklingError as e:
            raise InputError(f"{path}: {e}; {UNTRUSTED}") from None
        if not isinstance(metadata, Metadata):
            raise InputError(f"{path}: it holds a {type(metadata).__name__}, not DCP's Metadata; {UNTRUSTED}")
        if metadata.storage_meta is None:  # what FileSystemReader.read_metadata does after its pickle.load
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class PlainDataPlanner(DefaultLoadPlanner):
    """DCP's load planner, but a state's non-tensor values (an optimizer's hyperparameters, counters), which DCP
    unpickles with torch.load(weights_only=False), must load with weights_only=True first: plain data only."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise InputError(f"{self.path}: the value of {read_item.dest_index.fqn} is not plain data; "
                             f"{UNTRUSTED}") from None
        value.seek(0)
        super().load_bytes(read_item, value)  # the same bytes, now known to hold plain data


def load_checkpoint(state: dict, path: Path, group=None) -> None:
    """`dcp.load` of `path` into `state` through `CheckpointReader` and `PlainDataPlanner` (on `group`'s ranks,
    or this process alone). A value they refuse is an `InputError`, on every rank, as DCP wraps it."""
    try:
        dcp.load(state, storage_reader=CheckpointReader(path), planner=PlainDataPlanner(path), process_group=group,
                 no_dist=group is None)
    except dcp.CheckpointException as e:
        refused = [error for error, _ in e.failures.values() if isinstance(error, InputError)]
        if refused:
            raise InputError(str(refused[0])) from None
        raise


def read_meta(path: Path) -> dict:
    meta = json.loads((Path(path) / STATE).read_text())
    check_format(meta, FORMAT, f"the checkpoint {path}", "this trainer", "use the version that wrote it")
    return meta


def stored_tensors(path: Path) -> dict[str, set[tuple]]:
    """For each top-level part of a checkpoint, the paths of the tensors it holds, from its metadata alone."""
    metadata = CheckpointReader(path).read_metadata()
    parts: dict[str, set[tuple]] = {}
    for key, item in metadata.state_dict_metadata.items():
        nesting = metadata.planner_data[key]
        parts.setdefault(nesting[0], set())
        if isinstance(item, TensorStorageMetadata):
            parts[nesting[0]].add(tuple(nesting[1:]))
    return parts


def read_checkpoint(path: Path, parts: tuple[str, ...] = ("model", "ema")) -> tuple[dict, dict]:
    """Whole (unsharded) tensors of the given parts of a checkpoint, however many ranks wrote it, and its
    state.json; in this process alone (export, sampling)."""
    path = Path(path)
    meta = read_meta(path)
    metadata = CheckpointReader(path).read_metadata()
    leaves = {metadata.planner_data[key]: torch.empty(item.size, dtype=item.properties.dtype)
              for key, item in metadata.state_dict_metadata.items()
              if isinstance(item, TensorStorageMetadata) and metadata.planner_data[key][0] in parts}
    template = nest(leaves)
    load_checkpoint(template, path)
    return template, meta


def nest(leaves: dict[tuple, object]):
    """{("a", 0, "b"): x} -> {"a": [{"b": x}]}: the structure DCP flattened (lists by position)."""
    if () in leaves:
        return leaves[()]
    children: dict = {}
    for (head, *rest), leaf in leaves.items():
        children.setdefault(head, {})[tuple(rest)] = leaf
    nested = {key: nest(child) for key, child in children.items()}
    return [nested[i] for i in range(len(nested))] if nested and all(isinstance(k, int) for k in nested) else nested


def tensor_paths(tree, prefix: tuple = ()) -> set[tuple]:
    """The paths of the tensors in a state dict, as DCP flattens them."""
    if isinstance(tree, torch.Tensor):
        return {prefix}
    if isinstance(tree, dict):
        return set().union(*[tensor_paths(v, (*prefix, k)) for k, v in tree.items()]) if tree else set()
    if isinstance(tree, (list, tuple)):
        return set().union(*[tensor_paths(v, (*prefix, i)) for i, v in enumerate(tree)]) if tree else set()
    return set()


def local_storage_bytes(tree) -> int:
    """Bytes of the distinct storages behind a state's tensors (a DTensor's local shard): what the stager
    copies to host memory."""
    storages = {}
    for path in tensor_paths(tree):
        tensor = tree
        for key in path:
            tensor = tensor[key]
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def prune_checkpoints(run_dir: Path, keep_last: int, newest: int, companion=None) -> None:
    """Keep the `keep_last` checkpoints up to step `newest` (just completed); delete older ones, and the files of
    `companion` beside them."""
    for old in [p for p in checkpoints(run_dir) if step_of(p) <= newest][:-keep_last]:
        if companion is not None:
            companion.remove(step_of(old))
        trash = old.with_name(f".trash-{old.name}")
        os.rename(old, trash)  # atomic: a kill mid-delete never leaves a half-deleted step_ directory
        shutil.rmtree(trash)


def remove_leftovers(run_dir: Path) -> None:
    """Temporary and half-deleted directories of an earlier process that was killed: never a checkpoint."""
    for path in checkpoint_root(run_dir).glob(".*-step_*"):
        log.info("removing leftover %s", path)
        shutil.rmtree(path, ignore_errors=True)


class CheckpointWriteError(RuntimeError):
    pass


class TrainedWeights:
    """A model's part of a checkpoint: its weights and buffers but for frozen parts that come from elsewhere
    (a pipeline's text encoders), or with `adapters_only` (LoRA) only the trained adapters (the frozen base comes
    from model.init_from). The transformer is kept whole (a full fine-tune's export is the checkpoint's: Qwen-Image's
    last text stream, frozen because nothing uses it, is still a key of its model). Sharded weights are DTensors: each
    rank holds and writes its part."""

    def __init__(self, model: torch.nn.Module, adapters_only: bool = False):
        self.model, self.adapters_only = unwrap(model), adapters_only

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.adapters_only:
            return {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        frozen = {name for name, p in self.model.named_parameters(remove_duplicate=False)
                  if not p.requires_grad and not name.startswith("transformer.")}
        return {name: t for name, t in self.model.state_dict().items() if name not in frozen}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        result = self.model.load_state_dict(state, strict=False)
        if result.unexpected_keys or set(result.missing_keys) & set(self.state_dict()):
            raise InputError(f"weights do not fit the model: missing {result.missing_keys[:5]}, unexpected "
                             f"{result.unexpected_keys[:5]}")


class OptimizerState:
    """The optimizer's part: its state keyed by parameter name, so that it maps onto any sharding. A resume keeps
    today's hyperparameters (betas, eps, weight decay), not the checkpoint's, but for the group values the optimizer
    learns itself (`learned`: prodigy's step-size estimate). A quantized moment (torchao's 8-bit state, a tensor
    subclass DCP cannot store whole) is stored as its inner tensors (codes, scales, code table) and loaded back
    into them: bit for bit."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, learned: tuple[str, ...] = ()):
        self.model, self.optimizer, self.learned = unwrap(model), optimizer, learned

    def state_dict(self) -> dict:
        state = get_optimizer_state_dict(self.model, self.optimizer)
        parts = lambda t: {part: getattr(t, part) for part in t.__tensor_flatten__()[0]}  # the same tensors
        # a quantized moment, not FSDP's DTensor (DCP stores that whole)
        quantized = lambda t: is_traceable_wrapper_subclass(t) and not isinstance(t, DTensor)  # noqa: E731
        # new dicts: the optimizer's state dict holds its own per-parameter dicts
        state["state"] = {name: {key: parts(t) if quantized(t) else t for key, t in values.items()}
                          for name, values in state["state"].items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        live = get_optimizer_state_dict(self.model, self.optimizer)["state"]
        for name, values in state["state"].items():
            for key, parts in values.items():
                if isinstance(parts, dict):  # a quantized moment: its parts into the optimizer's own tensor
                    for part, tensor in parts.items():
                        getattr(live[name][key], part).copy_(tensor)
                    values[key] = live[name][key]
        configured = [{k: v for k, v in group.items() if k != "params" and k not in self.learned}
                      for group in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state)
        for group, settings in zip(self.optimizer.param_groups, configured):
            group.update(settings)


def plain(tree):
    """A state with each tensor subclass that wraps a tensor (float8's weights under FSDP, perf/float8.py) replaced
    by the tensor it wraps, sharing its memory: DCP reads and writes a tensor's storage, which such a wrapper
    lacks (it wrote garbage for them, and would load into nothing)."""
    if isinstance(tree, DTensor):
        local = tree.to_local()
        inner = plain(local)
        return tree if inner is local else DTensor.from_local(inner, tree.device_mesh, tree.placements,
                                                              shape=tree.shape, stride=tree.stride())
    if is_traceable_wrapper_subclass(tree):
        return plain(getattr(tree, tree.__tensor_flatten__()[0][0])).detach()
    if isinstance(tree, dict):
        return {k: plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(plain(v) for v in tree)
    return tree


class PlainTensors:
    """A part of the training state as DCP can store it (`plain`)."""

    def __init__(self, part):
        self.part = part

    def state_dict(self):
        return plain(self.part.state_dict())

    def load_state_dict(self, state) -> None:
        self.part.load_state_dict(state)


class Checkpointer:
    """Cadence, staging, background writing, publishing, verification and resumption of a run's checkpoints.

    `states`: name -> object with `state_dict()` / `load_state_dict()`; `meta`: JSON written to state.json
    (with the step); `files`: name -> text written beside (config.yaml); `companion`: files made from each complete
    checkpoint outside it (a LoRA run's LoRA files): rank 0 calls its `write(path)` once the checkpoint is
    published (in the writer thread with async saves), `ensure(path)` for the checkpoint a run resumes from, and
    `remove(step)` when that checkpoint is pruned. Every rank of the run constructs one and calls every method at
    the same steps."""

    def __init__(self, run_dir: Path, cfg, states: dict, meta: dict, files: dict[str, str], device: torch.device,
                 timeout_s: int = 1800, companion=None):
        self.run_dir, self.every, self.keep_last, self.fail_on_error = (Path(run_dir), cfg.every, cfg.keep_last,
                                                                        cfg.fail_on_error)
        self.states = {name: PlainTensors(part) for name, part in states.items()}
        self.meta, self.files, self.device, self.companion = meta, files, device, companion
        self.group = host_group(timeout_s) if is_distributed() else None  # the writer thread's own collectives
        self.rank = group_rank(self.group)
        cuda = device.type == "cuda"  # pinned buffers and a side stream need an accelerator
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=cuda))
        single_threaded(self.stager._staging_executor)  # its copy thread (torch gives no public handle to it)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint") if cfg.async_save else None
        if self.executor is not None:  # the companion's tensors are made there
            single_threaded(self.executor)
        self.pending: Future | None = None
        self.pending_step = -1
        self.staging: Future | None = None
        self.last_complete: Path | None = None
        self.last_error: str | None = None
        self.last_stall_s = self.last_staging_wait_s = 0.0
        self.staging_bytes = 0

    # ------------------------------------------------------------------------------------------- resume

    def resume(self) -> int:
        """Load the newest intact checkpoint into the states; returns its step (0 when there is none)."""
        if self.rank == 0:
            remove_leftovers(self.run_dir)
        path = self.newest_intact()
        if path is None:
            return 0
        stored = stored_tensors(path)
        parts = {}
        for name, state in self.states.items():
            current = state.state_dict()
            if name not in stored:
                if current:
                    log.warning("%s holds no %s state: it starts fresh", path, name)
                continue
            expected = tensor_paths(current)
            missing, unexpected = expected - stored[name], stored[name] - expected
            if missing or unexpected:
                raise ConfigError(f"{path} holds other {name} state than this run: missing "
                                  f"{sorted(map(dotted, missing))[:5]}, unexpected {sorted(map(dotted, unexpected))[:5]}")
            parts[name] = state
        load_checkpoint(parts, path, self.group)
        meta = read_meta(path)
        self.last_complete = path
        if self.rank == 0:
            self.write_companion(path, self.companion.ensure if self.companion else None)
        log.info("resumed from %s%s", path, f" (written by {meta['strategy']} over {meta['world_size']} process(es))"
                 if "strategy" in meta else "")
        return meta["step"]

    def newest_intact(self) -> Path | None:
        """The newest checkpoint that verifies, from rank 0's listing (a rank's own listing may lag on a network
        filesystem, and all ranks must run the same collectives); every rank hashes a share of its files."""
        world = dist.get_world_size(self.group) if self.group is not None else 1
        candidates = broadcast([str(p) for p in reversed(checkpoints(self.run_dir))], self.group)
        damaged = []
        for path in map(Path, candidates):
            problems = gather({self.rank: verify(path, self.rank, world)}, self.group)
            problem = next((p for p in problems.values() if p), None)
            if problem is None:
                self.set_aside(damaged, path)
                return path
            damaged.append((path, problem))
        if damaged:
            listing = "; ".join(f"{p.name}: {problem}" for p, problem in damaged)
            raise ConfigError(f"no checkpoint in {checkpoint_root(self.run_dir)} is intact ({listing}); nothing was "
                              f"changed. To start over, move that directory away or choose another "
                              f"logging.output_dir")
        return None

    def set_aside(self, damaged: list[tuple[Path, str]], resumed: Path) -> None:
        """Newer checkpoints that failed verification go to checkpoints/damaged/ (never deleted: their data files
        may still be of use), so that this run's own saves of those steps do not meet them."""
        for path, problem in damaged:
            log.warning("checkpoint %s is damaged (%s): resuming from %s instead; it is kept in %s", path.name,
                        problem, resumed.name, checkpoint_root(self.run_dir) / "damaged")
            if self.rank == 0:
                aside = checkpoint_root(self.run_dir) / "damaged" / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
                aside.parent.mkdir(exist_ok=True)
                os.rename(path, aside)
        if self.group is not None:
            dist.barrier(group=self.group)

    # ------------------------------------------------------------------------------------------- save

    def save(self, step: int, last: bool = False) -> None:
        """Save at every `checkpoint.every`-th step, and always when `last`. Snapshot now, write in the background
        (inline when checkpoint.async_save is off); a save still in flight is waited for first."""
        if not last and not (self.every and step % self.every == 0):
            return
        if step == self.pending_step:  # e.g. pre-empted right after the periodic save of the same step
            self.wait()
            if self.last_error is None:
                return
        start = time.perf_counter()
        if self.pending is not None and not self.pending.done():
            self.wait(reason=f"save of step {step} waits for step {self.pending_step} still being written")
        self.report_errors()
        self.pending_step = step
        try:
            tmp = self.prepare(step)
            if tmp is None:  # this step is already saved and intact
                return
            if self.device.type == "cuda":  # the side stream's copies must not overtake the last optimizer kernels
                torch.cuda.current_stream(self.device).synchronize()
            states = {name: state_dict for name, part in self.states.items() if (state_dict := part.state_dict())}
            if not self.staging_bytes:
                self.staging_bytes = local_storage_bytes(states)
                log.info("checkpoint staging: %.1f MiB of host memory per rank (%s, reused by every save)",
                         self.staging_bytes / 2**20, "pinned" if self.device.type == "cuda" else "pageable")
            response = dcp.async_save(states, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                                      process_group=self.group, async_stager=self.stager, no_dist=self.group is None)
        except (Exception, dcp.CheckpointException) as e:  # the same path as a failed background write
            log.error("checkpoint of step %d failed: %s; the last complete checkpoint is %s", step, reason(e),
                      self.last_complete)
            self.pending = Future()
            self.pending.set_exception(e)
            self.report_errors()
            return
        self.staging, upload = response.staging_completion, response.upload_completion  # staged in the background
        meta = json.loads(json.dumps({**self.meta, "step": step, "format": FORMAT}))  # a copy, now
        if self.executor is not None:
            self.pending = self.executor.submit(self.publish, step, tmp, upload, meta, last)
        else:
            self.pending = Future()
            try:
                self.pending.set_result(self.publish(step, tmp, upload, meta, last))
            except (Exception, dcp.CheckpointException) as e:
                self.pending.set_exception(e)
            self.report_errors()
        self.last_stall_s = time.perf_counter() - start

    def prepare(self, step: int) -> Path | None:
        """Rank 0 makes an empty temporary directory (None if this step is already saved and intact); every
        rank learns its decision, so a failure here never leaves one waiting."""
        root = checkpoint_root(self.run_dir)
        final, tmp = root / f"step_{step:08d}", root / f".tmp-step_{step:08d}"
        decision = None
        if self.rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                decision = "keep" if final.exists() and verify(final) is None else "write"
                if decision == "write":
                    shutil.rmtree(tmp, ignore_errors=True)
                    tmp.mkdir()
            except OSError as e:
                decision = f"{type(e).__name__}: {e}"
        decision = broadcast(decision, self.group)
        if decision == "keep":
            self.last_complete = final
            return None
        if decision != "write":
            raise OSError(f"cannot prepare {tmp}: {decision}")
        return tmp

    def wait_for_staging(self, *_) -> None:
        """Block until the background copy to host memory has finished (an optimizer step pre-hook: the step must
        not change weights that are still being copied)."""
        if self.staging is not None:
            start = time.perf_counter()
            self.staging.result()
            self.staging, self.last_staging_wait_s = None, time.perf_counter() - start

    def publish(self, step: int, tmp: Path, upload: Future, meta: dict, last: bool = False) -> Path:
        """After DCP wrote every rank's files: hash them, write state.json, config.yaml and the manifest, rename.
        Every rank learns the outcome, so a failure is one on every rank (`last`: the run's final save, after which
        training does not continue)."""
        try:
            upload.result()  # a rank failing inside DCP fails it on every rank
            try:
                own = {p.name: file_record(p) for p in tmp.iterdir()
                       if p.name.startswith(f"__{self.rank}_") or (self.rank == 0 and p.name == DCP_METADATA)}
            except OSError as e:
                own = {"error": f"rank {self.rank}: {type(e).__name__}: {e}"}
            records = gather(own, self.group)  # every writer hashed its own files, in parallel
            outcome = records.get("error")
            if self.rank == 0 and outcome is None:
                try:
                    self.publish_on_rank_zero(step, tmp, records, meta)
                except Exception as e:
                    outcome = f"{type(e).__name__}: {e}"
            outcome = broadcast(outcome, self.group)
            if outcome is not None:
                raise OSError(f"{tmp}: {outcome}")
        except (Exception, dcp.CheckpointException) as e:  # DCP's own is a BaseException
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            log.error("checkpoint of step %d into %s failed: %s; the last complete checkpoint is %s%s", step,
                      tmp.parent, reason(e), self.last_complete,
                      "" if self.fail_on_error or last else "; training continues")
            raise
        final = tmp.with_name(f"step_{step:08d}")
        log.info("checkpoint %s complete", final)
        return final

    def publish_on_rank_zero(self, step: int, tmp: Path, records: dict, meta: dict) -> None:
        for name, text in {STATE: json.dumps(meta, indent=1), **self.files}.items():
            (tmp / name).write_text(text)
            fsync_path(tmp / name)
            records[name] = file_record(tmp / name)
        found = sorted(p.name for p in tmp.iterdir())
        if found != sorted(records):
            raise RuntimeError(f"{tmp} holds {found}, the writers reported {sorted(records)}")
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": records}, indent=1))
        fsync_path(tmp / MANIFEST)
        fsync_path(tmp)  # the directory entries themselves, before the rename publishes them
        final = tmp.with_name(f"step_{step:08d}")
        if final.exists():  # an invalid leftover of this step: replaced only now that the new one is complete
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(tmp.parent)
        self.write_companion(final, self.companion.write if self.companion else None)
        try:
            prune_checkpoints(self.run_dir, self.keep_last, newest=step, companion=self.companion)
        except OSError as e:  # the new checkpoint is complete; old ones linger until the next save
            log.warning("could not delete old checkpoints in %s: %s", tmp.parent, e)

    @staticmethod
    def write_companion(path: Path, write) -> None:
        """`write(path)` (if any) for a complete checkpoint: whatever fails there, the checkpoint stays complete."""
        if write is None:
            return
        try:
            write(path)
        except Exception:
            log.exception("the files made from %s were not written (the checkpoint is complete)", path)

    def report_errors(self) -> None:
        """Take the outcome of a finished save, once: raise a failure when checkpoint.fail_on_error, else log it.
        Called where every rank is at the same step (a save, the end), so that all ranks stop together."""
        if self.pending is None or not self.pending.done():
            return
        future, self.pending = self.pending, None
        error = future.exception()
        if error is None:
            self.last_complete, self.last_error = future.result(), None
            return
        self.last_error = (f"checkpoint of step {self.pending_step} into {checkpoint_root(self.run_dir)} failed: "
                           f"{reason(error)}")  # logged where it failed
        if self.fail_on_error:
            raise CheckpointWriteError(self.last_error) from error

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

    def metrics(self) -> dict[str, float]:
        return {"checkpoint/stall_s": self.last_stall_s, "checkpoint/staging_wait_s": self.last_staging_wait_s,
                "checkpoint/staging_gib": self.staging_bytes / 2**30}

    @contextmanager
    def closed_on_error(self):
        """Close this checkpointer if the block fails: its staging and writer threads end with the run."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Wait for the save in flight (its outcome is reported) and release the staging buffers."""
        try:
            self.wait()
        finally:
            if self.executor is not None:
                self.executor.shutdown(wait=True)
            self.stager.close()


def single_threaded(executor: ThreadPoolExecutor) -> None:
    """Make torch run on one thread in the executor's thread. A host-to-host copy there would otherwise start a
    second OpenMP team that lives as long as the thread; libgomp then manages more threads than there are cores
    and stops spinning between parallel regions, so every small op of the training thread pays a wake-up (the
    default run trained 35 % slower after its first save). torch's DataLoader does the same in its pin-memory
    thread. `torch.set_num_threads` also sets the count that threads started later begin with: that is put
    back to the training thread's."""
    def one_thread():
        torch.get_num_threads()  # ATen sets a thread's count up on its first use, from that shared count: now
        torch.set_num_threads(1)

    threads = torch.get_num_threads()
    executor.submit(one_thread).result()
    torch.set_num_threads(threads)


def reason(error: BaseException) -> str:
    """An error in one line; DCP's CheckpointException (whose text holds every failed rank's traceback) as the
    error of each rank that failed. An error raised while handling an OSError comes after that OSError, the
    reason: on a full disk torch.save's writer fails with "unexpected pos 704 vs 598" during the write's ENOSPC."""
    if isinstance(error, dcp.CheckpointException):
        return "; ".join(f"rank {rank}: {reason(e)}" for rank, (e, _) in sorted(error.failures.items()))
    text, cause, seen = f"{type(error).__name__}: {error}", error, set()
    while cause is not None and not isinstance(cause, OSError) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if not isinstance(cause, OSError) or cause is error:
        return text
    return f"{type(cause).__name__}: {cause} (then {text})"


def dotted(path: tuple) -> str:
    return ".".join(map(str, path))
