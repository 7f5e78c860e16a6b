"""The op census (benchmarks/roofline.py) on a tiny joint block: CUDA's autocast reproduced on CPU, FLOPs equal
to the block's arithmetic on both paths, the compiled path moving fewer bytes in fewer kernels, and no cast
of an activation around the norms or the modulation."""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import roofline  # noqa: E402

TINY = roofline.Shape(width=64, heads=4, qk_norm=True, image_tokens=16, text_tokens=8, batch=2)

OPS = {"layer_norm": lambda x, w: F.layer_norm(x, x.shape[-1:]), "rms_norm": lambda x, w: F.rms_norm(x, x.shape[-1:]),
       "sum": lambda x, w: x.sum(), "sum_dim": lambda x, w: x.sum(0), "pow": lambda x, w: x.pow(2),
       "rsqrt": lambda x, w: x.rsqrt(), "softmax": lambda x, w: x.softmax(-1), "mean": lambda x, w: x.mean(-1),
       "linear": lambda x, w: F.linear(x, w), "silu": lambda x, w: F.silu(x),
       "gelu": lambda x, w: F.gelu(x, approximate="tanh")}


def output_dtypes(device: str) -> dict[str, torch.dtype]:
    with FakeTensorMode():
        x, w = torch.empty(8, 8, device=device, dtype=torch.bfloat16), torch.empty(8, 8, device=device)
        return {name: op(x, w).dtype for name, op in OPS.items()}


def test_cpu_autocast_follows_cuda_autocast_inside_the_census_only():
    """Fake CUDA tensors run a forward (not autograd) on a CPU build: CUDA autocast's output dtypes are the
    reference for the policy the census puts on CPU autocast, and CPU autocast is itself again after it."""
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        cuda = output_dtypes("cuda")
    finally:
        torch.set_autocast_enabled("cuda", False)
    with roofline.cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert output_dtypes("cpu") == cuda
    assert cuda["layer_norm"] == torch.float32  # the ops the policy changes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert output_dtypes("cpu")["layer_norm"] == torch.bfloat16  # CPU's own policy, put back


@pytest.fixture(scope="module")
def census():
    kernels = {"eager": roofline.eager_census(TINY), "compiled": roofline.compiled_census(TINY)}
    return {**roofline.census(TINY, kernels), "eager kernels": kernels["eager"]}


def test_both_paths_count_the_block_flops(census):
    """Forward and backward of every matmul (inputs and weights need gradients: 3x the forward) and of the
    attention (forward 2 matmuls, backward 4)."""
    d, b, tokens = TINY.width, TINY.batch, TINY.image_tokens + TINY.text_tokens
    per_token = 2 * 2 * 12 * d * d  # two streams' q, k, v, out (4 D^2) and MLP (8 D^2), 2 FLOPs per MAC
    adaln = 2 * 2 * 6 * d * d * b  # once per sample: two streams' 6 D x D modulation
    matmul = 3 * (per_token * b * tokens // 2 + adaln)  # each token passes through one stream's weights
    attention = 3 * 4 * b * tokens * tokens * d
    for path in ("eager", "compiled"):
        assert (census[path]["matmul_flops"], census[path]["attention_flops"]) == (matmul, attention), path


def test_compiled_moves_fewer_bytes_in_fewer_kernels(census):
    eager, compiled = census["eager"], census["compiled"]
    assert compiled["kernels"] < eager["kernels"]
    assert compiled["bytes_outside_matmul_attention"] < eager["bytes_outside_matmul_attention"]
    assert set(compiled["by_class"]) <= {"matmul", "attention", "fused pointwise", "fused reduction"}
    assert all(t["ms"] > 0 for t in compiled["h100"].values())


def test_eager_block_casts_no_activation_and_runs_fused_norms(census):
    """Under autocast the casts are the matmuls' weights and biases and the RMSNorm weights (fp32 -> bf16 and
    their gradients back, 6 bytes per element each way) and per-sample [B, D] vectors (the modulation's
    input, shifts, scales, gates): no activation is cast around a norm, the modulation or a residual update,
    and the RMSNorm is one kernel each way, not pow/mean/rsqrt."""
    with torch.device("meta"):
        block = roofline.JointTransformerBlock(TINY.width, TINY.heads, TINY.qk_norm, False, False)
    cast_weights = [p for name, p in block.named_parameters() if not name.startswith("norm1")]  # not adaLN's
    allowed = {6 * p.numel() for p in cast_weights} | {6 * TINY.batch * TINY.width}
    casts = [k.bytes for k in census["eager kernels"] if k.cls == "cast"]
    assert casts and set(casts) <= allowed, sorted(set(casts) - allowed)
    assert sum(casts) >= 2 * sum(6 * p.numel() for p in cast_weights)  # each weight forward, its gradient back
    classes = census["eager"]["by_class"]
    assert classes["norm"]["kernels"] == 16  # 4 layer norms and 4 RMSNorms, forward and backward
    assert not {"pow", "rsqrt", "mean"} & set(classes)
