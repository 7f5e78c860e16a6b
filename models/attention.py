"""The one attention call every MMDiT block makes: q, k, v as [batch, heads, tokens, head_dim], no mask."""

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)
