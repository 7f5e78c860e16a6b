"""Exponential moving average of the trained weights, kept in fp32, used for sampling and validation.

The average lives next to the weights it follows: under FSDP each rank keeps its shard of it (the weights are
DTensors, and so are their averages)."""

from contextlib import contextmanager

import torch
import torch.nn as nn


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.shadow = {n: p.detach().float().clone() for n, p in trained}
        self.params = [p for _, p in trained]  # the same tensors all run long (loads copy into them)

    def effective_decay(self, num_updates: int) -> float:
        """Warm start: early on the average must not be dominated by the random init."""
        return min(self.decay, (1 + num_updates) / (10 + num_updates))

    @torch.no_grad()
    def update(self, num_updates: int, applied: torch.Tensor | None = None) -> None:
        """Move the average towards the weights; `applied` (a 0/1 device tensor) is 0 where the optimizer step
        was skipped, and then the average stays too, without reading the flag on the host."""
        weight = 1 - self.effective_decay(num_updates)
        shadow, params = list(self.shadow.values()), [p.detach().float() for p in self.params]
        if applied is None:
            torch._foreach_lerp_(shadow, params, weight)
        else:  # one weight tensor per parameter: the one-weight overload takes a number and would read it (a sync)
            torch._foreach_lerp_(shadow, params, [applied * weight] * len(params))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = self.shadow.keys() - state.keys()
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:5]}")
        for name, tensor in state.items():
            self.shadow[name].copy_(tensor)

    @contextmanager
    def applied(self):
        """The averaged weights in place of the trained ones (for sampling and validation), restored after:
        one extra copy of the trained weights, instead of a second model."""
        with torch.no_grad():
            trained = [p.detach().clone() for p in self.params]
            for param, average in zip(self.params, self.shadow.values()):
                param.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, weights in zip(self.params, trained):
                    param.copy_(weights)
