"""Scheduled torch.profiler: traces for TensorBoard's PyTorch Profiler tab (and Perfetto), one worker name per
rank, in the run's TensorBoard folder. It stops itself after its schedule; when off, no profiler exists.

With `profiler.memory_snapshot` on CUDA, the allocator's history over the profiled steps is dumped as a
pickle for https://pytorch.org/memory_viz when they end, or earlier if an out-of-memory error ends them.

A trace or snapshot that cannot be written (a full disk) is a warning, and training goes on (runtime/outputs.py).
"""

import logging
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from omegaconf import DictConfig

from runtime.outputs import Output

log = logging.getLogger("mmdit")


class Off(nullcontext):
    def step(self) -> None:
        pass


class ScheduledProfiler:
    def __init__(self, cfg: DictConfig, trace_dir: Path, rank: int, device: torch.device):
        active_steps = cfg.active_steps
        self.trace_dir, self.rank = trace_dir, rank
        self.traces, self.snapshots = Output("profiler trace"), Output("CUDA memory snapshot")
        self.steps_left = cfg.skip_first + (cfg.wait + cfg.warmup + active_steps) * cfg.repeat
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cfg.cuda and device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.snapshot = cfg.memory_snapshot and device.type == "cuda"
        if cfg.memory_snapshot and not self.snapshot:
            log.warning("profiler.memory_snapshot needs a CUDA device; no snapshot on %s", device)
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(skip_first=cfg.skip_first, wait=cfg.wait, warmup=cfg.warmup,
                                             active=active_steps, repeat=cfg.repeat),
            on_trace_ready=self.write_trace,
            record_shapes=cfg.record_shapes, profile_memory=cfg.profile_memory, with_stack=cfg.with_stack)
        log.info("profiling %d cycle(s) of %d steps after %d steps into %s (profiling slows those steps)",
                 cfg.repeat, active_steps, cfg.skip_first + cfg.wait + cfg.warmup, trace_dir)

    def __enter__(self):
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.profiler.start()
        return self

    def step(self) -> None:
        """Once per optimizer step; the last step of the schedule writes the trace and stops the profiler."""
        if self.steps_left <= 0:
            return
        self.profiler.step()
        self.steps_left -= 1
        if self.steps_left == 0:
            self.stop()

    def stop(self, reason: str = "profiled steps") -> None:
        self.profiler.stop()
        self.dump_memory_snapshot(reason)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot = False
        log.info("profiler finished: traces in %s", self.trace_dir)

    def write_trace(self, profiler) -> None:
        """What torch's tensorboard_trace_handler does (the file names TensorBoard's profiler tab reads), but a
        failed write is reported: torch's exporter logs one and returns, and a folder it cannot create is a
        RuntimeError."""
        path = self.trace_dir / f"rank{self.rank}.{time.time_ns()}.pt.trace.json"
        self.traces.write(path, export_trace, profiler, path, partial=(path, path.with_name(f"{path.name}.tmp")))

    def dump_memory_snapshot(self, reason: str) -> None:
        if not self.snapshot:
            return
        path = self.trace_dir / f"memory_snapshot_rank{self.rank}.pickle"

        def dump() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
        if self.snapshots.write(path, dump, partial=(path,)):
            log.info("CUDA memory snapshot (%s) in %s: open it at https://pytorch.org/memory_viz", reason, path)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.steps_left > 0:  # the run ended inside the schedule: keep what was recorded
            self.steps_left = 0
            self.stop("out of memory" if isinstance(exc, torch.OutOfMemoryError) else "run ended")


def export_trace(profiler, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(path))
    if not path.is_file():  # the exporter (kineto) wrote part of it to PATH.tmp and logged that it failed
        raise OSError(f"the profiler's export failed; {shutil.disk_usage(path.parent).free / 2**20:.0f} MiB free "
                      f"there")


def build_profiler(cfg: DictConfig, trace_dir: Path, rank: int, device: torch.device):
    """A context whose `.step()` is called once per optimizer step; a no-op when `cfg.enabled` is off."""
    return ScheduledProfiler(cfg, trace_dir, rank, device) if cfg.enabled else Off()
