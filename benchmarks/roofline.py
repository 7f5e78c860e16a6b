"""Op census and roofline of one MMDiT joint block-step (forward + backward), without a GPU.

    python benchmarks/roofline.py                       # SD3-medium block, 1024 px, batch 4, bf16: table + JSON
    python benchmarks/roofline.py --preset sd3.5-large  # or sd3.5-medium; --width/--heads/... for other shapes

The block runs on fake tensors (no memory, no GPU: torch's FakeTensorMode) under bf16 autocast with CUDA's
autocast policy (`cuda_autocast_policy`), so autocast inserts the casts it inserts on a GPU. Two paths:

- eager: every aten op the forward and backward dispatch, recorded below autograd (a TorchDispatchMode), with
  its FLOPs (torch's flop counter formulas) and the bytes it reads and writes (the memory its tensors span;
  views launch nothing and are not counted).
- compiled: the graphs `torch.compile` hands inductor (AOTAutograd's joint graph with inductor's
  decompositions and joint-graph passes, split by its min-cut partitioner, then its post-grad passes), lowered
  and scheduled by inductor itself for a CUDA device and stopped before code generation (`scheduled_kernels`):
  its kernels after fusion, each with the bytes its scheduler node reads and writes
  (`get_read_write_buffers_sizes`, what `torch._inductor.metrics.num_bytes_accessed` sums). Default mode:
  matmuls are cuBLAS calls (extern kernels), nothing is fused into them.

The time a path implies on an H100 SXM: each kernel takes the longest of its FLOPs at its rate, its bytes at
the measured memory rate, and a floor per launch; the block-step time is their sum (no overlap between
kernels). MFU = model FLOPs (matmuls and attention) / (time x dense bf16 peak).
"""

import argparse
import json
import math
import sys
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project folders import by their names

from models.blocks import JointTransformerBlock  # noqa: E402

aten = torch.ops.aten

# ----------------------------------------------------------------------------------------------- H100 rates

PEAK_BF16 = 989e12  # H100 SXM dense bf16 FLOP/s (NVIDIA datasheet; the 1979 figure is with sparsity)
PEAK_TF32 = 495e12  # H100 SXM dense TF32 FLOP/s (datasheet): fp32 matmuls with allow_tf32
MATMUL_RATE = 800e12  # bf16 matmul FLOP/s reached: ~798 measured on an 8192^3 matmul (H100 80GB HBM3, torch 2.11)
MEMORY_RATE = 3.0e12  # bytes/s read + written: measured device-to-device copy on the same H100 (datasheet 3.35)
# attention FLOP/s at head dim 64, sequence ~4k, non-causal (FlashAttention-3 paper, forward; the backward is
# assumed to run at the same rate): FA2 321-330, cuDNN 408 (up to 630 at head dim 128), FA3 476
ATTENTION_RATES = {"fa2": 330e12, "cudnn": 410e12, "fa3": 476e12}
# the shortest a kernel takes on the GPU timeline: eager PyTorch spends ~5 us of host time dispatching and
# launching each op (assumed; a GPU kernel shorter than that leaves the GPU idle), inductor's generated
# wrapper ~2 us per kernel (assumed)
LAUNCH_FLOOR_S = {"eager": 5e-6, "compiled": 2e-6}

# fp32 attention (SDPA's memory-efficient kernel; flash needs 16-bit inputs) runs without tensor cores: H100 SXM's
# fp32 peak is 67 TFLOP/s; assumed 50
FP32_ATTENTION_RATE = 50e12

PRESETS = {  # one joint block of each released architecture (dual attention: SD3.5-medium's first 13 blocks)
    "sd3-medium": dict(width=1536, heads=24, qk_norm=False, dual_attention=False),
    "sd3.5-medium": dict(width=1536, heads=24, qk_norm=True, dual_attention=True),
    "sd3.5-large": dict(width=2432, heads=38, qk_norm=True, dual_attention=False),
}

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
                  aten._scaled_dot_product_flash_attention_for_cpu_backward):  # as the CUDA flash kernels count
        q, k = args[0], args[1]
        if packet is aten._scaled_dot_product_flash_attention_for_cpu_backward:
            q, k = args[1], args[2]
        forward = 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]  # q k^T and p v
        return forward if packet is aten._scaled_dot_product_flash_attention_for_cpu else 2 * forward
    formula = flop_registry.get(packet)
    return int(formula(*args, **kwargs, out_val=out)) if formula else 0


@dataclass
class Kernel:
    cls: str
    op: str
    flops: int
    bytes: int


class OpCensus(TorchDispatchMode):
    """Records every aten op that launches a kernel: its class, FLOPs, and bytes read + written."""

    def __init__(self):
        super().__init__()
        self.kernels: list[Kernel] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if func.namespace not in ("aten", "roofline") or func.is_view or packet in NO_KERNEL:
            return out
        if packet is aten._to_copy and args[0].dtype == kwargs.get("dtype", args[0].dtype) \
                and args[0].device == kwargs.get("device", args[0].device):
            return out  # a no-op conversion
        read = sum(footprint(t) for t in tensors((args, kwargs)))
        written = sum(footprint(t) for t in tensors(out))
        if packet is aten.copy_:  # writes its first argument without reading it
            read -= footprint(args[0])
        self.kernels.append(Kernel(op_class(packet), packet.__name__, flops_of(packet, args, kwargs, out),
                                   read + written))
        return out


# ----------------------------------------------------------------------------------------------- the block


@dataclass
class Shape:
    width: int = 1536
    heads: int = 24
    qk_norm: bool = False
    dual_attention: bool = False
    image_tokens: int = 4096  # 1024 px: 128x128 latents, patch 2
    text_tokens: int = 333  # CLIP-L + CLIP-G (77) and T5 (256) tokens
    batch: int = 4
    dtype: str = "bf16"  # autocast dtype, or fp32 (no autocast)


def block_and_inputs(shape: Shape):
    """One joint block with fp32 (master) weights, and its inputs as the model hands them to a block under
    autocast: the residual streams in the autocast dtype (outputs of linears), temb too. Call under a
    FakeTensorMode: nothing is allocated."""
    with torch.device("meta"):
        block = JointTransformerBlock(shape.width, shape.heads, shape.qk_norm, context_pre_only=False,
                                      dual_attention=shape.dual_attention)
    for module in block.modules():  # to_empty's swap refuses fake tensors
        for name, param in module.named_parameters(recurse=False):
            setattr(module, name, torch.nn.Parameter(torch.empty(param.shape)))
    act = torch.float32 if shape.dtype == "fp32" else torch.bfloat16
    x = torch.empty(shape.batch, shape.image_tokens, shape.width, dtype=act, requires_grad=True)
    c = torch.empty(shape.batch, shape.text_tokens, shape.width, dtype=act, requires_grad=True)
    temb = torch.empty(shape.batch, shape.width, dtype=act, requires_grad=True)
    return block, (x, c, temb)


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


def autocast(shape: Shape):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=shape.dtype != "fp32")


def step(block, inputs, shape: Shape):
    with autocast(shape):
        x, c = block(*inputs)
    torch.autograd.backward([x, c], [torch.empty_like(x), torch.empty_like(c)])


def eager_census(shape: Shape) -> list[Kernel]:
    with FakeTensorMode(), cuda_autocast_policy(fused_rms_norm_kernel=True):
        block, inputs = block_and_inputs(shape)
        census = OpCensus()
        with census:
            step(block, inputs, shape)
    return census.kernels


# ----------------------------------------------------------------------------------------------- compiled


def compiled_graphs(shape: Shape) -> tuple[FakeTensorMode, dict[str, torch.fx.GraphModule]]:
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

    mode = FakeTensorMode()
    with mode, cuda_autocast_policy():
        block, inputs = block_and_inputs(shape)
        params = dict(block.named_parameters())

        def forward(params, x, c, temb):
            with autocast(shape):
                return torch.func.functional_call(block, params, (x, c, temb))

        compiled = aot_function(forward, fw_compiler=capture("forward"), bw_compiler=capture("backward"),
                                partition_fn=partition_fn, decompositions=select_decomp_table())
        x, c = compiled(params, *inputs)
        torch.autograd.backward([x, c], [torch.empty_like(x), torch.empty_like(c)])
    return mode, graphs


def on_gpu(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph (traced on fake CPU tensors) with every device argument set to cuda:0."""
    gpu = torch.device("cuda", 0)
    for node in gm.graph.nodes:
        node.args, node.kwargs = torch.utils._pytree.tree_map(
            lambda a: gpu if isinstance(a, torch.device) else a, (node.args, node.kwargs))
    gm.recompile()
    return gm


def inductor_without_gpu() -> None:
    """Lets inductor lower and schedule CUDA graphs on a machine without CUDA or Triton: H100 properties where
    it asks the device, and Triton taken as present (nothing is generated or compiled)."""
    import torch._inductor.scheduler as scheduler
    from torch._inductor.runtime.hints import DeviceProperties

    h100 = DeviceProperties(type="cuda", index=0, multi_processor_count=132, cc=90, major=9,
                            regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                            max_threads_per_block=1024, warp_size=32)
    DeviceProperties.create = classmethod(lambda cls, device: h100)
    scheduler.has_triton = lambda: True


def scheduled_kernels(gm: torch.fx.GraphModule, mode: FakeTensorMode, backward: bool) -> list[Kernel]:
    """Inductor's kernels for one graph: its lowering and scheduler (with fusion) run as `torch.compile`
    runs them for a CUDA device, stopped before code generation. Bytes per kernel are the scheduler's
    `get_read_write_buffers_sizes` (what inductor's `metrics.num_bytes_accessed` sums)."""
    from torch._inductor.compile_fx import _recursive_post_grad_passes
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode
    from torch._inductor.virtualized import V

    inductor_without_gpu()
    gm = on_gpu(gm)
    with mode:
        inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda:0")
                  for v in (n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")]
    kernels = []
    with V.set_fake_mode(mode), mode, DebugContext():
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
                    origins = [o for o in node.node.origins if o.op == "call_function"]
                    packet = next((o.target.overloadpacket for o in origins if hasattr(o.target, "overloadpacket")
                                   and o.target.overloadpacket in MATMULS | ATTENTION), None)
                    cls = op_class(packet) if packet else "extern"
                    flops = sum(flops_of(o.target.overloadpacket, *fx_values(o), o.meta["val"]) for o in origins
                                if hasattr(o.target, "overloadpacket") and o.target.overloadpacket in MATMULS | ATTENTION)
                    kernels.append(Kernel(cls, str(packet), flops, size))
                else:
                    kind = "fused reduction" if node.is_reduction() else "fused pointwise"
                    kernels.append(Kernel(kind, node.get_name(), 0, size))
    return kernels


def fx_values(node: torch.fx.Node) -> tuple[tuple, dict]:
    value = lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a  # noqa: E731
    return torch.utils._pytree.tree_map(value, (node.args, node.kwargs))


def compiled_census(shape: Shape) -> list[Kernel]:
    mode, graphs = compiled_graphs(shape)
    return [k for name, gm in graphs.items() for k in scheduled_kernels(gm, mode, backward=name == "backward")]


# ----------------------------------------------------------------------------------------------- time


def predicted_time(kernels: list[Kernel], path: str, attention: str, dtype: str) -> float:
    """Seconds for the kernels one after the other on an H100: each at the slowest of its FLOPs at its rate,
    its bytes at the memory rate, and the launch floor."""
    matmul_rate = MATMUL_RATE if dtype == "bf16" else MATMUL_RATE * PEAK_TF32 / PEAK_BF16
    attention_rate = ATTENTION_RATES[attention] if dtype == "bf16" else FP32_ATTENTION_RATE
    total = 0.0
    for k in kernels:
        rate = matmul_rate if k.cls == "matmul" else attention_rate if k.cls == "attention" else math.inf
        total += max(k.flops / rate, k.bytes / MEMORY_RATE, LAUNCH_FLOOR_S[path])
    return total


# ----------------------------------------------------------------------------------------------- report


def summarize(kernels: list[Kernel]) -> dict:
    by_class = defaultdict(lambda: {"kernels": 0, "flops": 0, "bytes": 0})
    for k in kernels:
        row = by_class[k.cls]
        row["kernels"] += 1
        row["flops"] += k.flops
        row["bytes"] += k.bytes
    heavy = [k for k in kernels if k.cls in ("matmul", "attention")]
    return {"kernels": len(kernels),
            "model_flops": sum(k.flops for k in heavy),
            "matmul_flops": sum(k.flops for k in heavy if k.cls == "matmul"),
            "attention_flops": sum(k.flops for k in heavy if k.cls == "attention"),
            "bytes_outside_matmul_attention": sum(k.bytes for k in kernels if k.cls not in ("matmul", "attention")),
            "by_class": dict(sorted(by_class.items(), key=lambda kv: -kv[1]["bytes"]))}


def census(shape: Shape, kernels: dict[str, list[Kernel]] | None = None) -> dict:
    """Both paths of one block-step (their `kernels`, counted here if not given): counts per op class and the
    H100 time and MFU they imply."""
    kernels = kernels or {"eager": eager_census(shape), "compiled": compiled_census(shape)}
    result = {"shape": asdict(shape), "rates": {"peak_bf16": PEAK_BF16, "matmul": MATMUL_RATE, "memory": MEMORY_RATE,
                                                "attention": ATTENTION_RATES, "launch_floor_s": LAUNCH_FLOOR_S}}
    for path in ("eager", "compiled"):
        row = summarize(kernels[path])
        peak = PEAK_BF16 if shape.dtype == "bf16" else PEAK_TF32
        row["h100"] = {}
        for attention in ATTENTION_RATES:
            seconds = predicted_time(kernels[path], path, attention, shape.dtype)
            row["h100"][attention] = {"ms": round(seconds * 1e3, 3), "mfu": round(row["model_flops"] / seconds / peak, 3)}
        result[path] = row
    return result


def table(result: dict) -> str:
    lines = ["| path | kernels | matmul + attention TFLOP | GB outside them | largest classes (GB) | H100 ms (MFU) "
             "FA2 / cuDNN / FA3 |", "|---|---|---|---|---|---|"]
    for path in ("eager", "compiled"):
        r = result[path]
        classes = ", ".join(f"{name} {v['bytes'] / 1e9:.2f}" for name, v in r["by_class"].items()
                            if name not in ("matmul", "attention"))
        times = " / ".join(f"{t['ms']:.2f} ({t['mfu']:.0%})" for t in r["h100"].values())
        lines.append(f"| {path} | {r['kernels']} | {r['model_flops'] / 1e12:.2f} | "
                     f"{r['bytes_outside_matmul_attention'] / 1e9:.2f} | {classes} | {times} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="sd3-medium")
    for name in ("width", "heads", "image_tokens", "text_tokens", "batch"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help="overrides the preset")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "roofline.json", help="'-': none")
    args = p.parse_args(argv)
    shape = Shape(**PRESETS[args.preset], dtype=args.dtype)
    for name in ("width", "heads", "image_tokens", "text_tokens", "batch"):
        if getattr(args, name) is not None:
            setattr(shape, name, getattr(args, name))
    result = census(shape)
    print(f"{args.preset}: {asdict(shape)}")
    print(table(result))
    if str(args.json) != "-":
        runs = json.loads(args.json.read_text()) if args.json.exists() else {}
        preset = asdict(Shape(**PRESETS[args.preset]))
        key = " ".join([args.preset, *(f"{k}={v}" for k, v in asdict(shape).items() if v != preset[k])])
        runs[key] = result
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
