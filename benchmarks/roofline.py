"""The training step on one H100, predicted on a CPU: an op census of each kind of block (forward and backward), of
the rest of the model, and of the optimizer, EMA, clipping and gradient accumulation, timed by a roofline whose
every rate is printed with its source.

    python benchmarks/roofline.py                          # every preset: block and step tables, JSON
    python benchmarks/roofline.py --preset sd3-medium      # the step configs/sd3_medium.yaml configures
    python benchmarks/roofline.py --preset flux-dev-lora --batch 2 --checkpointing selective --attention fa3
    python benchmarks/roofline.py --preset sd3-medium training.gradient_accumulation_steps=1   # any key=value

The model is the one training builds (`build_trained_model` on the meta device: LoRA adapters, the frozen base in
the compute dtype), with the released architecture of the preset, at 1024 px (4096 image tokens: 128x128 latents in
2x2 patches, FLUX.2's 64x64 of 128 channels; SD3's 333 text tokens, FLUX.1's and FLUX.2's 512, Qwen-Image's 512 with
their padding mask). Each distinct kind of block (SD3's joint block and its last, text-pre-only one; SD3.5-medium's
dual-attention blocks; FLUX.1's and FLUX.2's double- and single-stream blocks, FLUX.2's with the shared modulations
the model computes once per step outside them; Qwen-Image's dual-stream block and its last, whose text stream is
not computed; under LoRA the first block, whose inputs need no gradient), its conditioning as the model hands it
(dtype and gradient: `Cut` records them), runs once on fake tensors (no memory, no GPU: torch's FakeTensorMode)
under bf16 autocast with CUDA's autocast policy (`cuda_autocast_policy`), so autocast inserts the casts it inserts
on a GPU. Two paths:

- eager: every aten op the forward and backward dispatch, recorded below autograd (a TorchDispatchMode), with
  its FLOPs (torch's flop counter formulas) and the bytes it reads and writes (the memory its tensors span;
  views launch nothing and are not counted).
- compiled: the graphs `torch.compile` hands inductor (AOTAutograd's joint graph with inductor's
  decompositions and joint-graph passes, split by its min-cut partitioner, then its post-grad passes), lowered
  and scheduled by inductor itself for a CUDA device and stopped before code generation (`scheduled_kernels`):
  its kernels after fusion, each with the bytes its scheduler node reads and writes
  (`get_read_write_buffers_sizes`, what `torch._inductor.metrics.num_bytes_accessed` sums). Default mode:
  matmuls are cuBLAS calls (extern kernels), nothing is fused into them.

What runs outside the blocks (embedders, FLUX.2's shared modulations, final layer, the loss and its backward) is
counted the same way, eager (compile wraps the blocks only), with the blocks cut out. Each kernel takes the longest of its FLOPs at its rate,
its bytes at the measured memory rate, and a floor per launch; kernels run one after another. The step adds,
per optimizer step: the micro-steps, activation checkpointing's recompute, gradient accumulation, clipping,
AdamW and the EMA (`StepPrediction.terms`). MFU = model FLOPs (matmuls and attention, no recompute, as
benchmarks/train_step.py counts them) / (time x dense peak). `ASSUMPTIONS` lists every rate with its source.

Block swapping (offload.blocks_to_swap=N, LoRA presets): the swapped blocks' frozen weights are copied to the GPU
once in the forward and again in the backward (the last swapped block stays), each at `H2D_RATES` (PCIe 4.0 and 5.0
x16), on a side stream that starts each copy when the previous swapped block starts computing (perf/block_swap.py);
`swap_stall` plays that schedule against the blocks' predicted forward and backward times (recompute included) and
gives the time the compute waits for copies. The report lists it by N and the largest N whose copies stay hidden
(under 1 % of the micro-step); a config's own N adds its stall to the step (`predict`, PCIe 5.0: an H100's link).

For other scripts: `predict_step(cfg)` predicts the step a config describes (for benchmarks/train_step.py to print
beside the step it measures).
"""

import argparse
import copy
import json
import math
import sys
import warnings
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project folders import by their names

from configs.build import build_trained_model  # noqa: E402
from configs.schema import Config, resolve_defaults  # noqa: E402
from data.latents import empty_text, text_shapes  # noqa: E402
from errors import ConfigError, InputError  # noqa: E402
from models.flux.model import SingleTransformerBlock  # noqa: E402
from models.flux2.model import SingleStreamBlock  # noqa: E402
from models.qwen_image.model import QwenImageBlock  # noqa: E402
from models.rectified_flow import interpolate, per_sample_loss  # noqa: E402
from perf.block_swap import swapped_blocks  # noqa: E402
from plan_memory import RELEASED, released_data  # noqa: E402
from runtime.memory_plan import CUDA_CONTEXT, FRAGMENTATION, GIB  # noqa: E402

aten = torch.ops.aten

# ----------------------------------------------------------------------------------------------- H100 rates

PEAK_BF16 = 989e12  # H100 SXM dense bf16 FLOP/s (NVIDIA datasheet; the 1979 figure is with sparsity)
PEAK_TF32 = 495e12  # H100 SXM dense TF32 FLOP/s (datasheet): fp32 matmuls with allow_tf32
MEMORY_RATE = 3.0e12  # bytes/s read + written: measured device-to-device copy on an H100 80GB HBM3 (datasheet 3.35)
# the shortest a kernel takes on the GPU timeline: eager PyTorch spends ~5 us of host time dispatching and
# launching each op (assumed; a GPU kernel shorter than that leaves the GPU idle), inductor's generated
# wrapper ~2 us per kernel (assumed)
LAUNCH_FLOOR_S = {"eager": 5e-6, "compiled": 2e-6}
# fp32 attention (SDPA's memory-efficient kernel; flash needs 16-bit inputs) runs without tensor cores: H100 SXM's
# fp32 peak is 67 TFLOP/s; assumed 50
FP32_ATTENTION_RATE = 50e12

# GEMMs, a model (not a measurement): cuBLAS computes the output in tiles of 128 x 256 (either orientation, the
# tile of its large Hopper bf16 kernels), one tile per SM at a time, in waves of 132 tiles; the idle SMs of the
# last wave and a tile's part past M or N are lost (tile and wave quantization: NVIDIA's "Matrix Multiplication
# Background User's Guide"). Rate = the rate of full waves x the useful share of the tiles the waves compute. The
# full-wave rate is calibrated on the one measured matmul (8192^3 bf16 on an H100 80GB HBM3, torch 2.11: ~800
# TFLOP/s); the model gives 807 for the best shape of ml-engineering's MAMF table (6144x17920x2816, 792.1
# measured on an H100 SXM, CUDA 12.1). A matmul with fewer than 128 rows or columns (LoRA's rank-16 products, adaLN's
# per-sample ones) runs narrow tiles and is memory-bound: no quantization is modelled for it. Not modelled: K (the
# depth of the product), split-K and stream-K schedules and the smaller tiles cuBLAS may pick for partial waves
# (all would raise the rate of a partial wave: the model is pessimistic there, `benchmarks/RESULTS.md` says by how
# much).
MEASURED_MATMUL = (8192, 8192, 800e12)  # M, N, FLOP/s
SMS = 132
GEMM_TILES = ((128, 256), (256, 128))


def wave_efficiency(m: int, n: int, batch: int = 1) -> float:
    """The share of the tiles' work that is an m x n output (`batch` of them), in the better tile orientation."""
    if min(m, n) < min(min(tile) for tile in GEMM_TILES):
        return 1.0

    def share(tm, tn):
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        return batch * m * n / (math.ceil(tiles / SMS) * SMS * tm * tn)
    return max(share(tm, tn) for tm, tn in GEMM_TILES)


FULL_WAVE_RATE = MEASURED_MATMUL[2] / wave_efficiency(*MEASURED_MATMUL[:2])


def gemm_rate(m: int, n: int, batch: int = 1, dtype: str = "bf16") -> float:
    """FLOP/s of an m x n (x k) matmul, `batch` of them at once; fp32 inputs run as TF32 (allow_tf32)."""
    return FULL_WAVE_RATE * wave_efficiency(m, n, batch) * (PEAK_TF32 / PEAK_BF16 if dtype == "fp32" else 1.0)


# Attention FLOP/s on an H100 SXM5, non-causal, sequence 4k (16k tokens per batch): the FlashAttention-3 paper
# (Shah et al. 2024, arXiv 2407.08608), figure 5 (forward) and figure 6 (backward). The image sequences here are
# near 4k (SD3 4429 tokens, FLUX.1 4608); head dims other than 64 and 128 take the nearer.
ATTENTION_RATES = {  # backend: {head dim: (forward, backward)}
    "fa2": {64: (321e12, 279e12), 128: (368e12, 310e12)},
    "cudnn": {64: (408e12, 417e12), 128: (609e12, 499e12)},
    "fa3": {64: (476e12, 453e12), 128: (638e12, 542e12)},
}
# The papers count an attention backward as 2.5 forwards (five matmuls: the scores are recomputed; flash-attention's
# benchmark `flops()`); model FLOPs count 2 (the math formula's four, as torch's flop counter counts
# benchmarks/train_step.py's MFU). So a backward of F model FLOPs takes 1.25 F at the paper's rate.
ATTENTION_BACKWARD_WORK = 2.5 / 2
# training.attention_backend -> the rates above. auto on an H100 takes FA3 where flash_attn_interface is installed,
# else cuDNN (perf/attention.py's FASTEST_FIRST): cuDNN here, which every PyTorch install has; sdpa's own pick on
# Hopper has been flash-2 or cuDNN by release: FA2 here
CONFIG_BACKENDS = {"auto": "cudnn", "sdpa": "fa2", "sdpa_flash": "fa2", "flash_attn_2": "fa2", "sdpa_cudnn": "cudnn",
                   "flash_attn_3": "fa3"}

# Bytes per trained parameter of the memory-bound work after the backward, all fp32 tensors
ADAMW_FUSED_BYTES = 28  # torch's fused AdamW: reads param, grad, exp_avg, exp_avg_sq (16), writes param and both (12)
# torch's foreach AdamW (optimizer.fused=false): 7 passes (lerp, mul, addcmul, sqrt, div, add, addcdiv), 8 more with
# weight decay (torch/optim/adam.py `_multi_tensor_adam`)
ADAMW_FOREACH_BYTES = 72
WEIGHT_DECAY_FOREACH_BYTES = 8
EMA_BYTES = 12  # optim/ema.py: one _foreach_lerp_: reads the average and the weight, writes the average
CLIP_BYTES = 12  # clip_grad_norm_: reads the gradients for the norm, then reads and writes them to scale (always)
ACCUMULATE_BYTES = 12  # every micro-step after the first: autograd's AccumulateGrad, grad += new (2 reads, 1 write)

# Host-to-device copies from pinned memory, one direction: assumed 80 % of the x16 link's 31.5 GB/s (PCIe 4.0: 16 GT/s
# x 16 lanes, 128b/130b) and 63 GB/s (PCIe 5.0, an H100's host link), what pinned-memory copies reach in practice
H2D_RATES = {"PCIe 4.0 x16": 25e9, "PCIe 5.0 x16": 50e9}
HIDDEN = 0.01  # block swapping's copies count as hidden while the compute waits for them under 1 % of the micro-step

ASSUMPTIONS = [  # (what, value, source), printed with every table
    ("dense peak", "bf16 989 TFLOP/s, TF32 495", "NVIDIA H100 SXM datasheet (1979 bf16 is with sparsity)"),
    ("memory", "3.0 TB/s read + written", "measured device-to-device copy, H100 80GB HBM3 (datasheet 3.35)"),
    ("GEMM rate", f"{FULL_WAVE_RATE / 1e12:.0f} TFLOP/s per full wave x tile and wave quantization (128x256 tiles, "
                  f"132 SMs)", "a model (NVIDIA's Matrix Multiplication Background guide), calibrated on the measured "
                               "8192^3 bf16 matmul (800 TFLOP/s); gives 807 for the best shape of ml-engineering's "
                               "MAMF table, 792 measured"),
    ("attention forward / backward", "hd 64: FA2 321/279, cuDNN 408/417, FA3 476/453; hd 128: FA2 368/310, cuDNN "
                                     "609/499, FA3 638/542 TFLOP/s", "FlashAttention-3 paper, figs. 5-6 (H100 SXM5, "
                                                                      "seq 4k, non-causal)"),
    ("attention backward work", "2.5 forwards at the paper's rates, 2 in model FLOPs", "flash-attention's benchmark "
                                                                                      "flops(); torch's flop counter"),
    ("masked attention (Qwen-Image's text padding)", "at the same rates as unmasked", "assumed: a key mask skips "
                                                                                   "no work; which kernels take it "
                                                                                   "is not measured here"),
    ("launch floor", "5 us per eager op, 2 us per compiled kernel", "assumed"),
    ("fp32 attention", "50 TFLOP/s", "assumed (67 TFLOP/s fp32 peak, no tensor cores)"),
    ("overlap", "none: kernels one after another, each reading from and writing to HBM", "assumed"),
    ("AdamW", f"fused {ADAMW_FUSED_BYTES} B, foreach {ADAMW_FOREACH_BYTES} B (+{WEIGHT_DECAY_FOREACH_BYTES} with "
              f"weight decay) per trained parameter", "torch's fused kernel; torch/optim/adam.py _multi_tensor_adam"),
    ("EMA, clipping", f"{EMA_BYTES} B, {CLIP_BYTES} B per trained parameter", "optim/ema.py (_foreach_lerp_); "
                                                                              "torch.nn.utils.clip_grad_norm_"),
    ("gradient accumulation", f"{ACCUMULATE_BYTES} B per trained parameter per extra micro-step", "AccumulateGrad"),
    ("recompute", "full: one more forward of each checkpointed block; selective: its forward's kernels other than "
                  "matmuls and attention", "torchtitan's op-level policy saves matmul and attention outputs"),
    ("block swap copies", "host to GPU at 25 GB/s (PCIe 4.0 x16), 50 GB/s (PCIe 5.0 x16), overlapping compute",
     "assumed: 80 % of the links' 31.5 / 63 GB/s per direction, from pinned memory"),
    ("not counted", "host work, data loading, communication, text encoders run in the step", "one GPU, precomputed "
                                                                                             "text, no host syncs"),
]

# ----------------------------------------------------------------------------------------------- op classes

MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution, aten.convolution_backward}
ATTENTION = {aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
             aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_efficient_attention_backward,
             aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_cudnn_attention_backward,
             aten._flash_attention_forward, aten._flash_attention_backward,
             aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward}
NORMS = {aten.native_layer_norm, aten.native_layer_norm_backward, aten.native_group_norm, aten.native_group_norm_backward}
REDUCTIONS = {aten.sum, aten.mean, aten.amax, aten.var_mean, aten.var, aten.prod}
COPIES = {aten.cat, aten.clone, aten.copy_, aten.copy, aten.split_with_sizes_copy, aten.slice_backward,
          aten.select_backward, aten.index_select, aten.stack}
FILLS = {aten.zeros, aten.ones, aten.full, aten.zeros_like, aten.ones_like, aten.full_like, aten.fill_,
         aten.zero_, aten.new_zeros, aten.new_ones, aten.new_full, aten.scalar_tensor}
NO_KERNEL = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
             aten.detach, aten.lift_fresh, aten._unsafe_view, aten._local_scalar_dense, aten.sym_size, aten.sym_stride, aten.sym_numel}
HEAVY = ("matmul", "attention")  # the model FLOPs; every other kernel is memory-bound


def op_class(packet) -> str:
    name = packet.__name__
    for cls, ops in (("matmul", MATMULS), ("attention", ATTENTION), ("norm", NORMS), ("reduction", REDUCTIONS),
                     ("copy", COPIES), ("fill", FILLS)):
        if packet in ops:
            return cls
    if name in ("fused_rms_norm", "fused_rms_norm_backward"):  # CUDA's fused RMSNorm kernels (below)
        return "norm"
    if name == "_to_copy":
        return "cast"
    if name in ("mul", "div"):
        return "mul"
    if name in ("add", "sub", "rsub"):
        return "add"
    return name  # the others by name: gelu, silu, pow, rsqrt, ...


# ----------------------------------------------------------------------------------------------- bytes, FLOPs


def footprint(t: torch.Tensor) -> int:
    """Bytes of memory a tensor spans as a kernel reads it: broadcast (stride 0) dimensions count once."""
    n = math.prod(size for size, stride in zip(t.shape, t.stride()) if stride != 0 and size > 1)
    return n * t.element_size()


def tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def flops_of(packet, args, kwargs, out) -> int:
    if packet in (aten._scaled_dot_product_flash_attention_for_cpu,
                  aten._scaled_dot_product_flash_attention_for_cpu_backward):  # model FLOPs: the math formula's
        q, k = args[0], args[1]
        if packet is aten._scaled_dot_product_flash_attention_for_cpu_backward:
            q, k = args[1], args[2]
        forward = 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]  # q k^T and p v
        return forward if packet is aten._scaled_dot_product_flash_attention_for_cpu else 2 * forward
    formula = flop_registry.get(packet)
    return int(formula(*args, **kwargs, out_val=out)) if formula else 0


def gemm_shape(packet, args, out) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of a matmul: its output is batch x M x N, each entry a K-long dot product; a convolution as
    the implicit GEMM of its forward (M = output pixels, N = output channels, K = input channels x kernel)."""
    if packet in (aten.convolution, aten.convolution_backward):
        grid = out if packet is aten.convolution else args[0]  # [B, O, H', W']
        weight = args[1] if packet is aten.convolution else args[2]
        return 1, grid.shape[0] * math.prod(grid.shape[2:]), weight.shape[0], math.prod(weight.shape[1:])
    a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
    return (a.shape[0] if a.dim() == 3 else 1), a.shape[-2], b.shape[-1], a.shape[-1]


@dataclass
class Kernel:
    cls: str
    op: str
    flops: int
    bytes: int
    phase: str = "forward"  # or "backward"
    gemm: tuple[int, int, int, int] | None = None  # matmuls: (batch, M, N, K)
    dtype: str = "bf16"  # matmuls and attention: of their inputs (fp32 matmuls run as TF32)
    head_dim: int = 0  # attention


def heavy_details(kernel: Kernel, packet, args, out) -> Kernel:
    """A matmul's shape and an attention's head dim, and the dtype of their inputs."""
    if kernel.cls == "matmul":
        kernel.gemm = gemm_shape(packet, args, out)
        kernel.dtype = "fp32" if tensors(args)[0].dtype == torch.float32 else "bf16"
    elif kernel.cls == "attention":
        q = args[1] if "backward" in packet.__name__ else args[0]
        kernel.head_dim, kernel.dtype = q.shape[-1], "fp32" if q.dtype == torch.float32 else "bf16"
    return kernel


class OpCensus(TorchDispatchMode):
    """Records every aten op that launches a kernel: its class, FLOPs, bytes read + written, and the phase (set
    `phase` to "backward" before the backward). In the forward it also notes which op made each tensor
    (`made_by`: matmul, attention, a cast of one of `params`, or other), for `saved_activations`, and the bytes the
    matmuls and attention write (`heavy_outputs`)."""

    def __init__(self, params=()):
        super().__init__()
        self.kernels: list[Kernel] = []
        self.phase = "forward"
        self.params = {id(p) for p in params}
        self.made_by: dict[int, str] = {}
        self.alive: list[torch.Tensor] = []  # the tensors `made_by` names, kept so that their ids stay theirs
        self.heavy_outputs = 0  # bytes the forward's matmuls and attention write: what selective checkpointing keeps

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        no_kernel = func.namespace not in ("aten", "roofline") or func.is_view or packet in NO_KERNEL
        if self.phase == "forward":
            self.note_maker(packet, args, out, no_kernel)
        if no_kernel:
            return out
        if packet is aten._to_copy and args[0].dtype == kwargs.get("dtype", args[0].dtype) \
                and args[0].device == kwargs.get("device", args[0].device):
            return out  # a no-op conversion
        read = sum(footprint(t) for t in tensors((args, kwargs)))
        written = sum(footprint(t) for t in tensors(out))
        if packet is aten.copy_:  # writes its first argument without reading it
            read -= footprint(args[0])
        kernel = Kernel(op_class(packet), packet.__name__, flops_of(packet, args, kwargs, out), read + written,
                        self.phase)
        self.kernels.append(heavy_details(kernel, packet, args, out))
        if self.phase == "forward" and kernel.cls in HEAVY:
            self.heavy_outputs += written
        return out

    def note_maker(self, packet, args, out, no_kernel: bool) -> None:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if no_kernel:  # a view (or a reshape without a copy) is of what its input is
            maker = self.made_by.get(id(first)) if first is not None else None
        elif packet in MATMULS or packet in ATTENTION:
            maker = op_class(packet)
        elif packet is aten._to_copy and id(first) in self.params:
            maker = "weight copy"
        else:
            maker = "other"
        for t in tensors(out):
            if maker is not None:
                self.made_by[id(t)] = maker
                self.alive.append(t)


@contextmanager
def saved_activations(census: OpCensus, inputs: list[torch.Tensor], into: Counter):
    """Inside: the bytes of each tensor autograd saves for the backward, counted once (a view as its base), by what
    made it (`OpCensus.made_by`; "input" for `inputs`) into `into`; parameters are not activations."""
    seen, given = set(), {id(t) for t in inputs}

    def pack(t):
        base = t._base if t._base is not None else t
        if id(base) not in seen and id(base) not in census.params:
            seen.add(id(base))
            census.alive.append(base)
            maker = "input" if id(base) in given else census.made_by.get(id(base), "other")
            into[maker] += base.numel() * base.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield

# ----------------------------------------------------------------------------------------------- autocast


# CUDA's autocast on CPU tensors. Fake CUDA tensors cannot run autograd in a CPU build of torch, and CPU
# autocast casts fewer ops than CUDA's: it runs layer_norm and rms_norm in bf16, where CUDA runs them in fp32
# (the output of F.layer_norm on a bf16 input is fp32 under CUDA autocast). So the block runs on fake CPU
# tensors under CPU autocast with CUDA's policy for these ops put in place (`cuda_autocast_policy`);
# tests/test_roofline.py checks each against CUDA autocast on fake CUDA tensors (forward only, which works).
CUDA_FP32_OPS = ["layer_norm", "native_layer_norm", "group_norm", "pow.Tensor_Scalar",
                 "pow.Tensor_Tensor", "rsqrt", "exp", "log", "reciprocal", "softplus", "mse_loss"]
CUDA_FP32_DTYPE_OPS = ["sum", "sum.dim_IntList", "softmax.int", "log_softmax.int", "cumsum", "prod"]
# CUDA runs rms_norm as one kernel forward (`_fused_rms_norm`) and one backward where input and weight dtypes
# match; on CPU the same op decomposes into pow/mean/rsqrt/mul before any dispatch mode sees it. The eager
# census counts CUDA's kernels (these two ops); the compiled path keeps the decomposition, which inductor fuses.


@torch.library.custom_op("roofline::fused_rms_norm", mutates_args=())
def fused_rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    raise NotImplementedError("counted on fake tensors only")


@fused_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.shape[:-1] + (1,), dtype=torch.float32)


@torch.library.custom_op("roofline::fused_rms_norm_backward", mutates_args=())
def fused_rms_norm_backward_op(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                               rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    raise NotImplementedError("counted on fake tensors only")


@fused_rms_norm_backward_op.register_fake
def _(grad, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], output[1])


def _backward(ctx, grad, _):
    return (*fused_rms_norm_backward_op(grad, *ctx.saved_tensors), None)


fused_rms_norm_op.register_autograd(_backward, setup_context=_setup)


@contextmanager
def cuda_autocast_policy(fused_rms_norm_kernel: bool = False):
    """Inside: CPU autocast follows CUDA's fp32 policy for CUDA_FP32_OPS (floating inputs cast to fp32) and
    CUDA_FP32_DTYPE_OPS (the op's dtype argument set to fp32), as these ops' AutocastCPU kernels, and
    F.rms_norm runs as on CUDA (fp32 under autocast; one fused kernel, `fused_rms_norm`, where input and weight
    dtypes match, if `fused_rms_norm_kernel`). Everything is put back on exit."""
    library = torch.library.Library("aten", "IMPL")
    no_autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    lower = (torch.bfloat16, torch.float16)

    def fp32(op):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(no_autocast):
                args, kwargs = torch.utils._pytree.tree_map(
                    lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in lower else t, (args, kwargs))
                return op(*args, **kwargs)
        return kernel

    def fp32_dtype(op):
        def kernel(x, *args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(no_autocast):
                if x.dtype in lower and kwargs.get("dtype") is None:
                    kwargs["dtype"] = torch.float32
                return op(x, *args, **kwargs)
        return kernel

    rms_norm_on_cpu = F.rms_norm

    def rms_norm(x, normalized_shape, weight=None, eps=None):
        if torch.is_autocast_enabled("cpu"):
            x, weight = x.float(), weight.float() if weight is not None else None
        with torch.autocast("cpu", enabled=False):
            if fused_rms_norm_kernel and weight is not None and weight.dtype == x.dtype:
                return fused_rms_norm_op(x, weight, 1e-6 if eps is None else eps)[0]
            return rms_norm_on_cpu(x, normalized_shape, weight, eps)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Overriding a previously registered kernel")
        warnings.filterwarnings("ignore", "Warning only once for all operators")
        for names, policy in ((CUDA_FP32_OPS, fp32), (CUDA_FP32_DTYPE_OPS, fp32_dtype)):
            for name in names:
                packet, _, overload = name.partition(".")
                library.impl(name, policy(getattr(getattr(aten, packet), overload or "default")), "AutocastCPU")
    F.rms_norm = rms_norm
    try:
        yield
    finally:
        F.rms_norm = rms_norm_on_cpu
        library._destroy()


def autocast(dtype: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != "fp32")


# ----------------------------------------------------------------------------------------------- blocks


def text_fields(data: SimpleNamespace) -> dict[str, tuple[int, ...]]:
    """The text embeddings of one sample by name and shape (data/latents.py's `text_shapes`): the data's, or the
    tokens and the pooled vector of `text_dims` (no mask) where it names none."""
    return getattr(data, "text_shapes", None) or text_shapes(data.text_tokens, data.text_dims)


@dataclass
class Conditioning:
    """A per-sample vector [B, width] a block takes after its streams, as the model hands it (`Cut` records it):
    the conditioning vector [B, D] of SD3, FLUX.1 and Qwen-Image, or one of the modulations FLUX.2 computes once
    outside its blocks ([B, 6 D] per stream into a double block, [B, 3 D] into a single one, in the modulation
    weights' dtype: models/blocks.py's `modulation`)."""
    width: int
    dtype: torch.dtype
    grad: bool  # needs a gradient: what makes it trains (the timestep embedders, FLUX.2's modulations: not under LoRA)


@dataclass
class BlockShape:
    batch: int
    image_tokens: int
    text_tokens: int
    width: int
    head_dim: int
    dtype: str = "bf16"  # autocast dtype, or fp32 (no autocast)
    # None: the conditioning vector [B, width] in the autocast dtype, with a gradient
    conditioning: list[Conditioning] | None = None
    stream_grad: bool = True  # the streams need a gradient (not into the first block when the embedders are frozen)
    masked: bool = False  # the text is padded, with a key mask over the joint sequence (Qwen-Image)


SINGLE_STREAM = (SingleTransformerBlock, SingleStreamBlock)  # FLUX.1's and FLUX.2's: one stream, the joint sequence
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")  # a transformer's lists of blocks, in order


def streams(block: nn.Module) -> int:
    return 1 if isinstance(block, SINGLE_STREAM) else 2


def block_kind(block: nn.Module) -> str:
    if isinstance(block, SINGLE_STREAM):
        return "single"
    if isinstance(block, QwenImageBlock):
        return "dual-stream" + ("" if block.attn.text_output else ", last (text not computed)")
    if block.attn.text_first:
        return "double"
    return ("joint" + (" + attn2" if block.dual_attention else "")
            + (", last (text pre-only)" if block.context_pre_only else ""))


def rotary(block: nn.Module) -> bool:
    return isinstance(block, SINGLE_STREAM) or block.attn.text_first


def block_arguments(block: nn.Module, s: BlockShape) -> tuple:
    """A block's arguments as the model hands them under autocast (outputs of linears, in the autocast dtype): the
    streams (the single blocks': the joint sequence), the conditioning (`Conditioning`), the rotary tables of FLUX,
    FLUX.2 and Qwen-Image (None: SD3's blocks take none), and Qwen-Image's key mask over the joint sequence (bool)."""
    act = torch.float32 if s.dtype == "fp32" else torch.bfloat16
    tokens = s.image_tokens + s.text_tokens
    conditioning = [torch.empty(s.batch, v.width, dtype=v.dtype, requires_grad=v.grad)
                    for v in s.conditioning or [Conditioning(s.width, act, True)]]
    rope = (torch.empty(tokens, s.head_dim), torch.empty(tokens, s.head_dim)) if rotary(block) else None
    if isinstance(block, SINGLE_STREAM):
        return torch.empty(s.batch, tokens, s.width, dtype=act, requires_grad=s.stream_grad), *conditioning, rope
    x = torch.empty(s.batch, s.image_tokens, s.width, dtype=act, requires_grad=s.stream_grad)
    c = torch.empty(s.batch, s.text_tokens, s.width, dtype=act, requires_grad=s.stream_grad)
    mask = [torch.ones(s.batch, 1, 1, tokens, dtype=torch.bool)] if s.masked else []
    return x, c, *conditioning, rope, *mask


def outputs(result) -> list[torch.Tensor]:
    return [o for o in (result if isinstance(result, tuple) else (result,)) if o is not None]


def fake_parameters(module: nn.Module) -> nn.Module:
    """`module` (a meta-device copy) with fake tensors of its parameters' and buffers' shapes, dtypes and
    requires_grad. Call under a FakeTensorMode: nothing is allocated."""
    for m in module.modules():  # to_empty's swap refuses fake tensors
        for name, p in list(m.named_parameters(recurse=False)):
            setattr(m, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad))
        for name, b in list(m.named_buffers(recurse=False)):
            setattr(m, name, torch.empty(b.shape, dtype=b.dtype))
    return module


def eager_census(block: nn.Module, shape: BlockShape) -> tuple[list[Kernel], Counter, int]:
    """The kernels of one forward and backward of `block` (a meta-device module, as training builds it), the
    bytes its forward saves for the backward, by what made them (`saved_activations`), and the bytes its matmuls
    and attention write in the forward."""
    block, saved = copy.deepcopy(block), Counter()
    with FakeTensorMode(allow_non_fake_inputs=True), cuda_autocast_policy(fused_rms_norm_kernel=True):  # nf4 levels
        fake_parameters(block)
        args = block_arguments(block, shape)
        census = OpCensus(block.parameters())
        with census:
            with saved_activations(census, tensors(args), saved), autocast(shape.dtype):
                out = outputs(block(*args))
            census.phase = "backward"
            torch.autograd.backward(out, [torch.empty_like(o) for o in out])
    return census.kernels, saved, census.heavy_outputs


# ----------------------------------------------------------------------------------------------- compiled


def compiled_graphs(block: nn.Module, shape: BlockShape) -> tuple[FakeTensorMode, dict[str, torch.fx.GraphModule]]:
    """The forward and backward graphs inductor receives for the block: AOTAutograd's joint graph with
    inductor's decompositions, split by the min-cut partitioner (what is saved, what the backward
    recomputes), as `torch.compile(block)` makes them."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    graphs = {}

    def capture(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)  # run on the fake tensors, for the backward to be traced
        return compiler

    block, mode = copy.deepcopy(block), FakeTensorMode(allow_non_fake_inputs=True)  # nf4 levels: a constant
    with mode, cuda_autocast_policy():
        fake_parameters(block)
        args = block_arguments(block, shape)
        inputs, params = tensors(args), dict(block.named_parameters())

        def forward(params, *inputs):  # the block's arguments with the traced tensors in their places
            traced = iter(inputs)
            call = torch.utils._pytree.tree_map_only(torch.Tensor, lambda _: next(traced), args)
            with autocast(shape.dtype):
                return tuple(outputs(torch.func.functional_call(block, params, call)))

        compiled = aot_function(forward, fw_compiler=capture("forward"), bw_compiler=capture("backward"),
                                partition_fn=partition_fn, decompositions=select_decomp_table())
        out = compiled(params, *inputs)
        torch.autograd.backward(out, [torch.empty_like(o) for o in out])
    return mode, graphs


def on_gpu(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph (traced on fake CPU tensors) with every device argument set to cuda:0."""
    gpu = torch.device("cuda", 0)
    for node in gm.graph.nodes:
        node.args, node.kwargs = torch.utils._pytree.tree_map(
            lambda a: gpu if isinstance(a, torch.device) else a, (node.args, node.kwargs))
    gm.recompile()
    return gm


@contextmanager
def inductor_without_gpu():
    """Inside, inductor lowers and schedules CUDA graphs on a machine without CUDA or Triton: H100 properties where
    it asks the device, and Triton taken as present (nothing is generated or compiled). Put back on exit, so that
    a process that compiles for its real GPU afterwards (benchmarks/train_step.py) is not misled."""
    import torch._inductor.scheduler as scheduler
    from torch._inductor.runtime.hints import DeviceProperties

    h100 = DeviceProperties(type="cuda", index=0, multi_processor_count=SMS, cc=90, major=9,
                            regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                            max_threads_per_block=1024, warp_size=32)
    create, has_triton = DeviceProperties.__dict__["create"], scheduler.has_triton
    DeviceProperties.create = classmethod(lambda cls, device: h100)
    scheduler.has_triton = lambda: True
    try:
        yield
    finally:
        DeviceProperties.create, scheduler.has_triton = create, has_triton


def scheduled_kernels(gm: torch.fx.GraphModule, mode: FakeTensorMode, backward: bool) -> list[Kernel]:
    """Inductor's kernels for one graph: its lowering and scheduler (with fusion) run as `torch.compile`
    runs them for a CUDA device, stopped before code generation. Bytes per kernel are the scheduler's
    `get_read_write_buffers_sizes` (what inductor's `metrics.num_bytes_accessed` sums)."""
    from torch._inductor.compile_fx import _recursive_post_grad_passes
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode
    from torch._inductor.virtualized import V

    phase = "backward" if backward else "forward"
    gm = on_gpu(gm)
    with mode:
        inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda:0")
                  for v in (n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")]
    kernels = []
    with inductor_without_gpu(), V.set_fake_mode(mode), mode, DebugContext():
        _recursive_post_grad_passes(gm, is_inference=False)
        graph = GraphLowering(gm, example_inputs=inputs, is_inference=False, is_backward=backward)
        with V.set_graph_handler(graph):
            graph.run(*inputs)
            graph._update_scheduler()
            for node in graph.scheduler.nodes:
                size = node.get_read_write_buffers_sizes()
                if isinstance(node, NopKernelSchedulerNode) or size == 0:
                    continue  # views, and the outputs an extern kernel already wrote
                if isinstance(node, ExternKernelSchedulerNode):
                    kernels.append(extern_kernel(node, size, phase))
                else:
                    kind = "fused reduction" if node.is_reduction() else "fused pointwise"
                    kernels.append(Kernel(kind, node.get_name(), 0, size, phase))
    return kernels


def extern_kernel(node, size: int, phase: str) -> Kernel:
    """A kernel inductor calls (a cuBLAS matmul, the attention op): its FLOPs and shape from the graph nodes it
    came from."""
    heavy = [o for o in node.node.origins if o.op == "call_function" and hasattr(o.target, "overloadpacket")
             and o.target.overloadpacket in MATMULS | ATTENTION]
    if not heavy:
        return Kernel("extern", "None", 0, size, phase)
    packet = heavy[0].target.overloadpacket
    flops = sum(flops_of(o.target.overloadpacket, *fx_values(o), o.meta["val"]) for o in heavy)
    kernel = Kernel(op_class(packet), str(packet), flops, size, phase)
    return heavy_details(kernel, packet, fx_values(heavy[0])[0], heavy[0].meta["val"])


def fx_values(node: torch.fx.Node) -> tuple[tuple, dict]:
    value = lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a  # noqa: E731
    return torch.utils._pytree.tree_map(value, (node.args, node.kwargs))


def compiled_census(block: nn.Module, shape: BlockShape) -> list[Kernel]:
    mode, graphs = compiled_graphs(block, shape)
    return [k for name, gm in graphs.items() for k in scheduled_kernels(gm, mode, backward=name == "backward")]


# ----------------------------------------------------------------------------------------------- outside the blocks


class Cut(nn.Module):
    """Stands in for a list of blocks while what runs outside them is counted: keeps what the model hands the
    list's first block (`inputs`: its streams, conditioning, rotary tables, ...) and returns new leaves of its
    streams' shapes (so the backward of what follows stops where the blocks' would start)."""

    def __init__(self, streams: int):
        super().__init__()
        self.streams = streams

    def forward(self, *inputs):
        self.inputs = inputs
        out = tuple(torch.empty_like(t, requires_grad=True) for t in inputs[:self.streams])
        return out if self.streams > 1 else out[0]

    def conditioning(self) -> list[Conditioning]:
        """The per-sample vectors [B, n] it was handed after its streams (the rotary tables come as a pair, the
        mask is [B, 1, 1, L])."""
        return [Conditioning(t.shape[-1], t.dtype, t.requires_grad) for t in self.inputs[self.streams:]
                if isinstance(t, torch.Tensor) and t.dim() == 2]


def graph_nodes(t: torch.Tensor) -> set:
    """The autograd nodes the backward of `t` runs through."""
    nodes, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return nodes


def outside_census(model: nn.Module, data: SimpleNamespace, batch: int,
                   dtype: str) -> tuple[list[Kernel], Counter, dict[str, list[Conditioning]]]:
    """The kernels of one micro-step's work outside the blocks, as train_mmdit_stable.forward_backward runs it (the
    noisy input, embedders, FLUX.2's shared modulations, final layer, loss, and their backward), the bytes it saves
    for the backward, and the conditioning the model hands the first block of each list (by the list's name)."""
    transformer = model.transformer
    lists = {name: blocks for name in BLOCK_LISTS if len(blocks := getattr(transformer, name, ()))}
    cuts = {name: Cut(streams(blocks[0])) for name, blocks in lists.items()}
    memo = {id(lists[name]): nn.ModuleList([cut]) for name, cut in cuts.items()}
    model, saved, (h, w) = copy.deepcopy(model, memo), Counter(), data.latent_sizes[-1]
    with FakeTensorMode(allow_non_fake_inputs=True), cuda_autocast_policy(fused_rms_norm_kernel=True):  # nf4 levels
        fake_parameters(model)
        x0, noise = (torch.empty(batch, data.latent_channels, h, w) for _ in range(2))
        sigma = torch.empty(batch)
        text = empty_text(text_fields(data), batch)
        with torch.no_grad(), autocast(dtype):  # FLUX's and Qwen-Image's rotary tables: made once per shape and
            model(x0, sigma, text)  # kept, not per step
        census = OpCensus(model.parameters())
        with census:
            with saved_activations(census, [], saved):
                with autocast(dtype):
                    v_pred = model(interpolate(x0, noise, sigma), sigma, text)
                loss = per_sample_loss(v_pred, x0, noise).sum() / batch
            # the blocks' inputs get their gradient in the loss's backward, as in training: FLUX.2's modulations and
            # its final layer both take the timestep embedding, whose backward runs once, on the sum. An input the
            # loss reaches too (the other families' conditioning vector, which their final layer takes) is left to
            # the loss: the blocks' gradient would only be added to it
            after_blocks = graph_nodes(loss)
            handed = [t for cut in cuts.values() for t in tensors(cut.inputs)
                      if t.requires_grad and t.grad_fn not in after_blocks]
            census.phase = "backward"
            torch.autograd.backward([loss, *handed], [None, *(torch.empty_like(t) for t in handed)])
    return census.kernels, saved, {name: cut.conditioning() for name, cut in cuts.items()}


# ----------------------------------------------------------------------------------------------- time


def attention_rate(backend: str, kernel: Kernel) -> float:
    if kernel.dtype == "fp32":
        return FP32_ATTENTION_RATE
    rates = ATTENTION_RATES[backend]
    head_dim = min(rates, key=lambda d: abs(d - kernel.head_dim))
    return rates[head_dim][kernel.phase == "backward"]


def kernel_seconds(kernel: Kernel, path: str, attention: str, flat_gemms: bool = False) -> float:
    """The slowest of its FLOPs at its rate (a matmul's by its shape; with `flat_gemms` every matmul at the measured
    large-matmul rate instead, to show what the GEMM model costs), its bytes at the memory rate, and the launch
    floor."""
    compute = 0.0
    if kernel.cls == "matmul":
        batch, m, n, _ = kernel.gemm
        rate = MEASURED_MATMUL[2] * (PEAK_TF32 / PEAK_BF16 if kernel.dtype == "fp32" else 1.0) if flat_gemms \
            else gemm_rate(m, n, batch, kernel.dtype)
        compute = kernel.flops / rate
    elif kernel.cls == "attention":
        work = ATTENTION_BACKWARD_WORK if kernel.phase == "backward" else 1.0
        compute = kernel.flops * work / attention_rate(attention, kernel)
    return max(compute, kernel.bytes / MEMORY_RATE, LAUNCH_FLOOR_S[path])


def seconds(kernels: list[Kernel], path: str, attention: str, flat_gemms: bool = False) -> float:
    """The kernels one after the other on an H100."""
    return sum(kernel_seconds(k, path, attention, flat_gemms) for k in kernels)


def model_flops(kernels: list[Kernel]) -> int:
    return sum(k.flops for k in kernels if k.cls in HEAVY)


def recompute_seconds(kernels: list[Kernel], path: str, attention: str, checkpointing: str,
                      flat_gemms: bool = False) -> float:
    """What the backward of a checkpointed block runs again: its whole forward (full), or the forward's kernels
    other than matmuls and attention, whose outputs selective checkpointing keeps (norms, modulation, activations,
    casts, copies)."""
    check_modelled(checkpointing)
    forward = [k for k in kernels if k.phase == "forward"]
    if checkpointing == "selective":
        forward = [k for k in forward if k.cls not in HEAVY]
    return seconds(forward, path, attention, flat_gemms) if checkpointing != "none" else 0.0


CHECKPOINTING = ("none", "selective", "full")


def check_modelled(checkpointing: str) -> None:
    if checkpointing not in CHECKPOINTING:
        raise ConfigError(f"training.activation_checkpointing={checkpointing} is not modelled here: expected one of "
                          f"{', '.join(CHECKPOINTING)}")


def rates_of(backend: str) -> str:
    """The attention rates (ATTENTION_RATES) of a training.attention_backend value, or of a rates name."""
    if backend in ATTENTION_RATES:
        return backend
    if backend not in CONFIG_BACKENDS:
        raise ConfigError(f"training.attention_backend={backend}: no published H100 rates here; expected one of "
                          f"{', '.join([*ATTENTION_RATES, *CONFIG_BACKENDS])}")
    return CONFIG_BACKENDS[backend]


# ----------------------------------------------------------------------------------------------- the step


@dataclass
class BlockCensus:
    kind: str
    indices: list[int]  # its places among the model's blocks
    kernels: dict[str, list[Kernel]]  # by path: eager, compiled
    saved: Counter  # bytes its forward saves for the backward, by what made them (eager census)
    input_bytes: int  # what it keeps when fully checkpointed: its inputs
    heavy_outputs: int  # what its matmuls and attention write in the forward: selective checkpointing keeps them
    frozen_bytes: int = 0  # its frozen weights as stored (a LoRA base): what block swapping copies

    @property
    def count(self) -> int:
        return len(self.indices)


@dataclass
class StepCensus:
    """What one micro-step runs, counted once per kind of block, and what the optimizer updates."""
    micro_batch: int
    dtype: str
    blocks: list[BlockCensus]
    kinds: list[str]  # the kind of each block, in the model's order
    outside: list[Kernel]  # eager (compile wraps the blocks only)
    outside_saved: Counter
    trained: int  # parameters the optimizer, the EMA, clipping and accumulation touch (fp32)
    stored_bytes: int  # parameters as stored (trained fp32, a frozen base in the compute dtype) and buffers
    tokens: int  # image + text tokens per sample


def count_step(cfg, data: SimpleNamespace, paths=("eager", "compiled")) -> StepCensus:
    """Census of the model `cfg` builds (on the meta device, as training builds it) for `data` (plan_memory.py's `released_data`): each
    kind of block on `paths` (eager always: it also gives the saved bytes), and the work outside the blocks."""
    model = build_trained_model(cfg, data, None)
    transformer, m, batch = model.transformer, cfg.model, cfg.training.train_batch_size
    dtype = "fp32" if cfg.training.dtype == "fp32" else "bf16"  # fp16 moves and multiplies as bf16 does
    outside, outside_saved, conditioning = outside_census(model, data, batch, dtype)
    list_of = {id(b): name for name in BLOCK_LISTS for b in getattr(transformer, name, ())}
    h, w = data.latent_sizes[-1]
    image_tokens = (h // m.patch_size) * (w // m.patch_size)
    shape = BlockShape(batch, image_tokens, data.text_tokens, m.num_attention_heads * m.attention_head_dim,
                       m.attention_head_dim, dtype, masked="prompt_embeds_mask" in text_fields(data))
    # with the embedders frozen (LoRA), nothing before the first block needs a gradient: its backward stops inside it
    embedders_trained = any(p.requires_grad for name, p in transformer.named_parameters() if name.split(".")[0] in
                            ("pos_embed", "x_embedder", "context_embedder", "img_in", "txt_in", "txt_norm"))
    kinds = [block_kind(b) + ("" if i or embedders_trained else ", first (no input gradient)")
             for i, b in enumerate(transformer.blocks)]
    blocks = []
    for kind in dict.fromkeys(kinds):
        indices = [i for i, k in enumerate(kinds) if k == kind]
        block, shape.stream_grad = transformer.blocks[indices[0]], indices[0] > 0 or embedders_trained
        shape.conditioning = conditioning[list_of[id(block)]]  # as the model hands it (a gradient where it trains)
        kernels = {}
        kernels["eager"], saved, heavy_outputs = eager_census(block, shape)
        if "compiled" in paths:
            kernels["compiled"] = compiled_census(block, shape)
        act_bytes = 4 if dtype == "fp32" else 2
        input_bytes = act_bytes * batch * (image_tokens + data.text_tokens + 1) * shape.width
        frozen = sum(p.numel() * p.element_size() for p in block.parameters() if not p.requires_grad)
        blocks.append(BlockCensus(kind, indices, kernels, saved, input_bytes, heavy_outputs, frozen))
    stored = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return StepCensus(batch, dtype, blocks, kinds, outside, outside_saved,
                      trained=sum(p.numel() for p in model.parameters() if p.requires_grad), stored_bytes=stored,
                      tokens=image_tokens + data.text_tokens)


@dataclass
class StepPrediction:
    seconds: float  # one optimizer step on one H100
    mfu: float
    model_flops: int  # per optimizer step (no recompute)
    terms: dict[str, float]  # seconds per optimizer step, by term; they sum to `seconds`
    blocks: dict[str, dict]  # per kind of block: its count and one block-step's ms, MFU and where its time goes
    memory_gib: float  # estimated peak (`peak_memory`)
    settings: dict


def block_times(census: StepCensus, path: str, attention: str, checkpointing: str = "none",
                every: int = 1) -> tuple[list[float], list[float]]:
    """Each block's forward and backward seconds, in the model's order (the backward with its recompute)."""
    checkpointed = set(range(0, len(census.kinds), every)) if checkpointing != "none" else set()
    by_kind = {b.kind: b for b in census.blocks}
    forward, backward = [], []
    for i, kind in enumerate(census.kinds):
        kernels = by_kind[kind].kernels[path]
        forward.append(seconds([k for k in kernels if k.phase == "forward"], path, attention))
        backward.append(seconds([k for k in kernels if k.phase == "backward"], path, attention)
                        + (recompute_seconds(kernels, path, attention, checkpointing) if i in checkpointed else 0.0))
    return forward, backward


def swap_stall(forward: list[float], backward: list[float], frozen: list[int], swapped: int,
               rate: float) -> tuple[float, float]:
    """(seconds of copying, seconds the compute waits for copies) of one micro-step with `swapped` blocks swapped
    (perf/block_swap.py's schedule): the forward starts s_0's copy as it starts; each swapped block s_k, once its
    copy is done, starts s_{k+1}'s; the backward keeps the last and starts s_{k-1}'s when s_k starts. Copies run
    one after another on the side stream, each at `rate` bytes/s, never before they are asked for."""
    if not swapped:
        return 0.0, 0.0
    order = swapped_blocks(len(forward), swapped)
    copy = {b: frozen[b] / rate for b in order}
    clock = side = stall = 0.0
    done = {}

    def ask(block: int) -> None:
        nonlocal side
        side = max(side, clock) + copy[block]
        done[block] = side

    for phase, blocks, times, step in (("forward", range(len(forward)), forward, 1),
                                       ("backward", range(len(forward) - 1, -1, -1), backward, -1)):
        if phase == "forward":
            ask(order[0])
        for i in blocks:
            if i in done:
                stall += max(0.0, done[i] - clock)
                clock = max(clock, done[i])
                k = order.index(i) + step
                if 0 <= k < len(order) and not (phase == "backward" and order[k] in done):
                    ask(order[k])
            clock += times[i]
        if phase == "forward":
            done = {order[-1]: done[order[-1]]}  # the last swapped block stays for the backward
    return sum(copy.values()) * 2 - copy[order[-1]], stall


def swap_rows(census: StepCensus, path: str, attention: str, checkpointing: str, every: int) -> list[dict]:
    """For each N: the bytes copied per micro-step, and per link the copying and waiting time."""
    attention = rates_of(attention)
    forward, backward = block_times(census, path, attention, checkpointing, every)
    by_kind = {b.kind: b for b in census.blocks}
    frozen = [by_kind[k].frozen_bytes for k in census.kinds]
    micro_step = sum(forward) + sum(backward)
    rows = []
    for n in range(1, len(frozen) + 1):
        row = {"swapped": n, "host_gib": sum(frozen[b] for b in swapped_blocks(len(frozen), n)) / GIB,
               "micro_step_s": micro_step}
        for link, rate in H2D_RATES.items():
            copying, stall = swap_stall(forward, backward, frozen, n, rate)
            row[link] = {"copy_s": copying, "stall_s": stall, "hidden": stall < HIDDEN * micro_step}
        row["gb_per_micro_step"] = row["PCIe 4.0 x16"]["copy_s"] * H2D_RATES["PCIe 4.0 x16"] / 1e9
        rows.append(row)
    return rows


def hidden_up_to(rows: list[dict], link: str) -> int:
    """The largest N whose copies, and those of every smaller N, stay hidden."""
    hidden = 0
    for row in rows:
        if not row[link]["hidden"]:
            break
        hidden = row["swapped"]
    return hidden


def predict(census: StepCensus, path: str, attention: str, micro_steps: int, checkpointing: str = "none",
            every: int = 1, fused_optimizer: bool = True, weight_decay: bool = False, fp16_scaler: bool = False,
            flat_gemms: bool = False, swapped: int = 0, h2d_rate: float = H2D_RATES["PCIe 5.0 x16"]) -> StepPrediction:
    """One optimizer step: `micro_steps` forward + backward passes of the census' micro-batch, with activation
    checkpointing's recompute in blocks 0, every, 2*every, ..., then the gradient's clipping, AdamW and the EMA.
    `flat_gemms`: every matmul at the measured large-matmul rate (what the GEMM model costs). `swapped`: blocks
    swapped (offload.blocks_to_swap), whose copies at `h2d_rate` add what they do not hide (`swap_stall`)."""
    attention = rates_of(attention)
    checkpointed = range(0, len(census.kinds), every) if checkpointing != "none" else range(0)
    recompute = {b.kind: recompute_seconds(b.kernels[path], path, attention, checkpointing, flat_gemms)
                 for b in census.blocks}
    adamw = ADAMW_FUSED_BYTES if fused_optimizer else ADAMW_FOREACH_BYTES + WEIGHT_DECAY_FOREACH_BYTES * weight_decay
    per_parameter = census.trained / MEMORY_RATE
    terms = {
        "blocks": micro_steps * sum(b.count * seconds(b.kernels[path], path, attention, flat_gemms)
                                    for b in census.blocks),
        "outside the blocks": micro_steps * seconds(census.outside, "eager", attention, flat_gemms),
        "checkpoint recompute": micro_steps * sum(recompute[census.kinds[i]] for i in checkpointed),
        "gradient accumulation": (micro_steps - 1) * ACCUMULATE_BYTES * per_parameter,
        "clipping": CLIP_BYTES * per_parameter,
        "AdamW": adamw * per_parameter,
        "EMA": EMA_BYTES * per_parameter,
    }
    if fp16_scaler:  # GradScaler.unscale_: reads and writes every gradient
        terms["fp16 unscale"] = 8 * per_parameter
    if swapped:
        by_kind = {b.kind: b for b in census.blocks}
        times = block_times(census, path, attention, checkpointing, every)
        terms["block swap copies not hidden"] = micro_steps * swap_stall(
            *times, [by_kind[k].frozen_bytes for k in census.kinds], swapped, h2d_rate)[1]
    flops = micro_steps * (sum(b.count * model_flops(b.kernels["eager"]) for b in census.blocks)
                           + model_flops(census.outside))
    total = sum(terms.values())
    peak = PEAK_TF32 if census.dtype == "fp32" else PEAK_BF16
    blocks = {}
    for b in census.blocks:
        split = defaultdict(float)
        for k in b.kernels[path]:
            split[k.cls if k.cls in HEAVY else "other"] += kernel_seconds(k, path, attention, flat_gemms)
        block_s = sum(split.values())
        blocks[b.kind] = {"count": b.count, "ms": block_s * 1e3,
                          "mfu": model_flops(b.kernels["eager"]) / block_s / peak,
                          **{f"{part} ms": split[part] * 1e3 for part in ("matmul", "attention", "other")},
                          "recompute ms": recompute[b.kind] * 1e3}
    settings = {"path": path, "attention": attention, "micro_batch": census.micro_batch, "micro_steps": micro_steps,
                "checkpointing": checkpointing, "every": every, "fused_optimizer": fused_optimizer,
                "gemm_rates": "flat" if flat_gemms else "waves", "swapped": swapped}
    return StepPrediction(total, flops / total / peak, flops, terms, blocks,
                          peak_memory(census, checkpointing, every) / GIB, settings)


def peak_memory(census: StepCensus, checkpointing: str, every: int = 1) -> float:
    """Bytes at the peak on the GPU, estimated by runtime/memory_plan.py's rule (weights, AdamW's moments, the EMA,
    the larger of the activations and the gradients, plus fragmentation and the CUDA context) with this census'
    `activation_bytes`. plan_memory.py is the reference where it plans the setting; this estimate is here for
    those it does not (selective, FLUX's single blocks)."""
    state = census.stored_bytes + 12 * census.trained  # the weights and buffers; AdamW's two moments and the EMA
    peak = state + max(activation_bytes(census, checkpointing, every), 4 * census.trained)  # the gradients grow
    return peak + FRAGMENTATION * peak + CUDA_CONTEXT  # as the activations are freed


def activation_bytes(census: StepCensus, checkpointing: str, every: int = 1) -> int:
    """The most the activations hold: what each block's forward saved (eager; autocast's bf16 copies of its
    weights included), or for a checkpointed block its inputs (full) or its inputs and every output of its matmuls
    and attention (selective, whether autograd needs them or not), while the block the backward is in holds all
    it saved; plus what the rest of the model saved."""
    kinds = {b.kind: b for b in census.blocks}
    checkpointed = set(range(0, len(census.kinds), every)) if checkpointing != "none" else set()
    kept, everything = [], []
    for i, kind in enumerate(census.kinds):
        b = kinds[kind]
        everything.append(sum(b.saved.values()))
        if i not in checkpointed:
            kept.append(everything[-1])
        elif checkpointing == "full":
            kept.append(b.input_bytes)
        else:
            kept.append(b.input_bytes + b.heavy_outputs)
    held = max([sum(kept)] + [sum(kept[:i]) + everything[i] for i in range(len(kept))])
    return held + sum(census.outside_saved.values())


_CENSUSES: dict[tuple, StepCensus] = {}


def census_paths(cfg) -> tuple[str, ...]:
    """The paths the census can count for `cfg`: eager, and compiled unless its LoRA base is nf4, whose level table
    (a constant) the census's fake-tensor compile cannot take. A config that compiles an nf4 base is refused."""
    if not (cfg.lora.enabled and cfg.lora.base_quantization == "nf4"):
        return ("eager", "compiled")
    if cfg.compile.enabled:
        raise ConfigError("lora.base_quantization=nf4 compiled: the census's fake-tensor compile cannot take the nf4 "
                          "level table (a constant); int8 and eager nf4 are modelled")
    return ("eager",)


def predict_step(cfg, data: SimpleNamespace | None = None, attention: str | None = None,
                 micro_steps: int | None = None) -> StepPrediction:
    """The optimizer step `cfg` configures (model, micro-batch, precision, activation checkpointing, compile,
    attention backend, LoRA, optimizer), predicted on one H100 SXM for `data` (latent_channels, latent_sizes,
    text_dims, text_tokens, as build_model takes it; default the released pipeline's at 1024 px).
    `attention` (fa2, cudnn, fa3, or a training.attention_backend value) and `micro_steps` override the config's.
    A census per model, micro-batch and path is made once per process (seconds to a minute on a CPU). Refused
    (ConfigError, a ValueError) before any census: what is not modelled (float8 matmuls, attention backends without
    published rates, activation checkpointing other than none, selective or full, nf4 compiled). Not counted:
    communication."""
    if cfg.float8.enabled:
        raise ConfigError("float8.enabled=true: float8 matmuls are not modelled (their rates by shape are not known "
                          "here)")
    census_paths(cfg)
    t = cfg.training
    rates_of(attention or t.attention_backend)
    check_modelled(t.activation_checkpointing)
    path = "compiled" if cfg.compile.enabled else "eager"
    data = data or released_data(cfg, 1024)
    key = (OmegaConf.to_yaml(cfg.model), OmegaConf.to_yaml(cfg.lora), t.train_batch_size, t.dtype, str(vars(data)),
           path)
    if key not in _CENSUSES:
        _CENSUSES[key] = count_step(cfg, data, (path,))
    return predict(_CENSUSES[key], path, attention or t.attention_backend, micro_steps or t.gradient_accumulation_steps,
                   t.activation_checkpointing, t.activation_checkpointing_every, cfg.optimizer.fused,
                   cfg.optimizer.weight_decay > 0, t.dtype == "fp16", swapped=cfg.offload.blocks_to_swap)


# ----------------------------------------------------------------------------------------------- presets


@dataclass
class Preset:
    config: str  # the fine-tuning config, relative to the repository
    architecture: dict  # the released model's sizes (in training, model.init_from's config.json gives them)
    overrides: tuple[str, ...] = ()  # what the census cannot count as configured, changed (printed with the config)


PRESETS = {
    "sd3-medium": Preset("configs/sd3_medium.yaml", RELEASED["sd3-medium"]),
    "sd3.5-medium": Preset("configs/sd35_medium.yaml", RELEASED["sd35-medium"]),
    "sd3.5-large": Preset("configs/sd35_large.yaml", RELEASED["sd35-large"]),
    "sd3.5-large-lora": Preset("configs/sd35_large_lora.yaml", RELEASED["sd35-large"]),
    "flux-dev-lora": Preset("configs/flux_dev_lora.yaml", RELEASED["flux-dev"]),
    "flux-dev": Preset("configs/flux_dev.yaml", RELEASED["flux-dev"]),
    "qwen-image-lora": Preset("configs/qwen_image_lora.yaml", RELEASED["qwen-image"]),
    "qwen-image": Preset("configs/qwen_image.yaml", RELEASED["qwen-image"]),
    "flux2-klein-4b-lora": Preset("configs/flux2_klein_4b_lora.yaml", RELEASED["flux2-klein-4b"]),
    "flux2-klein-9b-lora": Preset("configs/flux2_klein_9b_lora.yaml", RELEASED["flux2-klein-9b"]),
    "flux2-dev-lora": Preset("configs/flux2_dev_lora.yaml", RELEASED["flux2-dev"]),
    # its nf4 base compiled is not modelled (`census_paths`): the eager step, which moves more bytes than compiled
    "flux2-dev-lora-24gb": Preset("configs/flux2_dev_lora_24gb.yaml", RELEASED["flux2-dev"], ("compile.enabled=false",)),
    "flux2-dev": Preset("configs/flux2_dev.yaml", RELEASED["flux2-dev"]),
}


def preset_config(name: str, overrides: list[str] = ()) -> tuple:
    """The preset's config as training reads it (schema <- its YAML <- overrides) with the released architecture,
    and where its settings came from."""
    preset = PRESETS[name]
    base, source = OmegaConf.load(ROOT / preset.config), " ".join([preset.config, *preset.overrides])
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), base,
                              OmegaConf.from_dotlist([*preset.overrides, *overrides]))
    except OmegaConfBaseException as e:  # an unknown key, a wrong type or value
        raise ConfigError(f"{preset.config}: {e}".split("\n")[0]) from None
    for key in OmegaConf.missing_keys(cfg):
        OmegaConf.update(cfg, key, None)
    for key, value in preset.architecture.items():
        OmegaConf.update(cfg, f"model.{key}", value, merge=False)
    resolve_defaults(cfg)
    return cfg, source


# ----------------------------------------------------------------------------------------------- report


def block_rows(census: StepCensus) -> list[dict]:
    rows = []
    for b in census.blocks:
        for path, kernels in b.kernels.items():
            row = {"block": b.kind, "count": b.count, "path": path, "kernels": len(kernels),
                   "model_tflop": model_flops(kernels) / 1e12,
                   "gb_outside_matmul_attention": sum(k.bytes for k in kernels if k.cls not in HEAVY) / 1e9}
            for attention in ATTENTION_RATES:
                s = seconds(kernels, path, attention)
                row[attention] = {"ms": s * 1e3, "mfu": model_flops(b.kernels["eager"]) / s / PEAK_BF16}
            rows.append(row)
    return rows


def gemm_rows(census: StepCensus, path: str) -> list[dict]:
    """The matmul shapes of each kind of block that take 2 % or more of its matmul time, with the FLOP/s the GEMM
    model gives them and the FLOP/s they run at in the prediction (their bytes and launches included)."""
    rows = []
    for b in census.blocks:
        shapes = defaultdict(lambda: [0, 0.0])
        for k in b.kernels[path]:
            if k.cls == "matmul":
                shapes[(k.gemm, k.dtype)][0] += k.flops
                shapes[(k.gemm, k.dtype)][1] += kernel_seconds(k, path, "fa3")
        total = sum(s for _, s in shapes.values())
        for ((batch, m, n, k), dtype), (flops, s) in sorted(shapes.items(), key=lambda kv: -kv[1][1]):
            if s >= 0.02 * total:
                rows.append({"block": b.kind, "batch": batch, "m": m, "n": n, "k": k, "dtype": dtype,
                             "time_share": s / total, "model_tflops": gemm_rate(m, n, batch, dtype) / 1e12,
                             "effective_tflops": flops / s / 1e12})
    return rows


def print_swaps(rows: list[dict], census: StepCensus, s: dict) -> None:
    """Block swapping by N: what it copies and what the compute waits for, on each link."""
    links = list(H2D_RATES)
    frozen = sum(b.frozen_bytes * b.count for b in census.blocks)
    print(f"\nBlock swapping (offload.blocks_to_swap=N; {s['path']}, {s['attention']}, checkpointing "
          f"{s['checkpointing']}): {frozen / GIB:.1f} GiB of frozen block weights; a micro-step computes "
          f"{rows[0]['micro_step_s'] * 1e3:.0f} ms of blocks; per micro-step, ms copying and (waiting):\n")
    print("| N | GiB in host memory | GB copied per micro-step | " + " | ".join(links) + " |")
    print("|---|---|---|" + "---|" * len(links))
    shown = sorted({1, *(hidden_up_to(rows, link) for link in links), *(hidden_up_to(rows, link) + 1 for link in links),
                    len(rows) // 4, len(rows) // 2, 3 * len(rows) // 4, len(rows)} - {0} & set(range(1, len(rows) + 1)))
    for n in shown:
        r = rows[n - 1]
        print(f"| {n} | {r['host_gib']:.1f} | {r['gb_per_micro_step']:.1f} | " + " | ".join(
            f"{r[link]['copy_s'] * 1e3:.0f} ({r[link]['stall_s'] * 1e3:.0f})" for link in links) + " |")
    print("\nThe copies hide behind compute (waits under 1 % of the micro-step) up to N = " + ", ".join(
        f"{hidden_up_to(rows, link)} on {link}" for link in links) + f" of {len(rows)} blocks.")


def print_report(name: str, source: str, census: StepCensus, configured: StepPrediction, steps: list[dict],
                 gemms: list[dict], sharded: bool, swaps: list[dict] | None = None) -> None:
    s = configured.settings
    print(f"\n## {name}: {source}")
    if sharded:
        print("A sharded config (FSDP/HSDP): each GPU runs the micro-steps as predicted; clipping, AdamW and the EMA act "
              "on its shard only (their terms here are for all parameters), communication is not counted, and the "
              "memory column is for one unsharded GPU (plan_memory.py plans the sharded run).")
    print(f"micro-batch {s['micro_batch']} x {s['micro_steps']} micro-steps, {census.dtype}, {s['path']}, activation "
          f"checkpointing {s['checkpointing']}" + (f" every {s['every']}" if s["every"] > 1 else "")
          + f", attention at {s['attention']} rates, {census.trained / 1e9:.3g} B trained parameters, "
          f"{census.tokens} tokens per sample")
    print("\nBlock-step (forward + backward of one block at the micro-batch):\n")
    print("| block (count) | path | kernels | model TFLOP | GB outside matmul + attention | "
          "ms, MFU: FA2 / cuDNN / FA3 |")
    print("|---|---|---|---|---|---|")
    for r in block_rows(census):
        times = " / ".join(f"{r[a]['ms']:.2f}, {r[a]['mfu']:.0%}" for a in ATTENTION_RATES)
        print(f"| {r['block']} ({r['count']}) | {r['path']} | {r['kernels']} | {r['model_tflop']:.2f} | "
              f"{r['gb_outside_matmul_attention']:.2f} | {times} |")
    print(f"\nWhere a block-step's time goes ({s['path']}, {s['attention']}): " + "; ".join(
        f"{kind}: matmul {b['matmul ms']:.2f}, attention {b['attention ms']:.2f}, other {b['other ms']:.2f} ms, "
        f"recompute {b['recompute ms']:.2f} ms ({s['checkpointing']})" for kind, b in configured.blocks.items()))
    print(f"\nMatmul shapes M x N x K ({s['path']}; share of the block's matmul time; TFLOP/s by the GEMM model, and "
          f"as predicted with bytes and launches): " + "; ".join(
              f"{g['block']} {'%d x ' % g['batch'] if g['batch'] > 1 else ''}{g['m']}x{g['n']}x{g['k']}"
              f"{' fp32' if g['dtype'] == 'fp32' else ''} {g['time_share']:.0%} {g['model_tflops']:.0f}/"
              f"{g['effective_tflops']:.0f}" for g in gemms))
    print(f"\nOptimizer step ({s['path']}, micro-batch {s['micro_batch']} x {s['micro_steps']}): s and MFU by "
          f"attention; memory estimated (`peak_memory`)\n")
    print("| activation checkpointing | memory GiB | FA2 | cuDNN | FA3 | FA3, every GEMM at 800 TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for row in steps:
        cells = " | ".join(f"{row[a]['seconds']:.3f} s, {row[a]['mfu']:.1%}" for a in (*ATTENTION_RATES, "fa3 flat"))
        print(f"| {row['checkpointing']} | {row['memory_gib']:.1f} | {cells} |")
    if swaps:
        print_swaps(swaps, census, s)
    print(f"\nAs configured: {configured.seconds:.3f} s, MFU {configured.mfu:.1%} "
          f"({configured.model_flops / 1e12:.1f} model TFLOP per step); by term: " + ", ".join(
              f"{term} {t * 1e3:.1f} ms ({t / configured.seconds:.0%})" for term, t in configured.terms.items()))


def run_preset(name: str, cfg, source: str, checkpointing: str | None, attention: str | None,
               resolution: int) -> dict:
    t = cfg.training
    path = "compiled" if cfg.compile.enabled else "eager"
    census = count_step(cfg, released_data(cfg, resolution), census_paths(cfg))
    common = dict(micro_steps=t.gradient_accumulation_steps, fused_optimizer=cfg.optimizer.fused,
                  weight_decay=cfg.optimizer.weight_decay > 0, fp16_scaler=t.dtype == "fp16")
    checkpointing = checkpointing or t.activation_checkpointing
    every = t.activation_checkpointing_every if checkpointing == t.activation_checkpointing else 1
    configured = predict(census, path, attention or t.attention_backend, checkpointing=checkpointing, every=every,
                         swapped=cfg.offload.blocks_to_swap, **common)
    steps = []
    for mode in CHECKPOINTING:
        row = {"checkpointing": mode, "memory_gib": peak_memory(census, mode) / GIB}
        for column, backend, flat in [*((a, a, False) for a in ATTENTION_RATES), ("fa3 flat", "fa3", True)]:
            p = predict(census, path, backend, checkpointing=mode, flat_gemms=flat, **common)
            row[column] = {"seconds": p.seconds, "mfu": p.mfu, "terms": p.terms}
        steps.append(row)
    gemms = gemm_rows(census, path)
    swaps = swap_rows(census, path, attention or t.attention_backend, checkpointing, every) if cfg.lora.enabled else []
    print_report(name, source, census, configured, steps, gemms, cfg.parallel.strategy != "ddp", swaps)
    return {"config": source, "dtype": census.dtype, "trained_parameters": census.trained,
            "tokens_per_sample": census.tokens, "blocks": block_rows(census), "gemm_rates": gemms, "step": steps,
            "as_configured": asdict(configured), "block_swap": swaps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), action="append", help="default: every preset")
    p.add_argument("--batch", type=int, help="micro-batch (training.train_batch_size)")
    p.add_argument("--checkpointing", choices=CHECKPOINTING, help="instead of the config's")
    p.add_argument("--attention", choices=sorted(ATTENTION_RATES), help="instead of the config's backend")
    p.add_argument("--resolution", type=int, default=1024, help="image side in pixels")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "roofline.json", help="'-': none")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    overrides = [*args.overrides, *([f"training.train_batch_size={args.batch}"] if args.batch else [])]
    try:  # the user's input, all of it before any census: one line, exit 2
        configs = {name: preset_config(name, overrides) for name in args.preset or PRESETS}
        for cfg, _ in configs.values():
            rates_of(args.attention or cfg.training.attention_backend)
            check_modelled(args.checkpointing or cfg.training.activation_checkpointing)
            census_paths(cfg)
    except InputError as e:
        print(f"roofline: {e}", file=sys.stderr)
        return 2
    print("Assumptions (every figure below is a prediction made on a CPU, not a measurement):")
    for what, value, source in ASSUMPTIONS:
        print(f"- {what}: {value} ({source})")
    runs = json.loads(args.json.read_text()) if str(args.json) != "-" and args.json.exists() else {}
    for name, (cfg, source) in configs.items():
        result = run_preset(name, cfg, source, args.checkpointing, args.attention, args.resolution)
        flags = [*overrides, *(f"--{k} {getattr(args, k)}" for k in ("checkpointing", "attention") if getattr(args, k)),
                 *([f"--resolution {args.resolution}"] if args.resolution != 1024 else [])]
        runs[" ".join([name, *flags])] = {**result, "assumptions": ASSUMPTIONS}
    if str(args.json) != "-":
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
