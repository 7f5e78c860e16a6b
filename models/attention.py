"""The one attention call every MMDiT block makes: q, k, v as [batch, heads, tokens, head_dim], no mask.

Which kernel runs is chosen from outside (`perf/attention.py`); the model only calls `attention`.
"""

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference: softmax(q k^T / sqrt(d)) v, computed in fp32."""
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


_kernel = sdpa_attention


def set_attention_kernel(kernel) -> None:
    global _kernel
    _kernel = kernel


@contextmanager
def attention_kernel(kernel):
    """Use `kernel` inside the block (e.g. the math formula while counting FLOPs), then the one before."""
    before = _kernel
    set_attention_kernel(kernel)
    try:
        yield
    finally:
        set_attention_kernel(before)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _kernel(q, k, v)
