"""Attention kernels, one config value each (`training.attention_backend`), set on the model from outside.

- sdpa: PyTorch's SDPA, which picks among its kernels itself (its pick of cuDNN on Hopper changed between
  releases, and a system cuDNN on LD_LIBRARY_PATH can change it: select one explicitly to know what runs);
- sdpa_flash / sdpa_cudnn / sdpa_efficient: one of SDPA's kernels, forced with `torch.nn.attention.sdpa_kernel`
  (FlashAttention-2 as built into PyTorch, and on the CPU PyTorch's flash-style CPU kernel; cuDNN's fused
  attention; the memory-efficient kernel, the only fused one for fp32);
- flash_attn_2 / flash_attn_3 / flash_attn_4: the flash-attn packages: `flash-attn` (FA2, sm80+), its Hopper
  build `flash_attn_interface` (FA3, sm90), and `flash-attn-4` (`flash_attn.cute`, the CuTe-DSL kernels for
  sm90/sm100);
- math: the fp32 formula (models/attention.py), the reference the others are tested against.

A family whose text is padded (Qwen-Image: its transformer takes `prompt_embeds_mask`) passes a key mask; flash-attn's
dense kernels take none, and `auto` checks the others with one.

`auto` takes, on each GPU generation, the first usable kernel of those listed fastest first in `FASTEST_FIRST`
(from published kernel benchmarks, docs/attention.md; `benchmarks/train_step.py` measures each backend the machine
has), and logs the choice with its reason. A kernel is usable when it passes, on the training device, in the compute
dtype and at the model's head dim:

- it runs: PyTorch's and flash-attn's own checks (compute capability, dtype, head dim, library versions) decide, and
  their message is the reason;
- it computes attention: forward and backward at each of the run's sequence lengths (image + text tokens of each
  latent size), compared with the math kernel (each token's output, dq, dk and dv within `TOLERANCE`).
  cuDNN before 9.15.1 has a wrong backward at sequence lengths not divisible by 128 (pytorch/pytorch#169849; SD3 at
  1024 px has 4429 tokens): PyTorch's own SDPA ranks cuDNN first only on sm90/sm100 with a newer cuDNN
  (`check_prefer_cudnn_attention` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp), and only there does the
  log say that torch itself prefers it; elsewhere cuDNN is taken only after this check at the run's lengths;
- under compile.scope=blocks, which compiles each block with `fullgraph=True`: dynamo traces it, forward and backward,
  without a graph break (a break stops such a run at its first step). flash-attn-4's `flash_attn_func` is an
  autograd.Function over CuTe-DSL kernels that dynamo does not trace, so there it is skipped. (Making it traceable
  would take a torch.library custom op with fake shapes around flash-attn-4's internal forward and backward
  functions, whose signatures change between its pre-1.0 releases, and a Hopper or Blackwell GPU to test it on:
  not done here.)

A backend chosen explicitly that is not usable is a ConfigError before training, with the reason.
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
# The most one token's output, dq, dk or dv may differ from the fp32 math kernel's on the same inputs, relative to
# the reference's RMS token norm (one wrong token, as from a mishandled last tile, counts in full). Correct bf16
# kernels rounding their probabilities and dS to bf16 reach 0.04 at 4429 tokens (simulated on a CPU); a wrong
# backward is off by the whole norm. fp32 kernels differ by their summation order only.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.1}
PROBE_LENGTH = 64  # the sequence length of the probe when the caller names none


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
    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # inside the kernel, not around the step: activation checkpointing re-runs the forward in the backward
        with sdpa_kernel(choice):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    kernel.__name__ = f"sdpa_{choice.name.lower()}"
    return kernel


def flash_attn_func(backend: str):
    module = FLASH_ATTN[backend][0]
    return getattr(importlib.import_module(module), "flash_attn_func")


def flash_kernel(flash_attn_func):
    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:
            raise ValueError("flash-attn's dense kernels take no attention mask (text padding)")
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


def probe_inputs(length: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v and an output gradient of one head (the kernels' bugs are in sequence lengths, not head counts; one
    head keeps the math kernel's L x L scores small), the same on every device."""
    g = torch.Generator().manual_seed(length)
    return [torch.randn(1, 1, length, head_dim, generator=g).to(device, dtype) for _ in range(4)]


def probe_mask(length: int, device: torch.device) -> torch.Tensor:
    """A key mask as a family with padded text gives one: its last eighth of the keys masked."""
    mask = torch.ones(1, 1, 1, length, dtype=torch.bool, device=device)
    mask[..., length - max(1, length // 8):] = False
    return mask


def masked_by(mask: torch.Tensor | None) -> dict:
    """A kernel's keyword arguments: the mask where there is one (a kernel's own `mask` defaults to none)."""
    return {} if mask is None else {"mask": mask}


def token_errors(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                 mask: torch.Tensor | None = None) -> dict[str, float]:
    """How far `kernel`'s output and dq, dk, dv are from the fp32 math kernel's on the same inputs (and key mask):
    the largest error of one token's vector, relative to the reference's RMS token norm."""
    results = []
    for fn, dtype in ((kernel, q.dtype), (math_attention, torch.float32)):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*inputs, **masked_by(mask))
        results.append([t.detach().float() for t in (out, *torch.autograd.grad(out, inputs, grad.to(out.dtype)))])
    return {name: float((ours - ref).norm(dim=-1).max() / ref.norm(dim=-1).square().mean().sqrt())
            for name, ours, ref in zip(("output", "dq", "dk", "dv"), *results)}


def traces(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> str | None:
    """None if dynamo captures `kernel`, forward and backward, in one graph (what fullgraph=True needs); else
    why not. The aot_eager backend traces the backward as inductor would, without generating code."""
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    try:
        compiled = torch.compile(lambda q, k, v: kernel(q, k, v, **masked_by(mask)), fullgraph=True,
                                 backend="aot_eager")
        compiled(*inputs).float().sum().backward()
        return None
    except Exception as e:  # dynamo's Unsupported and whatever a kernel raises under fake tensors
        message = str(e).strip().split("\n")[0][:300]
        return f"dynamo cannot trace it in one graph, which compile.scope=blocks needs ({type(e).__name__}: {message})"


def probe(kernel, device: torch.device, dtype: str, head_dim: int, lengths=(PROBE_LENGTH,),
          fullgraph: bool = False, header: str | None = None, masked: bool = False) -> str | None:
    """None if `kernel` runs forward and backward and agrees with the math kernel at each of `lengths` (with a key
    mask, if `masked`; and traces in one graph, if `fullgraph`); else why not (a forced SDPA kernel's reasons: SDPA's
    after `header`)."""
    torch_dtype = DTYPES.get(dtype, torch.float32)
    for length in lengths:
        q, k, v, grad = probe_inputs(length, head_dim, device, torch_dtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                errors = token_errors(kernel, q, k, v, grad, probe_mask(length, device) if masked else None)
            except Exception as e:  # any failure means it does not run here; its message says why
                reasons = refusal([str(w.message).strip() for w in caught], header)
                return (" ".join(reasons) or f"{type(e).__name__}: {e}").replace("\n", " ")[:400]
        wrong = {name: error for name, error in errors.items() if not error <= TOLERANCE[torch_dtype]}
        if wrong:
            return (f"at sequence length {length} its " + ", ".join(f"{n} is off by {e:.2g}" for n, e in wrong.items())
                    + f" of a token's norm from the math kernel's (tolerance {TOLERANCE[torch_dtype]:g})")
    if fullgraph:
        return traces(kernel, *probe_inputs(PROBE_LENGTH, head_dim, device, torch_dtype)[:3],
                      probe_mask(PROBE_LENGTH, device) if masked else None)
    return None


def why_not(backend: str, device: torch.device, dtype: str, head_dim: int, lengths=(PROBE_LENGTH,),
            fullgraph: bool = False, masked: bool = False) -> str | None:
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    reason = requirement(backend, device, dtype, head_dim, capability)
    if reason is None and masked and backend in FLASH_ATTN:
        return "its dense kernels take no attention mask, and this family masks its text's padding"
    if reason is None and backend not in ("sdpa", "math"):
        reason = probe(build_kernel(backend), device, dtype, head_dim, lengths, fullgraph, SDPA_REFUSALS.get(backend),
                       masked)
    return reason


def torch_prefers_cudnn() -> bool:
    """Whether PyTorch's own SDPA ranks cuDNN attention first, as it does on sm90/sm100 with a cuDNN newer than
    9.15.0 (unless TORCH_CUDNN_SDPA_DEPRIORITIZED=1). SDPA sets its order at its first call on a GPU: ask after one."""
    return torch._C._get_sdp_priority_order()[0] == int(SDPBackend.CUDNN_ATTENTION)


def candidates(device: torch.device) -> tuple[str, ...]:
    """auto's order on this device, fastest first; SDPA's own pick last."""
    if device.type != "cuda":
        return ("sdpa",)
    major = torch.cuda.get_device_capability(device)[0]
    return (*FASTEST_FIRST.get(min(major, 10), ()), "sdpa")  # before Ampere: SDPA's pick only


def choose(device: torch.device, dtype: str, head_dim: int, lengths=(PROBE_LENGTH,),
           fullgraph: bool = False, masked: bool = False) -> tuple[str, str]:
    """(backend, why) of `auto`: the first of `candidates` usable here."""
    skipped = []
    for backend in candidates(device):
        reason = why_not(backend, device, dtype, head_dim, lengths, fullgraph, masked)
        if reason is None:
            return backend, explain(backend, device, dtype, head_dim, lengths, fullgraph, skipped)
        skipped.append(f"{backend} ({reason})")
    raise AssertionError("sdpa always runs")


def explain(backend: str, device: torch.device, dtype: str, head_dim: int, lengths, fullgraph: bool,
            skipped: list[str]) -> str:
    where = f"sm{''.join(map(str, torch.cuda.get_device_capability(device)))}" if device.type == "cuda" \
        else device.type
    why = f"auto on {where}, {dtype}, head dim {head_dim}: the fastest listed for it that "
    why += ("runs" if backend in ("sdpa", "math") else
            f"agrees with the math kernel at sequence length {', '.join(map(str, lengths))}"
            + (" and compiles in one graph" if fullgraph else ""))
    if backend == "sdpa_cudnn":
        why += ("; PyTorch itself prefers cuDNN here" if torch_prefers_cudnn() else
                f"; PyTorch itself would not prefer cuDNN here (cuDNN {torch.backends.cudnn.version()}: it does on "
                f"sm90/sm100 from 9.15.1, which fixed a wrong backward at lengths not divisible by 128)")
    return why + (f"; not {'; not '.join(skipped)}" if skipped else "")


def apply_attention_backend(model: nn.Module, requested: str, device: torch.device, dtype: str, head_dim: int,
                            lengths=(PROBE_LENGTH,), fullgraph: bool = False) -> str:
    """Set the attention kernel of every attention in `model`; returns the backend's name. `lengths`: the run's
    sequence lengths (image + text tokens of each latent size), where each kernel is checked against the math
    kernel; `fullgraph`: the blocks will be compiled with fullgraph=True. A family whose text is padded (its
    transformer takes `prompt_embeds_mask`) needs a kernel that takes a key mask, and is checked with one."""
    lengths = sorted(set(lengths))
    masked = "prompt_embeds_mask" in getattr(getattr(model, "transformer", model), "TEXT_INPUTS", {})
    if requested == "auto":
        backend, why = choose(device, dtype, head_dim, lengths, fullgraph, masked)
    else:
        reason = why_not(requested, device, dtype, head_dim, lengths, fullgraph, masked)
        if reason:
            raise ConfigError(f"training.attention_backend={requested} cannot run here: {reason}; use auto (the "
                              f"fastest that runs) or another of {', '.join(BACKENDS)}")
        backend, why = requested, "as configured"
    use_attention(model, build_kernel(backend))
    log.info("attention: %s (%s)", backend, why)
    return backend


def joint_lengths(buckets, patch_size: int, text_tokens: int) -> list[int]:
    """The sequence lengths of a run's joint attention: the image tokens of each bucket (target size, reference
    sizes: data/latents.py), an edit's references' with the target's, plus the text tokens."""
    return sorted({sum((h // patch_size) * (w // patch_size) for h, w in (target, *references)) + text_tokens
                   for target, references in buckets})
