"""OOM-aware micro-batch sizer: split, don't shrink.

The samples of an optimizer step are fixed (the global batch and its noise are functions of the step), so
on out-of-memory the sizer halves the micro-batch and re-runs the same step's data as more micro-steps;
the result equals the unsplit step up to fp32 summation order. After `grow_after` clean steps it tries
twice the size again (up to the configured one); a size that failed waits `retry_after` steps.

Every rank must take the same decision without ever waiting in a collective that a failed rank will not
join. The ranks agree on "did anyone run out of memory?" at agreement points (a small all-reduce on a gloo
group of its own, so it never syncs the GPU): one at the end of each step, and one in the handler of a rank
that failed, which stands in for the next agreement point that rank would have reached.

- DDP: a step runs all its micro-steps under `no_sync` (no collective at all), the ranks agree, and only
  then are the gradients all-reduced. The price: gradient communication no longer overlaps the backward.
- FSDP/HSDP: the forward and backward are full of collectives (an all-gather before each block, a
  reduce-scatter after each block's backward), so every one of them gets an agreement point right before
  it: FSDP's custom-communication hook allocates each collective's buffer, then agrees, then lets the
  collective run. A rank that fails anywhere in between (compute, or the buffer itself) reaches no further
  collective; the others stop at their next agreement point. Every rank then resets FSDP's iteration state
  (`reset_iter_state`), drops the step's gradients and retries with half the micro-batch. The price: one
  small all-reduce per FSDP collective while the sizer is on.
"""

import gc
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from perf.parallel import is_sharded, unwrap
from runtime.distributed import host_group, is_distributed
from runtime.step_stats import memory_stats

log = logging.getLogger("mmdit")


# Out-of-memory errors that are not torch.OutOfMemoryError: allocations outside the caching allocator (cuBLAS
# and cuDNN workspaces, NCCL buffers, the CUDA runtime) fail with a RuntimeError that names them.
OUT_OF_MEMORY_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                          "cudaErrorMemoryAllocation")


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and any(m in str(error) for m in OUT_OF_MEMORY_MESSAGES))


class OutOfMemoryAtMicroBatchOne(RuntimeError):
    pass


class AgreedOutOfMemory(torch.OutOfMemoryError):
    """Raised at an agreement point on every rank once any rank ran out of memory: all ranks know."""


@dataclass
class OOMInjector:
    """Debug fault injection: a real torch.OutOfMemoryError when a micro-batch is larger than `above`, on
    `ranks` (all if empty) at `steps` (all if empty), in the forward or inside the backward pass of the
    module it hooks."""
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

    def __call__(self, module, args, output) -> None:
        """A forward hook: raises now (forward) or from autograd once the backward reaches this module's
        output (backward), after the forward's activations were allocated."""
        output = output[0] if isinstance(output, tuple) else output
        size = output.shape[0]
        if not module.training or not self.armed(self.step, size):  # training steps only, not sampling
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


class Agreement:
    """The ranks' shared answer to "did anyone run out of memory?", over a gloo group of its own (host
    tensors: no GPU sync, no interference with the training collectives)."""

    def __init__(self, timeout_s: int):
        self.group = host_group(timeout_s) if is_distributed() else None
        self.rank = dist.get_rank() if self.group is not None else 0
        self.world_size = dist.get_world_size() if self.group is not None else 1

    def failed_ranks(self, failed: bool) -> list[int]:
        if self.group is None:
            return [0] if failed else []
        flags = torch.zeros(self.world_size)
        flags[self.rank] = float(failed)
        dist.all_reduce(flags, group=self.group)
        return flags.nonzero().flatten().tolist()

    def allocate(self, allocate, *args, **kwargs) -> torch.Tensor:
        """An FSDP collective's buffer, then agreement: the collective runs only if no rank has failed."""
        error = None
        try:
            buffer = allocate(*args, **kwargs)
        except RuntimeError as e:
            if not is_out_of_memory(e):
                raise
            error = e
        failed = self.failed_ranks(error is not None)
        if failed:
            raise AgreedOutOfMemory(f"{str(error).splitlines()[0]}" if error else f"rank(s) {failed} ran out of "
                                    f"memory") from error
        return buffer


class AgreeingAllocation:
    """Mixed into FSDP's default collectives (before them): their buffers allocated through the agreement."""

    def __init__(self, agreement: Agreement):
        self.agreement = agreement

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return self.agreement.allocate(super().allocate, size, dtype=dtype, device=device)


class AgreeingAllGather(AgreeingAllocation, DefaultAllGather):
    pass


class AgreeingReduceScatter(AgreeingAllocation, DefaultReduceScatter):
    pass


class BatchSizer:
    def __init__(self, cfg: DictConfig, max_micro_batch: int, device: torch.device, injector: OOMInjector,
                 agreement: Agreement, sharded: bool, bucket_mb: float):
        self.max, self.device, self.injector, self.agreement, self.sharded = (max_micro_batch, device, injector,
                                                                              agreement, sharded)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.grow_after, self.retry_after = cfg.grow_after, cfg.retry_after
        self.micro_batch = max_micro_batch
        self.clean_steps = 0
        self.failed_at: dict[int, int] = {}  # micro-batch size -> step of its last failure
        self.oom_events = 0
        log.info("OOM-aware batch sizer: micro-batch %d, halved on out-of-memory, regrown after %d clean steps%s",
                 max_micro_batch, self.grow_after, f"; {injector}" if injector.above >= 0 else "")

    def run(self, step: int, step_fn, model, sigma_losses) -> torch.Tensor:
        """Loss of the step, with gradients in place (reduced over ranks). `step_fn(micro_batch, sync)`.
        A failed attempt's contribution to `sigma_losses` is rolled back on every rank."""
        self.maybe_grow(step)
        self.injector.step = step
        while True:
            error, agreed, before = None, False, sigma_losses.state()
            try:  # FSDP reduces as it goes; DDP's reduction waits for the agreement below
                loss = step_fn(self.micro_batch, self.sharded)
            except RuntimeError as e:  # only out of memory: any other error stops the run
                if not is_out_of_memory(e):
                    raise
                error, agreed = f"{e}".split("\n")[0], isinstance(e, AgreedOutOfMemory)
            failed = agreed or bool(self.agreement.failed_ranks(error is not None))
            if not failed:
                if not self.sharded:
                    all_reduce_gradients(model, self.bucket_bytes)
                self.clean_steps += 1
                return loss
            sigma_losses.restore(before)
            self.release(model)  # outside the except block, so the failed attempt's frames are gone
            self.shrink(step, error)

    def release(self, model) -> None:
        """Forget the failed attempt: FSDP's iteration state, and its half-accumulated gradients."""
        if self.sharded:
            model.reset_iter_state()
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    clear_unsharded_gradients(module)
        for p in unwrap(model).parameters():
            p.grad = None
        gc.collect()
        if self.device.type == "cuda":  # kernels queued before the failure may still use the memory
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def shrink(self, step: int, error: str | None) -> None:
        self.oom_events += 1
        if self.micro_batch == 1:
            raise OutOfMemoryAtMicroBatchOne(
                f"out of memory at step {step} even with micro-batch 1 ({error or 'on another rank'}); "
                f"{memory_figures(self.device)}. Reduce the model, the resolution or the precision "
                f"(training.dtype=bf16), or set training.activation_checkpointing=selective or full")
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


def clear_unsharded_gradients(module: FSDPModule) -> None:
    """Gradients autograd left on a block's gathered weights when the backward stopped before FSDP took them
    (its post-backward never ran): `reset_iter_state` frees the gathered weights but not these, and the next
    backward would add to them."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            if hasattr(fsdp_param, "_unsharded_param"):
                fsdp_param._unsharded_param.grad = None
            fsdp_param.unsharded_accumulated_grad = None


def all_reduce_gradients(model, bucket_bytes: int) -> None:
    """The mean gradient over ranks, as DDP's own reduction gives it: the gradients flattened into buckets of
    about `bucket_bytes` (parallel.ddp_bucket_cap_mb), one all-reduce per bucket, two buckets in flight."""
    if not is_distributed():
        return
    params = [p for p in unwrap(model).parameters() if p.requires_grad]
    for p in params:  # the same collectives on every rank, even if a parameter got no gradient
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    in_flight = []
    for bucket in gradient_buckets([p.grad for p in params], bucket_bytes):
        flat = torch.cat([g.flatten() for g in bucket]).div_(dist.get_world_size())  # before the sum, as DDP does
        in_flight.append((dist.all_reduce(flat, async_op=True), flat, bucket))
        if len(in_flight) > 1:
            copy_back(*in_flight.pop(0))
    for work in in_flight:
        copy_back(*work)


def gradient_buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype, up to `bucket_bytes` each (a larger gradient is a bucket alone)."""
    buckets, size = [], 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if not buckets or size + nbytes > bucket_bytes or buckets[-1][0].dtype != grad.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    return buckets


def copy_back(work, flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
    work.wait()
    torch._foreach_copy_(bucket, [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in bucket]), bucket)])


def memory_figures(device: torch.device) -> str:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return (f"GPU memory: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB allocated, "
                f"{torch.cuda.memory_reserved(device) / 2**30:.2f} GiB reserved, {free / 2**30:.2f} GiB free "
                f"of {total / 2**30:.2f} GiB")
    stats = memory_stats(device)
    return f"process memory: {stats['memory/rss_gib']:.2f} GiB resident, peak {stats['memory/peak_rss_gib']:.2f} GiB"


def build_batch_sizer(cfg: DictConfig, micro_batch: int, device: torch.device, rank: int, model):
    """The sizer, after the model is wrapped or sharded (it hooks FSDP's collectives); a fixed micro-batch
    when off, with nothing installed."""
    s = cfg.batch_sizer
    if not s.enabled:
        return FixedMicroBatch(micro_batch)
    agreement, sharded = Agreement(cfg.parallel.timeout_s), is_sharded(model)
    if sharded:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(AgreeingAllGather(agreement))
                module.set_custom_reduce_scatter(AgreeingReduceScatter(agreement))
    injector = OOMInjector(s.debug_oom_above, list(s.debug_oom_ranks), list(s.debug_oom_steps), s.debug_oom_phase,
                           rank)
    if injector.above >= 0:
        unwrap(model).get_submodule(s.debug_oom_module).register_forward_hook(injector)
    return BatchSizer(s, micro_batch, device, injector, agreement, sharded, cfg.parallel.ddp_bucket_cap_mb)
