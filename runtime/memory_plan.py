"""A memory plan before renting GPUs: what each rank holds when training a config, component by component.

Counted on the meta device for the real model (which allocates nothing): its parameters by role and dtype
(trained, frozen, quantized) and the tensors autograd saves for the backward in one training forward at
micro-batch 1. The rest follows stated rules:

- trained weights: fp32 master (4 B), gradients fp32 (4 B), EMA (4 B) per parameter, and the optimizer's state by
  the shapes of the trained parameters (optim/optimizers.py: AdamW's two moments 8 B per parameter, 8-bit AdamW's
  about 2 B, prodigy's 16 B, Adafactor's a row and a column mean per matrix); frozen weights at their stored size
  (the compute dtype, or nf4 / int8 codes and scales). Under FSDP/HSDP all of it is split over the shard group;
  with parallel.cpu_offload it lives in host memory instead.
- DDP keeps a second copy of the gradients in its all-reduce buckets.
- FSDP in flight: the root's weights gathered (it keeps them between forward and backward), two blocks'
  weights gathered in the compute dtype (the running one and the prefetched one; every block when
  parallel.reshard_after_forward is off), and one block's full fp32 gradient before its reduce-scatter.
- activations: the saved tensors per sample times the micro-batch, attention counted as a flash kernel keeps it
  (q, k, v, output and row statistics, never the L x L scores). Activation checkpointing in every k-th block:
  `full` keeps only the block's inputs, `selective` its inputs and the outputs of its matmuls and attention (what
  perf/activation_checkpointing.py's policy keeps); the backward recomputes one block at a time, which holds its
  activations meanwhile. What it costs, as a share of the step's time on an H100 by the roofline (the step: 3x the
  forward's matmul FLOPs at 800 TFLOP/s): `full` re-runs the block's matmuls (their FLOPs) and its other ops (the
  bytes they read and write as eager kernels, at 3 TB/s), `selective` the other ops only. Both are counted on the
  meta device like the bytes; compiled blocks fuse the other ops, so their part is an upper bound.
- block swapping (offload.blocks_to_swap=N, LoRA): the frozen weights of the N swapped blocks
  (perf/block_swap.py's `swapped_blocks`) leave the GPU for host memory, and the two largest of them are in flight
  (the block running and the one being copied in); a micro-step copies 2N - 1 blocks to the GPU (`swap_bytes`).
- workspace: dequantizing a quantized layer holds its 4-byte level indices and two weight-sized temporaries in
  the compute dtype (int8: three), for the largest such layer; in fp32 under LoKr / LoHa (lora.type), whose peft
  layers read the base weight (its shape) in every forward, which a quantized layer gives dequantized in fp32.
- validation (validation.every or validation.at_end): the EMA swapped into the model keeps a copy of the trained
  weights; sampling runs the model without autograd on 2 x micro-batch rows with classifier-free guidance (else the
  micro-batch), the held-out loss on validation.loss_sigmas rows, their working set counted on the meta device as
  the largest sum of the tensors alive at once (attention as a flash kernel: its output); then the VAE, brought
  from host memory, decodes one image at a time (the family's released VAE: its weights, and the working set at
  the resolution, counted the same way). A pipeline's text encoders are not loaded for validation when its
  prompts were precomputed.
- peak: everything that persists, plus the larger of the activations and the gradients (the backward frees
  activations as it makes gradients) with the workspace, or of validation's.
- on a GPU: the CUDA context and kernels (0.6 GiB), and 10 % of the rest for the caching allocator's
  fragmentation.
"""

import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from formats import DTYPES
from models import attention
from models.quantized import QuantizedLinear
from optim.optimizers import state_bytes
from perf.activation_checkpointing import keeps
from perf.block_swap import swapped_blocks
from perf.float8 import BF16_MATMUL_RATE, MEMORY_RATE

GIB = 2**30
CUDA_CONTEXT = 0.6 * GIB
FRAGMENTATION = 0.10


@dataclass
class Plan:
    """Bytes per rank of each component; `host` what CPU offload keeps in host memory instead."""
    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    ema: float = 0.0
    in_flight: float = 0.0
    activations: float = 0.0
    workspace: float = 0.0
    validation: float = 0.0  # held while validation runs instead of activations and gradients
    overhead: float = 0.0
    host: float = 0.0
    recompute: float = 0.0  # activation checkpointing's extra time, as a share of the step's (roofline)
    recompute_flops: float = 0.0  # its extra FLOPs, as a share of the step's
    swap_bytes: float = 0.0  # block swapping: bytes copied host to GPU per micro-step
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return self.weights + self.optimizer + self.ema + self.in_flight + self.overhead \
            + max(max(self.activations, self.gradients) + self.workspace, self.validation)


@dataclass
class ModelCount:
    """What the meta-device pass found."""
    trained: int  # parameters
    trained_shapes: list[tuple[int, ...]]  # their shapes, for the optimizer's state
    frozen_bytes: int
    buffer_bytes: int
    block_bytes: list[int]  # each block's parameters at their stored size
    block_frozen: list[int]  # of those, the frozen ones (what block swapping moves)
    block_trained: list[int]  # each block's trained parameters
    root_bytes: int  # parameters outside the blocks
    saved_per_block: list[int]  # bytes autograd saves in each block, per sample
    block_inputs: list[int]  # bytes of each block's inputs, per sample
    saved_outside: int  # saved outside the blocks (embeddings, final layer, loss), per sample
    dequantized: dict[str, int]  # the largest quantized layer's weights, by scheme
    selective_kept: list[int]  # bytes of the outputs of each block's matmuls and attention, per sample
    block_flops: list[int]  # forward FLOPs of each block, per sample
    block_traffic: list[int]  # bytes each block's other ops read and write in its forward, per sample
    block_weight_traffic: list[int]  # of those ops, the bytes of those on weights alone (dequantization), per step
    forward_flops: int  # of the whole model, per sample
    sampling: int = 0  # the most bytes a forward without autograd holds at once (validation), per sample
    vae: tuple[int, int] = (0, 0)  # validation's VAE on the device: its weights, and one image's decode working set


def block_kind(block: nn.Module) -> tuple:
    """What a block's forward depends on besides its inputs: its modules' types and plain settings (a block that skips
    its text stream says so), its parameters' and buffers' names, shapes, dtypes and whether they train."""
    settings = tuple((name, type(m).__name__, tuple(sorted((k, v) for k, v in vars(m).items()
                                                            if isinstance(v, (bool, int, float, str)))))
                     for name, m in block.named_modules())
    tensors = tuple((name, tuple(t.shape), t.dtype, t.requires_grad)
                    for name, t in [*block.named_parameters(), *block.named_buffers()])
    return settings, tensors


@dataclass(frozen=True)
class Shaped:
    shape: torch.Size
    dtype: torch.dtype
    grad: bool  # requires_grad


@contextmanager
def two_blocks_of_each_kind(blocks: list[nn.Module]):
    """The first two blocks of each kind (`block_kind`) compute; the others return new tensors shaped as the second
    of their kind returned, and the count copies its numbers to them. Yields {block: the second of its kind} for the
    others. A block's count depends on its kind and its inputs' shapes, the same for every block of a kind (they are
    consecutive and return what they take), and on what blocks before it saved already (a tensor several blocks
    save, as the timestep embedding's, is held once, by the first): from the second of a kind on, nothing new."""
    seen, outputs, patched = {}, {}, {}
    for i, block in enumerate(blocks):
        kind = seen.setdefault(block_kind(block), [])
        if len(kind) < 2:
            kind.append(i)
        else:
            patched[i] = kind[1]

    def keep(index):  # what the block returned, not the tensors (which would stay alive: the working set counts)
        def hook(module, args, output):
            outputs[index] = tree_map(lambda t: Shaped(t.shape, t.dtype, t.requires_grad)
                                      if isinstance(t, torch.Tensor) else t, output)
        return hook

    def like(index):
        def forward(*args, **kwargs):  # made from the block's input, as computed from it (BlockOps' data)
            source = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            return tree_map(lambda t: source.new_empty(t.shape, dtype=t.dtype).requires_grad_(t.grad)
                            if isinstance(t, Shaped) else t, outputs[index])
        return forward

    handles = [blocks[i].register_forward_hook(keep(i)) for i in set(patched.values())]
    for i, rep in patched.items():
        blocks[i].forward = like(rep)
    try:
        yield patched
    finally:
        for handle in handles:
            handle.remove()
        for i in patched:
            del blocks[i].forward


def count_model(model, example_inputs, activation_bytes: int, frozen_bytes: int) -> ModelCount:
    """Parameters and saved activations of `model` (built on the meta device, in fp32: the meta device has no
    autocast) in one forward of `example_inputs` (batch 1); float activations counted at `activation_bytes`
    per element, frozen float weights at `frozen_bytes` (the dtype training keeps them in). Two blocks of each kind
    compute (`two_blocks_of_each_kind`: a 60-block model's count in the time of a few blocks), the others take the
    second one's numbers."""
    blocks = list(model.transformer.blocks)
    weights = {id(p) for p in model.parameters()}
    n = len(blocks)
    saved, inputs, kept, block_flops, current = [0] * n, [0] * n, [0] * n, [0] * n, [None]
    traffic, weight_traffic = [0] * n, [0] * n
    outside, seen = [0], {}  # one tensor saved by several ops (a block's input by q, k and v) is held once
    flops = FlopCounterMode(display=False)

    def size(t: torch.Tensor) -> int:
        return t.numel() * (activation_bytes if t.is_floating_point() else t.element_size())

    def pack(t):
        key = id(t._base if t._base is not None else t)
        if key not in weights and key not in seen:  # weights (and views of them) are not activations
            seen[key] = t  # kept alive, so that its id is not reused
            if current[0] is None:
                outside[0] += size(t)
            else:
                saved[current[0]] += size(t)
        return t

    ops = BlockOps(size, [t for t in tree_leaves(example_inputs) if isinstance(t, torch.Tensor)])

    def flash_attention(q, k, v, mask=None):  # what a flash kernel keeps for the backward: inputs, output, row statistics
        with torch.no_grad(), ops.paused():
            out = attention.math_attention(q, k, v, mask)
        statistics = torch.empty(q.shape[:3], dtype=torch.float32, device="meta")
        for t in (q, k, v, out, statistics):
            pack(t)
        if current[0] is not None:  # the kernel's outputs, which selective checkpointing keeps
            kept[current[0]] += size(out) + size(statistics)
        return out.requires_grad_(q.requires_grad or k.requires_grad or v.requires_grad)

    def enter(index):
        def hook(module, args):
            current[0] = index
            inputs[index] = sum(size(a) for a in args if isinstance(a, torch.Tensor))
            block_flops[index] -= flops.get_total_flops()
            ops.start()
        return hook

    def leave(index):
        def hook(*_):
            current[0] = None
            block_flops[index] += flops.get_total_flops()
            kept[index] += ops.kept
            traffic[index] += ops.traffic
            weight_traffic[index] += ops.weight_traffic
            ops.stop()
        return hook

    handles = []
    with two_blocks_of_each_kind(blocks) as copies:
        for i, block in enumerate(blocks):
            if i not in copies:
                handles += [block.register_forward_pre_hook(enter(i)), block.register_forward_hook(leave(i))]
        try:
            with attention.attention_kernel(model, flash_attention), saved_tensors_hooks(pack, lambda t: t), flops, \
                    ops:
                model(*example_inputs).float().square().mean()
        finally:
            for handle in handles:
                handle.remove()
        for i, rep in copies.items():
            for numbers in (saved, inputs, kept, block_flops, traffic, weight_traffic):
                numbers[i] = numbers[rep]
        sampling = working_set(lambda: model(*example_inputs), activation_bytes, model)
    forward_flops = flops.get_total_flops() + sum(block_flops[rep] for rep in copies.values())

    def stored_size(p) -> int:
        frozen_float = not p.requires_grad and p.is_floating_point() and p.dtype == torch.float32
        return p.numel() * (frozen_bytes if frozen_float else p.element_size())

    def stored(module) -> int:
        return sum(stored_size(p) for p in module.parameters())

    return ModelCount(
        trained=sum(p.numel() for p in model.parameters() if p.requires_grad),
        trained_shapes=[tuple(p.shape) for p in model.parameters() if p.requires_grad],
        frozen_bytes=sum(stored_size(p) for p in model.parameters() if not p.requires_grad),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        block_bytes=[stored(b) for b in blocks],
        block_frozen=[sum(stored_size(p) for p in b.parameters() if not p.requires_grad) for b in blocks],
        block_trained=[sum(p.numel() for p in b.parameters() if p.requires_grad) for b in blocks],
        root_bytes=stored(model) - sum(stored(b) for b in blocks),
        saved_per_block=saved, block_inputs=inputs, saved_outside=outside[0],
        dequantized=largest_quantized(model), selective_kept=kept, block_flops=block_flops, block_traffic=traffic,
        block_weight_traffic=weight_traffic, forward_flops=forward_flops, sampling=sampling)


class PausableMode(TorchDispatchMode):
    """A dispatch mode that counts while `counting`; `paused()` stops it for a while (an op it must not see)."""
    counting = True

    @contextmanager
    def paused(self):
        counting, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = counting


class LiveBytes(PausableMode):
    """The most bytes that the tensors ops make hold at once, each until it is freed (a view holds its base): the
    working set of code without autograd, beside what existed before. Floating tensors counted at
    `activation_bytes` per element (the meta device has no autocast)."""

    def __init__(self, activation_bytes: int):
        super().__init__()
        self.activation_bytes, self.live, self.peak, self.counting = activation_bytes, 0, 0, True

    def release(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.counting or func.is_view:
            return out
        inputs = {id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in inputs and t._base is None:  # in-place: nothing new
                size = t.numel() * (self.activation_bytes if t.is_floating_point() else t.element_size())
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self.release, size)
        return out


def working_set(run, activation_bytes: int, model=None) -> int:
    """LiveBytes' peak of `run()` without autograd, attention (in `model`, and torch's scaled_dot_product_attention,
    which diffusers' VAEs call) held as a flash kernel holds it: its output, not the scores."""
    counter = LiveBytes(activation_bytes)

    def as_flash(exact):
        def kernel(q, k, v, *args, **kwargs):
            with counter.paused():
                out = exact(q, k, v, *args, **kwargs)
            return out.clone()  # what a flash kernel allocates
        return kernel

    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = as_flash(sdpa)
    try:
        kernel = attention.attention_kernel(model, as_flash(attention.math_attention)) if model else nullcontext()
        with torch.no_grad(), kernel, counter:
            run()
    finally:
        F.scaled_dot_product_attention = sdpa
    return counter.peak


def vae_count(vae: tuple[str, dict], resolution: int, activation_bytes: int) -> tuple[int, int]:
    """(weights, working set of decoding one image of `resolution` a side) of a VAE (diffusers' class, its config)
    in the compute dtype, built on the meta device."""
    import diffusers
    name, config = vae
    with torch.device("meta"):
        vae = getattr(diffusers, name)(**config).eval()
        frames = hasattr(vae.config, "temperal_downsample")  # a video VAE (Qwen-Image's): an image is one frame
        side = resolution // 2 ** (len(vae.config.temperal_downsample) if frames else
                                   len(vae.config.block_out_channels) - 1)
        latents = torch.empty(1, vae.config.z_dim, 1, side, side) if frames else \
            torch.empty(1, vae.config.latent_channels, side, side)
    weights = sum(p.numel() for p in vae.parameters()) * activation_bytes
    return weights, working_set(lambda: vae.decode(latents), activation_bytes)


class BlockOps(PausableMode):
    """Inside a block (between `start` and `stop`): the bytes of the outputs of the ops selective checkpointing
    keeps (`kept`), and the bytes the other ops read and write (what recomputing them moves, each op an eager
    kernel): `traffic` for ops on the data (computed from `inputs`), which scale with the batch, `weight_traffic`
    for the others (a quantized weight's dequantization: once per step). Views and allocations move nothing."""

    def __init__(self, size, inputs: list[torch.Tensor]):
        super().__init__()
        self.size, self.counting, self.kept, self.traffic, self.weight_traffic = size, False, 0, 0, 0
        self.from_inputs = {id(t): t for t in inputs}  # tensors computed from the data (kept alive: ids stay unique)

    def start(self):
        self.counting, self.kept, self.traffic, self.weight_traffic = True, 0, 0, 0

    def stop(self):
        self.counting = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        read = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        written = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        of_data = any(id(t) in self.from_inputs for t in read)
        if of_data:
            self.from_inputs.update((id(t), t) for t in written)
        if self.counting and not func.is_view and func not in NO_TRAFFIC:
            if keeps(func):
                self.kept += sum(map(self.size, written))
            elif of_data:
                self.traffic += sum(map(self.size, read + written))
            else:
                self.weight_traffic += sum(map(self.size, read + written))
        return out


aten = torch.ops.aten
NO_TRAFFIC = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.detach.default,
              aten.new_empty.default, aten.lift_fresh.default}


def largest_quantized(model) -> dict[str, int]:
    """The weights of the largest quantized layer, by scheme."""
    largest: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            largest[m.scheme] = max(largest.get(m.scheme, 0), m.in_features * m.out_features)
    return largest


def plan(count: ModelCount, *, strategy: str, ranks: int, micro_batch: int, dtype: str, checkpointing: str = "none",
         every: int = 1, reshard_after_forward: bool = True, cpu_offload: bool = False, gpu: bool = True,
         swapped: int = 0, validation_rows: int = 0, optimizer: str = "adamw", adapter: str = "lora") -> Plan:
    """Bytes per rank for training with these settings (`ranks`: the shard group under FSDP/HSDP; `swapped`: the
    blocks block swapping keeps in host memory, without sharding or CPU offload; `optimizer`: optimizer.name;
    `adapter`: lora.type), and validation's forwards of `validation_rows` rows (0: no validation) and its VAE."""
    p = Plan()
    split = ranks if strategy in ("fsdp", "hsdp") else 1
    compute = DTYPES[dtype].itemsize
    p.weights = (4 * count.trained + count.frozen_bytes) / split + count.buffer_bytes
    if swapped:
        if split > 1 or cpu_offload or swapped > len(count.block_frozen):
            raise ValueError(f"block swapping of {swapped} of {len(count.block_frozen)} blocks, unsharded, is planned")
        order = swapped_blocks(len(count.block_frozen), swapped)
        host = sum(count.block_frozen[i] for i in order)
        p.weights -= host
        p.host += host
        p.in_flight += sum(sorted((count.block_frozen[i] for i in order), reverse=True)[:2])
        p.swap_bytes = 2 * host - count.block_frozen[order[-1]]
        p.notes.append(f"{swapped} blocks' frozen weights in host memory, two on the GPU at a time; "
                       f"{p.swap_bytes / 2**30:.2f} GiB copied to the GPU per micro-step")
    p.gradients = 4 * count.trained / split
    p.optimizer = state_bytes(optimizer, count.trained_shapes) / split
    p.ema = 4 * count.trained / split
    if strategy == "ddp" and ranks > 1:
        p.in_flight += 4 * count.trained  # DDP's all-reduce buckets
        p.notes.append("DDP buckets: a second copy of the gradients")
    if split > 1 or cpu_offload:
        blocks = len(count.block_bytes)
        gathered = sorted(count.block_bytes, reverse=True)[: blocks if not reshard_after_forward else 2]
        as_computed = compute / 4  # fp32 weights are gathered in the compute dtype; frozen ones as stored
        p.in_flight = count.root_bytes * as_computed + sum(gathered) * as_computed + 4 * max(count.block_trained)
    if cpu_offload:
        p.host = p.weights - count.buffer_bytes + p.gradients + p.optimizer + p.ema
        p.weights, p.gradients, p.optimizer, p.ema = count.buffer_bytes, 0.0, 0.0, 0.0
        p.notes.append("weights, gradients, optimizer state and EMA in host memory; the optimizer step runs there")
    checkpointed = range(0, len(count.saved_per_block), every) if checkpointing != "none" else range(0)
    p.activations = micro_batch * (held_in_backward(count, checkpointing, set(checkpointed)) + count.saved_outside)
    flops = micro_batch * sum(count.block_flops[i] for i in checkpointed) if checkpointing == "full" else 0
    traffic = sum(micro_batch * count.block_traffic[i] + count.block_weight_traffic[i] for i in checkpointed)
    step_flops = 3 * micro_batch * count.forward_flops  # both re-run the ops between the matmuls; full those too
    p.recompute_flops = flops / step_flops
    p.recompute = (flops / BF16_MATMUL_RATE + traffic / MEMORY_RATE) / (step_flops / BF16_MATMUL_RATE)
    dequantized = 4 if adapter != "lora" else compute
    p.workspace = max([n * (4 + 2 * dequantized) for s, n in count.dequantized.items() if s == "nf4"] +
                      [n * 3 * dequantized for s, n in count.dequantized.items() if s == "int8"] + [0])
    if validation_rows:
        swap = 0 if cpu_offload else 4 * count.trained / split  # the trained weights, while the EMA's stand in
        p.validation = swap + max(validation_rows * count.sampling, sum(count.vae))
    if gpu:
        p.overhead = CUDA_CONTEXT + FRAGMENTATION * (p.peak - p.overhead)
    return p


def held_in_backward(count: ModelCount, checkpointing: str, checkpointed: set[int]) -> int:
    """The most the blocks' saved activations take per sample: at the start of the backward, or while it runs a
    block (from the last to the first), when the blocks before it still keep what they kept and a checkpointed
    block holds its recomputed activations too."""
    kept, running = [], []
    for i, saved in enumerate(count.saved_per_block):
        if i not in checkpointed:
            kept.append(saved)
        elif checkpointing == "full":
            kept.append(count.block_inputs[i])
        else:
            kept.append(count.block_inputs[i] + count.selective_kept[i])
        running.append(max(saved, kept[-1]))
    return max([sum(kept)] + [sum(kept[:i]) + running[i] for i in range(len(kept))])


# activation checkpointing settings (mode, every k-th block), from the least recompute to the least memory
CHECKPOINTING = [("none", 1), *[(mode, every) for mode in ("selective", "full") for every in (4, 2, 1)]]


def cheapest_checkpointing(count: ModelCount, gpu_bytes: float, **settings) -> tuple[str, int, Plan] | None:
    """The activation checkpointing setting that recomputes least among those whose plan fits in `gpu_bytes` (the
    smaller peak on a tie), as (mode, every, plan); None if none fits. `settings`: plan()'s other arguments."""
    plans = [(mode, every, plan(count, checkpointing=mode, every=every, **settings)) for mode, every in CHECKPOINTING]
    fitting = [choice for choice in plans if choice[2].peak <= gpu_bytes]
    return min(fitting, key=lambda choice: (choice[2].recompute, choice[2].peak), default=None)


def smallest_swap(count: ModelCount, gpu_bytes: float, **settings) -> tuple[int, Plan] | None:
    """The fewest blocks block swapping must keep in host memory for the plan to fit in `gpu_bytes` (0: it fits
    without), as (N, plan); None if swapping every block does not fit either. `settings`: plan()'s other arguments
    (unsharded, no CPU offload)."""
    for swapped in range(len(count.block_frozen) + 1):
        result = plan(count, swapped=swapped, **settings)
        if result.peak <= gpu_bytes:
            return swapped, result
    return None
