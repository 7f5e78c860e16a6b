"""OOM-aware micro-batch sizer: split, don't shrink.

The samples of an optimizer step are fixed (the global batch and its noise are functions of the step), so
on out-of-memory the sizer halves the micro-batch and re-runs the same step's data as more micro-steps;
the result equals the unsplit step up to fp32 summation order. After `grow_after` clean steps it tries
twice the size again (up to the configured one); a size that failed waits `retry_after` steps.

Under DDP every rank must take the same decision: a step runs all its micro-steps under `no_sync` (no
collective at all), then the ranks agree on "did anyone run out of memory?" with one all-reduce, and only
then all-reduce the gradients. A rank that fails in forward or backward therefore never leaves another rank
waiting in a collective. The price: gradient communication no longer overlaps the backward pass.
"""

import gc
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from perf.distributed import is_distributed, unwrap
from perf.step_stats import memory_stats

log = logging.getLogger("mmdit")


class OutOfMemoryAtMicroBatchOne(RuntimeError):
    pass


@dataclass
class OOMInjector:
    """Debug fault injection: a real torch.OutOfMemoryError when a micro-batch is larger than `above`, on
    `ranks` (all if empty) at `steps` (all if empty), in the forward or inside the backward pass."""
    above: int = -1  # -1: off; 0 fails every size
    ranks: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    phase: str = "forward"
    rank: int = 0
    step: int = -1  # set by the sizer before each attempt

    def armed(self, step: int, size: int) -> bool:
        return (0 <= self.above < size and (not self.ranks or self.rank in self.ranks)
                and (not self.steps or step in self.steps))

    def error(self, step: int, size: int) -> torch.OutOfMemoryError:
        return torch.OutOfMemoryError(f"injected out-of-memory (batch_sizer.debug_oom_*): micro-batch {size} "
                                      f"> {self.above} at step {step} on rank {self.rank}, {self.phase}")

    def __call__(self, module, args, output: torch.Tensor) -> None:
        """A forward hook on the model: raises now (forward) or from autograd once the backward reaches the
        output (backward), after the forward's activations were allocated."""
        size = output.shape[0]
        if not self.armed(self.step, size):
            return
        error = self.error(self.step, size)
        if self.phase == "forward":
            raise error

        def fail(grad):
            raise error
        output.register_hook(fail)


class FixedMicroBatch:
    """The sizer when off: the configured micro-batch, DDP synchronising as usual."""

    def __init__(self, micro_batch: int):
        self.micro_batch = micro_batch

    def run(self, step: int, step_fn, model, sigma_losses) -> torch.Tensor:
        return step_fn(self.micro_batch, True)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def metrics(self) -> dict:
        return {}


class BatchSizer:
    def __init__(self, cfg: DictConfig, max_micro_batch: int, device: torch.device, injector: OOMInjector):
        self.max, self.device, self.injector = max_micro_batch, device, injector
        self.grow_after, self.retry_after = cfg.grow_after, cfg.retry_after
        self.micro_batch = max_micro_batch
        self.clean_steps = 0
        self.failed_at: dict[int, int] = {}  # micro-batch size -> step of its last failure
        self.oom_events = 0
        log.info("OOM-aware batch sizer: micro-batch %d, halved on out-of-memory, regrown after %d clean steps%s",
                 max_micro_batch, self.grow_after, f"; {injector}" if injector.above >= 0 else "")

    def run(self, step: int, step_fn, model, sigma_losses) -> torch.Tensor:
        """Loss of the step, with gradients in place (all-reduced under DDP). `step_fn(micro_batch, sync)`.
        A failed attempt's contribution to `sigma_losses` is rolled back on every rank."""
        self.maybe_grow(step)
        self.injector.step = step
        while True:
            error, before = None, sigma_losses.state()
            try:
                loss = step_fn(self.micro_batch, False)
            except torch.OutOfMemoryError as e:  # only OOM: any other error stops the run
                error = f"{e}".split("\n")[0]
            failed = self.any_rank(error is not None)
            if not failed:
                all_reduce_gradients(model)
                self.clean_steps += 1
                return loss
            sigma_losses.restore(before)
            self.release(model)  # outside the except block, so the failed attempt's frames are gone
            self.shrink(step, error)

    def any_rank(self, failed: bool) -> bool:
        if not is_distributed():
            return failed
        flag = torch.tensor([float(failed)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def release(self, model) -> None:
        for p in unwrap(model).parameters():
            p.grad = None  # half-accumulated gradients of the failed attempt
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def shrink(self, step: int, error: str | None) -> None:
        self.oom_events += 1
        if self.micro_batch == 1:
            raise OutOfMemoryAtMicroBatchOne(
                f"out of memory at step {step} even with micro-batch 1 ({error or 'on another rank'}); "
                f"{memory_figures(self.device)}. Reduce the model, the resolution or the precision "
                f"(training.dtype=bf16), or enable training.activation_checkpointing")
        self.failed_at[self.micro_batch] = step
        smaller = self.micro_batch // 2
        log.warning("step %d: out of memory at micro-batch %d (%s); retrying the same samples as micro-batches "
                    "of %d", step, self.micro_batch, error or "on another rank", smaller)
        self.micro_batch, self.clean_steps = smaller, 0

    def maybe_grow(self, step: int) -> None:
        if self.micro_batch >= self.max or self.clean_steps < self.grow_after:
            return
        larger = min(self.micro_batch * 2, self.max)
        if step - self.failed_at.get(larger, -self.retry_after) < self.retry_after:
            return
        log.info("step %d: %d clean steps, trying micro-batch %d", step, self.clean_steps, larger)
        self.micro_batch, self.clean_steps = larger, 0

    def state_dict(self) -> dict:
        return {"micro_batch": self.micro_batch, "clean_steps": self.clean_steps, "oom_events": self.oom_events,
                "failed_at": {str(k): v for k, v in self.failed_at.items()}}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.micro_batch = min(state["micro_batch"], self.max)
        self.clean_steps, self.oom_events = state["clean_steps"], state["oom_events"]
        self.failed_at = {int(k): v for k, v in state["failed_at"].items()}

    def metrics(self) -> dict:
        return {"micro_batch": self.micro_batch, "oom_events": self.oom_events}


def all_reduce_gradients(model) -> None:
    """The mean gradient over ranks, as DDP's own reduction would give it."""
    if not is_distributed():
        return
    params = [p for p in unwrap(model).parameters() if p.requires_grad]
    for p in params:  # the same list of collectives on every rank, even if a parameter got no gradient
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    torch._foreach_div_(grads, dist.get_world_size())  # before the sum, as DDP's default hook does
    for work in [dist.all_reduce(g, async_op=True) for g in grads]:
        work.wait()


def memory_figures(device: torch.device) -> str:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return (f"GPU memory: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB allocated, "
                f"{torch.cuda.memory_reserved(device) / 2**30:.2f} GiB reserved, {free / 2**30:.2f} GiB free "
                f"of {total / 2**30:.2f} GiB")
    stats = memory_stats(device)
    return f"process memory: {stats['memory/rss_gib']:.2f} GiB resident, peak {stats['memory/peak_rss_gib']:.2f} GiB"


def build_batch_sizer(cfg: DictConfig, micro_batch: int, device: torch.device, rank: int, model):
    s = cfg.batch_sizer
    if not s.enabled:
        return FixedMicroBatch(micro_batch)
    injector = OOMInjector(s.debug_oom_above, list(s.debug_oom_ranks), list(s.debug_oom_steps), s.debug_oom_phase,
                           rank)
    if injector.above >= 0:
        unwrap(model).register_forward_hook(injector)
    return BatchSizer(s, micro_batch, device, injector)
