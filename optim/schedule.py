"""Learning rate as a pure function of the step: nothing to checkpoint, resume is exact by construction.

`optimizer.schedule` picks the shape, as diffusers' `get_scheduler` names them: cosine (linear warmup, then a
cosine to lr * min_lr_ratio at max_steps), linear (linear warmup, then a straight line to lr * min_lr_ratio),
constant_with_warmup (linear warmup, then the peak), constant (the peak from the first step: no warmup)."""

import math

import torch

SCHEDULES = ("cosine", "constant", "constant_with_warmup", "linear")


def learning_rate(schedule: str, step: int, peak_lr: float, warmup_steps: int, max_steps: int,
                  min_lr_ratio: float) -> float:
    """The learning rate of step `step` (0-based)."""
    if schedule == "constant":
        return peak_lr
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if schedule == "constant_with_warmup":
        return peak_lr
    progress = min((step - warmup_steps) / max(1, max_steps - warmup_steps), 1.0)
    decay = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return peak_lr * (min_lr_ratio + (1 - min_lr_ratio) * decay)


def warmup_cosine(step: int, peak_lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    return learning_rate("cosine", step, peak_lr, warmup_steps, max_steps, min_lr_ratio)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Each group's learning rate: `lr` times the group's "lr_scale". A group whose rate is a tensor (torchao's
    optimizers read it on the device, and refuse a number) is filled in place."""
    for group in optimizer.param_groups:
        value = lr * group["lr_scale"]
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(value)
        else:
            group["lr"] = value
