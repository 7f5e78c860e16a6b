"""The attention every MMDiT block computes: q, k, v as [batch, heads, tokens, head_dim], and a key mask [batch, 1,
1, tokens] (True: attend) where a family's text has padding (Qwen-Image), else None.

Which kernel computes it is a choice the model carries: each attention module holds its `attention_kernel`
(SDPA, PyTorch's own choice, by default), set for a whole model from outside by `use_attention`
(perf/attention.py picks one from the config). No process-wide state: two models in one process can use
different kernels, and what a model runs is visible on it (`attention_kernels(model)`).
"""

import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: softmax(q k^T / sqrt(d)) v, computed in fp32 (masked keys weigh nothing)."""
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "attention_kernel")]


def use_attention(model: nn.Module, kernel) -> nn.Module:
    """Every attention of `model` computed by `kernel(q, k, v, mask=None)`; returns the model."""
    for module in attention_modules(model):
        module.attention_kernel = kernel
    return model


def attention_kernels(model: nn.Module) -> set:
    """The kernels `model`'s attention modules run (one, unless set module by module)."""
    return {m.attention_kernel for m in attention_modules(model)}


@contextmanager
def attention_kernel(model: nn.Module, kernel):
    """`kernel` in `model` inside the block (e.g. the math formula while counting FLOPs), then the ones before."""
    before = {m: m.attention_kernel for m in attention_modules(model)}
    use_attention(model, kernel)
    try:
        yield model
    finally:
        for module, previous in before.items():
            module.attention_kernel = previous
