"""Scheduled torch.profiler: traces for TensorBoard's PyTorch Profiler tab, one worker name per rank."""

import logging
from contextlib import nullcontext
from pathlib import Path

import torch

log = logging.getLogger("mmdit")


class _Off(nullcontext):
    def step(self) -> None:
        pass


def build_profiler(enabled: bool, active_steps: int, trace_dir: Path, rank: int):
    """A context whose `.step()` is called once per optimizer step; a no-op when disabled."""
    if not enabled:
        return _Off()
    log.info("profiling %d steps into %s (profiling slows training)", active_steps, trace_dir)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=active_steps, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{rank}"),
        record_shapes=True, profile_memory=True)
