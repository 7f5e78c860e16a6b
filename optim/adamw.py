"""AdamW with decay groups: weight decay on matmul/conv weights only."""

import logging

import torch
import torch.nn as nn

log = logging.getLogger("mmdit")

def decay_groups(model: nn.Module) -> tuple[list[str], list[str]]:
    """(decayed, not decayed) parameter names: biases, norm weights, embeddings and position tables
    (any parameter that is not a Linear/Conv weight) get no decay."""
    decay, no_decay = [], []
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            full = f"{module_name}.{name}" if module_name else name
            is_matmul_weight = (name == "weight" and isinstance(module, (nn.Linear, nn.Conv2d))
                                or name == "in_proj_weight" and isinstance(module, nn.MultiheadAttention))
            (decay if is_matmul_weight else no_decay).append(full)
    return decay, no_decay


def build_adamw(model: nn.Module, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                device: torch.device, fused: bool = True) -> torch.optim.AdamW:
    params = dict(model.named_parameters())
    decay, no_decay = decay_groups(model)
    groups = [{"params": [params[n] for n in decay], "weight_decay": weight_decay},
              {"params": [params[n] for n in no_decay], "weight_decay": 0.0}]
    impl = "fused" if fused and device.type in ("cuda", "cpu") else "foreach"
    log.info("AdamW (%s): %d tensors decayed, %d not", impl, len(decay), len(no_decay))
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **{impl: True})
