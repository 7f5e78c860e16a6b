"""The optimizers `optimizer.name` picks, and what the trainer must know of each: the package it needs, whether it
trains under FSDP, which of its parameter-group values it learns (a resume takes those from the checkpoint, the
others from today's config) and the bytes of state it keeps per trained parameter (runtime/memory_plan.py).

- adamw: torch's AdamW (optim/adamw.py), fused; 8 bytes of state per parameter (two fp32 moments).
- adamw8bit: torchao's AdamW8bit: both moments in 8 bits with an fp32 scale per block of 256 values (tensors of at
  least 4096 values that 256 divides; smaller ones keep fp32 moments), about 2 bytes per parameter. torchao's
  rather than bitsandbytes': it is pure PyTorch (it runs, and is tested, on the CPU too), its state is a tensor
  subclass that FSDP2 can hold as a DTensor, and torchao is already the float8 plugin's dependency; bitsandbytes'
  8-bit kernels are CUDA's, and its state is not a DTensor. Each parameter's update is one torch.compile'd
  function; on a CPU it runs eagerly instead (inductor's C++ code generation took ~110 s for four parameter
  shapes before the first step on a 2-core machine), the same update.
- prodigy: prodigyopt's Prodigy: Adam whose step size d it estimates itself; optimizer.lr scales that estimate and
  is 1.0 by convention. 16 bytes per parameter (two moments, its running sum s and the initial weights p0). It reads
  two numbers to the host per parameter per step (its d estimate sums over all parameters).
- adafactor: torch.optim.Adafactor: the second moment of a matrix factored into a row and a column mean, no first
  moment: a few bytes per row and column of a weight instead of 8 per value. Its step size is relative to each
  weight's RMS, capped by optimizer.lr (torch's reading of the paper's 0.01).

Under FSDP/HSDP only adamw trains: the others' state or step assumes whole tensors (`Kind.sharded` says why).
"""

import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from errors import ConfigError
from optim.adamw import build_adamw, param_groups

log = logging.getLogger("mmdit")


@dataclass(frozen=True)
class Kind:
    package: str | None  # the module it imports; None: torch's own
    pip: str | None  # what installs it
    sharded: str | None  # None: it trains under FSDP/HSDP; else why not
    state_bytes: Callable[[tuple[int, ...]], int]  # bytes of state for a trained fp32 parameter of this shape
    learned: tuple[str, ...] = ()  # parameter-group values the optimizer updates itself


def adamw8bit_bytes(shape: tuple[int, ...]) -> int:
    """torchao quantizes a moment of >= 4096 values that 256 divides: a byte per value, an fp32 scale per 256
    values and its 256-entry fp32 code table; other moments stay fp32."""
    n = math.prod(shape)
    return 2 * (n + 4 * n // 256 + 4 * 256) if n >= 4096 and n % 256 == 0 else 8 * n


def adafactor_bytes(shape: tuple[int, ...]) -> int:
    """A row and a column mean of a matrix's (stack's) squared gradient; a full second moment of a vector."""
    n = math.prod(shape)
    return 4 * (n // shape[-1] + n // shape[-2]) if len(shape) > 1 else 4 * n


KINDS = {
    "adamw": Kind(None, None, None, lambda shape: 8 * math.prod(shape)),
    "adamw8bit": Kind("torchao", "pip install torchao", "torchao quantizes the moments in blocks of 256 values of "
                      "each rank's shard, which DCP cannot store as one tensor to resume on any world size",
                      adamw8bit_bytes),
    "prodigy": Kind("prodigyopt", "pip install prodigyopt", "prodigyopt flattens each parameter for its step-size "
                    "estimate, which FSDP2's DTensor shards refuse (a view across the sharded dimension); its own "
                    "FSDP support is FSDP1's flattened parameters, with a CUDA all-reduce",
                    lambda shape: 16 * math.prod(shape),
                    learned=("d", "d_max", "d_numerator", "d_denom", "d_hat", "k")),
    "adafactor": Kind(None, None, "torch's Adafactor fails on FSDP2's DTensor shards: the column mean of a weight "
                      "sharded by rows is a partial value across ranks, which its in-place update cannot take",
                      adafactor_bytes),
}
PRODIGY_LR = (0.1, 10.0)  # lr scales prodigy's own step-size estimate: 1.0 by convention, outside this a mistake


def check_installed(optim) -> None:
    """Training with optimizer.name needs its package (exporting and sampling its runs do not)."""
    kind = KINDS[optim.name]
    if kind.package and importlib.util.find_spec(kind.package) is None:
        raise ConfigError(f"optimizer.name={optim.name} needs the {kind.package} package: {kind.pip}")


def check_optimizer(optim, strategy: str, lr_scaled: bool) -> None:
    """optimizer.* for a run under parallel.strategy `strategy` (the config's rules): prodigy's lr is near 1 and
    its learning rate one, and a sharded run uses an optimizer that supports FSDP. `lr_scaled`: some parameters
    train at another learning rate (lora.text_encoder_lr)."""
    kind = KINDS[optim.name]
    if optim.name == "prodigy" and not PRODIGY_LR[0] <= optim.lr <= PRODIGY_LR[1]:
        raise ConfigError(f"optimizer.lr={optim.lr} with optimizer.name=prodigy: prodigy estimates the step size "
                          f"itself and lr multiplies its estimate; set optimizer.lr=1.0 (prodigyopt's convention; "
                          f"{PRODIGY_LR[0]} to {PRODIGY_LR[1]} is accepted)")
    if optim.name == "prodigy" and lr_scaled:
        raise ConfigError("lora.text_encoder_lr with optimizer.name=prodigy: prodigy takes one learning rate for "
                          "all parameter groups (one d estimate); leave lora.text_encoder_lr unset")
    if strategy != "ddp" and kind.sharded:
        raise ConfigError(f"optimizer.name={optim.name} with parallel.strategy={strategy}: {kind.sharded}; use "
                          f"optimizer.name=adamw under FSDP, or parallel.strategy=ddp")


def build_optimizer(model: nn.Module, optim, device: torch.device, lr_scales: dict[str, float],
                    warmup: bool) -> torch.optim.Optimizer:
    """optimizer.name's optimizer over the decay groups of optim/adamw.py; `warmup`: the schedule warms up."""
    betas = (optim.beta1, optim.beta2)
    if optim.name == "adamw":
        return build_adamw(model, optim.lr, betas, optim.eps, optim.weight_decay, device, optim.fused, lr_scales)
    groups = param_groups(model, optim.weight_decay, lr_scales)
    log.info("optimizer: %s", optim.name)
    if optim.name == "adamw8bit":
        from torchao.optim import AdamW8bit
        optimizer = AdamW8bit(groups, lr=optim.lr, betas=betas, eps=optim.eps)
        if device.type != "cuda":  # see the module's docstring
            optimizer.step = eager(optimizer.step)
        return optimizer
    if optim.name == "prodigy":
        from prodigyopt import Prodigy
        # safeguard_warmup: prodigyopt's advice when the schedule warms up (the low early lr would inflate d)
        return Prodigy(groups, lr=optim.lr, betas=betas, eps=optim.eps, safeguard_warmup=warmup)
    return torch.optim.Adafactor(groups, lr=optim.lr)  # its eps are an RMS floor and a clip, not Adam's


def eager(step):
    """An optimizer's step with torch.compile's functions run as plain Python (the same update, no compile)."""
    def run(*args, **kwargs):
        with torch.compiler.set_stance("force_eager"):
            return step(*args, **kwargs)
    return run


def learned_group_keys(name: str) -> tuple[str, ...]:
    return KINDS[name].learned


def state_bytes(name: str, shapes: list[tuple[int, ...]]) -> int:
    """Bytes of optimizer state for trained fp32 parameters of these shapes."""
    return sum(KINDS[name].state_bytes(tuple(shape)) for shape in shapes)
