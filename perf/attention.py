"""Attention kernels, one config value each (`training.attention_backend`), set on the model from outside.

- sdpa: PyTorch's SDPA, which picks among its kernels itself (its pick of cuDNN on Hopper changed between
  releases, and a system cuDNN on LD_LIBRARY_PATH can change it: select one explicitly to know what runs);
- sdpa_flash / sdpa_cudnn / sdpa_efficient: one of SDPA's kernels, forced with `torch.nn.attention.sdpa_kernel`
  (FlashAttention-2 as built into PyTorch, and on the CPU PyTorch's flash-style CPU kernel; cuDNN's fused
  attention; the memory-efficient kernel, the only fused one for fp32);
- flash_attn_2 / flash_attn_3 / flash_attn_4: the flash-attn packages: `flash-attn` (FA2, sm80+), its Hopper
  build `flash_attn_interface` (FA3, sm90), and `flash-attn-4` (`flash_attn.cute`, the CuTe-DSL kernels for
  sm90/sm100; an autograd.Function that dynamo does not trace, so under torch.compile it is a graph break);
- math: the fp32 formula (models/attention.py), the reference the others are tested against.

`auto` takes, on each GPU generation, the first that runs of the kernels listed fastest first in
`FASTEST_FIRST` (from published kernel benchmarks, docs/attention.md; `benchmarks/train_step.py` measures each
backend the machine has), and logs the choice with its reason. Whether a kernel runs is asked of the kernel
itself: a forward and backward on tiny tensors of the model's head dim and compute dtype on the device, so
PyTorch's and flash-attn's own checks (compute capability, dtype, head dim, library versions) decide, and
their message is the reason. A backend chosen explicitly that cannot run is a ConfigError before training.
"""

import functools
import importlib
import logging
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from errors import ConfigError
from models.attention import math_attention, sdpa_attention, use_attention
from perf.precision import DTYPES

log = logging.getLogger("mmdit")

SDPA_KERNELS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
# backend: (module, the compute capabilities its kernels are built for, head dims it takes: (low, high, step))
FLASH_ATTN = {"flash_attn_2": ("flash_attn", ((8, 0), (12, 9)), (8, 256, 8)),
              "flash_attn_3": ("flash_attn_interface", ((9, 0), (9, 9)), (64, 256, 32)),
              "flash_attn_4": ("flash_attn.cute", ((8, 0), (12, 9)), (8, 256, 8))}
BACKENDS = ("auto", "sdpa", *SDPA_KERNELS, *FLASH_ATTN, "math")
# auto, by compute capability major: fastest first. Hopper (FlashAttention-3 paper, forward, seq ~4k, head dim 64:
# FA3 476, cuDNN 408, FA2 321 TFLOP/s); Blackwell: flash-attn-4 is written for it, FA3 does not run there;
# Ampere/Ada: FA2. Then SDPA's own pick, which runs everywhere (and is the only choice on a CPU).
FASTEST_FIRST = {9: ("flash_attn_3", "sdpa_cudnn", "flash_attn_4", "flash_attn_2", "sdpa_flash"),
                 10: ("flash_attn_4", "sdpa_cudnn", "sdpa_flash", "flash_attn_2"),
                 8: ("flash_attn_2", "sdpa_flash", "sdpa_cudnn")}


@functools.cache
def build_kernel(backend: str):
    """The `kernel(q, k, v)` of a backend (one object per backend, so compiled graphs guard on one)."""
    if backend == "sdpa":
        return sdpa_attention
    if backend == "math":
        return math_attention
    if backend in SDPA_KERNELS:
        return forced_sdpa(SDPA_KERNELS[backend])
    return flash_kernel(flash_attn_func(backend))


def forced_sdpa(choice: SDPBackend):
    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # inside the kernel, not around the step: activation checkpointing re-runs the forward in the backward
        with sdpa_kernel(choice):
            return F.scaled_dot_product_attention(q, k, v)
    kernel.__name__ = f"sdpa_{choice.name.lower()}"
    return kernel


def flash_attn_func(backend: str):
    module = FLASH_ATTN[backend][0]
    return getattr(importlib.import_module(module), "flash_attn_func")


def flash_kernel(flash_attn_func):
    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # flash-attn takes one half-precision dtype for all three; q and k can leave their RMS norms in fp32
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else v.dtype
        q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))  # it wants [B, L, H, D]
        out = flash_attn_func(q, k, v)
        out = out[0] if isinstance(out, tuple) else out  # FA3 (some versions) and FA4 also return the LSE
        return out.transpose(1, 2)
    return kernel


def installed(backend: str) -> bool:
    try:
        flash_attn_func(backend)
        return True
    except (ImportError, AttributeError):  # flash-attn-4 alone leaves `flash_attn` a namespace without the FA2 API
        return False


def requirement(backend: str, device: torch.device, dtype: str, head_dim: int,
                capability: tuple[int, int] | None) -> str | None:
    """Why `backend` cannot run, from what is known without running it (None: ask the kernel)."""
    if backend in ("sdpa", "math", "sdpa_flash"):  # SDPA's flash kernel has a CPU version too
        return None
    if device.type != "cuda":
        return f"it needs a CUDA GPU, not {device.type}"
    if backend in SDPA_KERNELS:
        return None
    module, (low, high), (smallest, largest, step) = FLASH_ATTN[backend]
    if dtype == "fp32":
        return f"{module} computes in fp16/bf16 only (training.dtype=fp32)"
    if not low <= capability <= high:
        return (f"{module} runs on sm{low[0]}{low[1]} to sm{high[0]}{high[1]}, this GPU is "
                f"sm{capability[0]}{capability[1]}")
    if not (smallest <= head_dim <= largest and head_dim % step == 0):
        return f"{module} takes head dims {smallest}..{largest} in steps of {step}, not {head_dim}"
    if not installed(backend):
        return f"{module} is not installed"
    return None


# When a forced SDPA kernel cannot run, SDPA warns why for each of its kernels, each list after a header
SDPA_REFUSALS = {"sdpa_flash": "Flash attention kernel not used because:",
                 "sdpa_cudnn": "cuDNN attention kernel not used because:",
                 "sdpa_efficient": "Memory efficient kernel not used because:"}


def refusal(messages: list[str], header: str | None) -> list[str]:
    """The reasons listed after `header` up to the next header (all messages without a header)."""
    if header not in messages:
        return messages
    after = messages[messages.index(header) + 1:]
    ends = [i for i, m in enumerate(after) if m in SDPA_REFUSALS.values()]
    return after[:ends[0]] if ends else after


def probe(kernel, device: torch.device, dtype: str, head_dim: int, header: str | None = None) -> str | None:
    """Run `kernel` forward and backward on tiny inputs; None, or why it cannot (SDPA's reasons after `header`)."""
    q, k, v = (torch.randn(1, 2, 64, head_dim, device=device, dtype=DTYPES.get(dtype, torch.float32),
                           requires_grad=True)
               for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            kernel(q, k, v).float().sum().backward()
            return None
        except Exception as e:  # any failure means it does not run here; its message says why
            reasons = refusal([str(w.message).strip() for w in caught], header)
            return (" ".join(reasons) or f"{type(e).__name__}: {e}").replace("\n", " ")[:400]


def why_not(backend: str, device: torch.device, dtype: str, head_dim: int) -> str | None:
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    reason = requirement(backend, device, dtype, head_dim, capability)
    if reason is None and backend not in ("sdpa", "math"):
        reason = probe(build_kernel(backend), device, dtype, head_dim, SDPA_REFUSALS.get(backend))
    return reason


def candidates(device: torch.device) -> tuple[str, ...]:
    """auto's order on this device, fastest first; SDPA's own pick last."""
    if device.type != "cuda":
        return ("sdpa",)
    major = torch.cuda.get_device_capability(device)[0]
    return (*FASTEST_FIRST.get(min(major, 10), ()), "sdpa")  # before Ampere: SDPA's pick only


def choose(device: torch.device, dtype: str, head_dim: int) -> tuple[str, str]:
    """(backend, why) of `auto`: the first of `candidates` that runs here."""
    skipped = []
    for backend in candidates(device):
        reason = why_not(backend, device, dtype, head_dim)
        if reason is None:
            where = (f"sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
                     if device.type == "cuda" else device.type)
            why = f"auto on {where}, {dtype}, head dim {head_dim}: the fastest listed for it that runs"
            return backend, why + (f"; not {'; not '.join(skipped)}" if skipped else "")
        skipped.append(f"{backend} ({reason})")
    raise AssertionError("sdpa always runs")


def apply_attention_backend(model: nn.Module, requested: str, device: torch.device, dtype: str,
                            head_dim: int) -> str:
    """Set the attention kernel of every attention in `model`; returns the backend's name."""
    if requested == "auto":
        backend, why = choose(device, dtype, head_dim)
    else:
        reason = why_not(requested, device, dtype, head_dim)
        if reason:
            raise ConfigError(f"training.attention_backend={requested} cannot run here: {reason}; use auto (the "
                              f"fastest that runs) or another of {', '.join(BACKENDS)}")
        backend, why = requested, "as configured"
    use_attention(model, build_kernel(backend))
    log.info("attention: %s (%s)", backend, why)
    return backend
