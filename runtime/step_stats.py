"""What a training step costs and achieves: time per phase, memory, FLOPs and MFU, and the loss by noise level.

Everything here accumulates on the device between log steps and is read only when a metrics line is
written, so it adds no host synchronisation to the steps in between.
"""

import logging
import re
import resource
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from models.attention import math_attention, use_attention
from runtime.distributed import is_distributed

log = logging.getLogger("mmdit")

# Dense peak TFLOP/s of known GPUs (bf16/fp16 tensor cores with fp32 accumulation; TF32 for fp32 when TF32 is
# allowed; else plain fp32), from NVIDIA's datasheets (sparse figures halved). The first name that appears in
# the device's name as whole words wins, so the more specific names come first.
PEAK_TFLOPS = [  # (name, (bf16, tf32, fp32))
    ("GB200", (2500.0, 1250.0, 80.0)), ("B200", (2250.0, 1125.0, 75.0)),
    ("H200 NVL", (835.5, 417.5, 60.0)), ("H200", (989.4, 494.7, 66.9)),
    ("H100 PCIe", (756.0, 378.0, 51.2)), ("H100 NVL", (835.5, 417.5, 60.0)),
    ("H100", (989.4, 494.7, 66.9)),  # SXM, which reports itself as "NVIDIA H100 80GB HBM3"
    ("H800 PCIe", (756.0, 378.0, 51.2)), ("H800", (989.4, 494.7, 66.9)),
    ("A100", (312.0, 156.0, 19.5)), ("A800", (312.0, 156.0, 19.5)),  # 40 and 80 GB, SXM and PCIe alike
    ("L40S", (362.1, 183.0, 91.6)), ("L4", (121.0, 60.0, 30.3)), ("A10G", (70.0, 35.0, 31.2)),
    ("RTX 4090", (165.2, 82.6, 82.6)), ("V100", (125.0, 15.7, 15.7)),
]


def known_peak_tflops(name: str, dtype: str, allow_tf32: bool) -> float | None:
    """The dense peak of a GPU by its name (`torch.cuda.get_device_name`), or None for one not in the table."""
    for fragment, (half, tf32, fp32) in PEAK_TFLOPS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(fragment)}(?![A-Za-z0-9])", name):
            return half if dtype != "fp32" else tf32 if allow_tf32 else fp32
    return None


class SigmaBuckets:
    """Mean loss per noise-level bucket of σ in [0, 1]: which noise levels the model struggles with; and, for a
    mixture of datasets (`datasets`: their names), per dataset (the loss before its loss weight)."""

    def __init__(self, device: torch.device, count: int = 4, datasets: tuple[str, ...] = ()):
        self.count, self.datasets = count, tuple(datasets)
        self.sums = torch.zeros(count + len(self.datasets), device=device)
        self.samples = torch.zeros(count + len(self.datasets), device=device)

    def add(self, sigma: torch.Tensor, per_sample_loss: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        bucket = (sigma.detach() * self.count).long().clamp(0, self.count - 1)
        if self.datasets and sources is not None:
            bucket = torch.cat([bucket, self.count + sources.to(bucket.device)])
            per_sample_loss = per_sample_loss.repeat(2)
        self.sums.index_add_(0, bucket, per_sample_loss.detach().float())
        self.samples.index_add_(0, bucket, torch.ones_like(self.samples[bucket]))

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sums.clone(), self.samples.clone()

    def restore(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.sums.copy_(state[0])
        self.samples.copy_(state[1])

    def metrics(self) -> dict[str, float]:
        """Means since the last read, over all ranks; resets."""
        totals = torch.stack([self.sums, self.samples])
        if is_distributed():
            dist.all_reduce(totals)
        self.sums.zero_()
        self.samples.zero_()
        sums, samples = totals.tolist()
        names = [f"loss_by_sigma/{i / self.count:.2f}-{(i + 1) / self.count:.2f}" for i in range(self.count)]
        names += [f"loss_by_dataset/{name}" for name in self.datasets]
        return {name: s / n for name, s, n in zip(names, sums, samples) if n}


class StepTimer:
    """Seconds per step in each phase. On CUDA the phases are timed by events on the GPU's timeline (read
    when logging, so no sync per step): "data" there is GPU time lost waiting for the next batch."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.steps = 0
        self.last = self.now()

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self, phase: str) -> None:
        now = self.now()
        if self.cuda:
            self.events.append((phase, self.last, now))
        else:
            self.totals[phase] += now - self.last
        self.last = now
        self.steps += phase == "data"

    def metrics(self) -> dict[str, float]:
        """Mean seconds per step of each phase since the last read; resets."""
        if self.events:
            self.events[-1][2].synchronize()
        for phase, start, end in self.events:
            self.totals[phase] += start.elapsed_time(end) / 1000
        steps = max(self.steps, 1)
        out = {f"time/{phase}_s": total / steps for phase, total in self.totals.items()}
        out["time/step_s"] = sum(self.totals.values()) / steps
        self.totals, self.events, self.steps = defaultdict(float), [], 0
        return out


def memory_stats(device: torch.device) -> dict[str, float]:
    """CUDA allocator figures on GPUs (peak since the last read); process RSS on the CPU."""
    if device.type == "cuda":
        stats = {"memory/allocated_gib": torch.cuda.memory_allocated(device) / 2**30,
                 "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                 "memory/reserved_gib": torch.cuda.memory_reserved(device) / 2**30}
        torch.cuda.reset_peak_memory_stats(device)
        return stats
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {"memory/rss_gib": rss_pages * resource.getpagesize() / 2**30,
            "memory/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def train_flops_per_sample(build, sample_inputs) -> int:
    """FLOPs of one sample's forward and backward, counted with torch's flop formulas on a meta-device copy of
    the model: no memory, no compute. Attention is counted as the math formula's two matmuls whatever kernel
    trains (the counter sees no FLOPs in flash-attn's custom ops, nor in the CPU SDPA kernel)."""
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        model = use_attention(build(), math_attention)
        inputs = sample_inputs()
    counter = TrainingFlops()
    with counter:
        loss = model(*inputs).float().sum()
    if counter.unknown:  # an op whose backward is not derived here: run the backward and count it
        with FlopCounterMode(display=False) as full:
            model(*inputs).float().sum().backward()
        return full.get_total_flops()
    del loss
    return counter.total


# The products of the ops torch counts FLOPs of, by the positions of their two factors. The backward of a product
# makes one product of the same size for each factor that requires a gradient (grad_a = grad_out @ b^T,
# grad_b = a^T @ grad_out; a convolution's grad_input and grad_weight likewise), so a forward predicts it.
FACTORS = {torch.ops.aten.mm: (0, 1), torch.ops.aten.bmm: (0, 1), torch.ops.aten.addmm: (1, 2),
           torch.ops.aten.baddbmm: (1, 2), torch.ops.aten.convolution: (0, 1)}


class TrainingFlops(TorchDispatchMode):
    """The forward's FLOPs by torch's formulas, and the backward's predicted from them without running it (the
    backward on the meta device was 60 % of the count's time). `unknown` is set by a counted op outside FACTORS."""

    def __init__(self):
        super().__init__()
        self.total, self.unknown = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            factors = FACTORS.get(func._overloadpacket)
            self.unknown |= factors is None
            gradients = sum(args[i].requires_grad for i in factors or ())
            self.total += formula(*args, **(kwargs or {}), out_val=out) * (1 + gradients)
        return out


class Throughput:
    """Samples and tokens per second (in all and per rank), achieved TFLOP/s per rank where the FLOPs per sample
    are known, and MFU where the device's peak is known too, from optimizer steps per second."""

    def __init__(self, samples_per_step: int, world_size: int, tokens_per_sample: int, flops_per_sample: int | None,
                 peak: float | None):
        self.samples_per_step, self.world_size, self.tokens_per_sample = samples_per_step, world_size, tokens_per_sample
        self.flops_per_sample, self.peak = flops_per_sample, peak

    def __call__(self, steps_per_s: float) -> dict[str, float]:
        samples_per_s = steps_per_s * self.samples_per_step
        per_rank = samples_per_s / self.world_size
        out = {"samples_per_s": samples_per_s, "samples_per_s_per_rank": per_rank,
               "tokens_per_s": samples_per_s * self.tokens_per_sample,
               "tokens_per_s_per_rank": per_rank * self.tokens_per_sample}
        if self.flops_per_sample is not None:
            out["tflops_per_s_per_rank"] = per_rank * self.flops_per_sample / 1e12
            if self.peak:
                out["mfu"] = per_rank * self.flops_per_sample / self.peak
        return out


def peak_flops(device: torch.device, dtype: str, allow_tf32: bool, configured_tflops: float) -> float | None:
    """FLOP/s that MFU divides by: the configured figure, else a known GPU's dense peak, else None (said once)."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    tflops = known_peak_tflops(name, dtype, allow_tf32)
    if tflops is None:
        log.info("MFU is not reported: the peak FLOP/s of %s is not known here; set logging.peak_tflops to its "
                 "dense peak for %s", name, dtype)
        return None
    return tflops * 1e12


class MemoryStats:
    """Device memory (or process RSS on the CPU) and the training state this rank holds."""

    def __init__(self, device: torch.device, model, optimizer, ema):
        self.device, self.model, self.optimizer, self.ema = device, model, optimizer, ema
        self.state_gib = None  # constant once the optimizer has made its state (after the first step)

    def metrics(self) -> dict[str, float]:
        if self.state_gib is None:
            self.state_gib = train_state_gib(self.model, self.optimizer, self.ema)
        return {**memory_stats(self.device), "memory/train_state_gib": self.state_gib}


def train_state_gib(model, optimizer: torch.optim.Optimizer, ema) -> float:
    """GiB of training state this rank holds: its (shards of the) parameters, their gradients (fp32, as many
    as the trained parameters; held during every step), the optimizer state and the EMA."""
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    total = (local_bytes(params) + local_bytes(p for p in params if p.requires_grad) + local_bytes(state)
             + local_bytes(ema.state_dict().values()))
    return total / 2**30


def local_bytes(tensors) -> int:
    """Bytes this rank holds of the given tensors (a DTensor's local shard; a quantized optimizer moment's inner
    tensors, not the size it poses as)."""
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        if is_traceable_wrapper_subclass(local):
            total += local_bytes(getattr(local, part) for part in local.__tensor_flatten__()[0])
        else:
            total += local.numel() * local.element_size()
    return total
