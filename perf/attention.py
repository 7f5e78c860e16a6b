"""Attention backends: flash-attn (FlashAttention-3 on Hopper where installed, else FlashAttention-2) ->
PyTorch SDPA -> math. `auto` picks the best one available for the device, dtype and head dim; any fallback
is reported once with its reason."""

import importlib.util
import logging

import torch

from models.attention import math_attention, sdpa_attention, set_attention_kernel

log = logging.getLogger("mmdit")


def flash_module() -> str | None:
    """'flash_attn_interface' (FA3) or 'flash_attn' (FA2) if importable, else None."""
    for name in ("flash_attn_interface", "flash_attn"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def flash_unsupported_reason(device: torch.device, dtype: str, head_dim: int, module: str | None) -> str | None:
    if module is None:
        return "flash-attn is not installed (pip install flash-attn)"
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, not {device.type}"
    if dtype == "fp32":
        return "flash-attn needs fp16/bf16 compute (training.dtype=fp32)"
    if head_dim % 8 or head_dim > 256:
        return f"flash-attn supports head dims that are multiples of 8 up to 256, not {head_dim}"
    return None


def select_attention_backend(requested: str, device: torch.device, dtype: str, head_dim: int,
                             module: str | None) -> tuple[str, str | None]:
    """(backend, reason for not using the requested / best one)."""
    if requested in ("auto", "flash"):
        reason = flash_unsupported_reason(device, dtype, head_dim, module)
        if reason is None:
            return "flash", None
        return "sdpa", reason
    return requested, None


def flash_kernel(module: str):
    flash_attn_func = importlib.import_module(module).flash_attn_func

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # it wants [B, L, H, D]
        out = out[0] if isinstance(out, tuple) else out  # FA3 also returns the softmax LSE
        return out.transpose(1, 2)

    return kernel


def apply_attention_backend(requested: str, device: torch.device, dtype: str, head_dim: int) -> str:
    module = flash_module()
    backend, reason = select_attention_backend(requested, device, dtype, head_dim, module)
    kernels = {"sdpa": lambda: sdpa_attention, "math": lambda: math_attention, "flash": lambda: flash_kernel(module)}
    set_attention_kernel(kernels[backend]())
    if reason and requested == "flash":
        log.warning("attention: %s requested but %s; using sdpa", requested, reason)
    log.info("attention backend: %s%s", f"{backend} ({module})" if backend == "flash" else backend,
             f" (flash not used: {reason})" if reason else "")
    return backend
