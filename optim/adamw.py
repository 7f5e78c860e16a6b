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


def param_groups(model: nn.Module, weight_decay: float, lr_scales: dict[str, float] | None = None) -> list[dict]:
    """`lr_scales`: parameter-name prefix -> factor on the learning rate for the parameters under it (the text
    encoders' adapters: lora.text_encoder_lr / optimizer.lr). Each group carries its factor as "lr_scale", which the
    schedule multiplies in every step. The groups: (decayed, not decayed) of the other parameters, then those of
    each prefix that has any; the layout depends on the prefixes only, so a resume may change a factor."""
    params = dict(model.named_parameters())
    decay, no_decay = decay_groups(model)
    scales = dict(lr_scales or {})
    prefix_of = lambda name: next((prefix for prefix in scales if name.startswith(prefix)), None)
    groups = [{"params": [params[n] for n in names if prefix_of(n) == prefix], "weight_decay": wd,
               "lr_scale": scales.get(prefix, 1.0)}
              for prefix in [None, *scales] for names, wd in ((decay, weight_decay), (no_decay, 0.0))]
    log.info("parameter groups: %d tensors decayed, %d not%s", len(decay), len(no_decay),
             "".join(f"; {prefix}* at {scale:g} x lr" for prefix, scale in scales.items()))
    return groups[:2] + [g for g in groups[2:] if g["params"]]


def build_adamw(model: nn.Module, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                device: torch.device, fused: bool = True,
                lr_scales: dict[str, float] | None = None) -> torch.optim.AdamW:
    """torch's AdamW over `param_groups`, in one fused kernel where the device has one."""
    impl = "fused" if fused and device.type in ("cuda", "cpu") else "foreach"
    return torch.optim.AdamW(param_groups(model, weight_decay, lr_scales), lr=lr, betas=betas, eps=eps,
                             **{impl: True})
