"""Attention backends: flash-attn (FlashAttention-3 on Hopper, FlashAttention-2 on Ampere and newer) -> PyTorch
SDPA -> math. `auto` picks the best one available for the device, its compute capability, the dtype and the
head dim; any fallback is reported once with its reason, before the first step (a kernel for another GPU
generation would otherwise crash in the first forward)."""

import importlib
import importlib.util
import logging

import torch

from models.attention import math_attention, sdpa_attention, set_attention_kernel

log = logging.getLogger("mmdit")
# flash-attn's modules and the compute capability each needs: FA3 runs on Hopper (sm90) only, FA2 on sm80+
FLASH_MODULES = {"flash_attn_interface": (9, 0), "flash_attn": (8, 0)}


def installed_flash_modules() -> list[str]:
    return [name for name in FLASH_MODULES if importlib.util.find_spec(name) is not None]


def select_flash(device: torch.device, dtype: str, head_dim: int, installed: list[str],
                 capability: tuple[int, int] | None) -> tuple[str | None, str | None]:
    """(flash-attn module to use, None) or (None, why not)."""
    if not installed:
        return None, "flash-attn is not installed (pip install flash-attn)"
    if device.type != "cuda":
        return None, f"flash-attn needs a CUDA device, not {device.type}"
    if dtype == "fp32":
        return None, "flash-attn needs fp16/bf16 compute (training.dtype=fp32)"
    if head_dim % 8 or head_dim > 256:
        return None, f"flash-attn supports head dims that are multiples of 8 up to 256, not {head_dim}"
    for name in installed:
        if capability >= FLASH_MODULES[name]:
            return name, None
    needs = " or ".join(f"{name} sm{major}{minor}+" for name, (major, minor) in FLASH_MODULES.items()
                        if name in installed)
    return None, f"this GPU is sm{capability[0]}{capability[1]}; the installed flash-attn needs {needs}"


def flash_kernel(module: str):
    flash_attn_func = importlib.import_module(module).flash_attn_func

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # flash-attn takes one half-precision dtype for all three; q and k can leave their RMS norms in fp32
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else v.dtype
        q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))  # it wants [B, L, H, D]
        out = flash_attn_func(q, k, v)
        out = out[0] if isinstance(out, tuple) else out  # FA3 also returns the softmax LSE
        return out.transpose(1, 2)

    return kernel


def apply_attention_backend(requested: str, device: torch.device, dtype: str, head_dim: int) -> str:
    backend, module, reason = requested, None, None
    if requested in ("auto", "flash"):
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        module, reason = select_flash(device, dtype, head_dim, installed_flash_modules(), capability)
        backend = "flash" if module else "sdpa"
    kernels = {"sdpa": lambda: sdpa_attention, "math": lambda: math_attention, "flash": lambda: flash_kernel(module)}
    set_attention_kernel(kernels[backend]())
    if reason and requested == "flash":
        log.warning("attention: flash requested but %s; using sdpa", reason)
    log.info("attention backend: %s%s", f"{backend} ({module})" if module else backend,
             f" (flash not used: {reason})" if reason else "")
    return backend
