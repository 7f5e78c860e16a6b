"""Non-finite guard: an optimizer step whose gradient norm is NaN/inf is skipped, on the device: the fused
AdamW kernel takes a `found_inf` flag and leaves weights and state untouched where it is set (as GradScaler
uses it), and the EMA follows only applied steps. The flags are read on log steps, where the skipped steps are
named; `max_in_row` skips in a row mean the run diverged, and it stops naming the last good checkpoint. So the
guard costs no host synchronisation per step (one per log line, which reads the loss anyway). An optimizer
without a fused kernel cannot skip on the device: then the guard reads the flag every step."""

import logging

import torch

log = logging.getLogger("mmdit")


class NonFiniteGuard:
    def __init__(self, max_in_row: int, check_every: int):
        self.max_in_row = max_in_row  # 0: off, non-finite steps are applied
        self.check_every = check_every
        self.unread: list[tuple[int, torch.Tensor]] = []  # (step, finite flag on the device) since the last read
        self.in_row = self.skipped = 0

    def step(self, optimizer: torch.optim.Optimizer, scaler, grad_norm: torch.Tensor, step: int) -> torch.Tensor | None:
        """`scaler.step(optimizer)` unless the gradient norm is non-finite. Returns a device flag (1: applied) for
        the EMA, or None when the guard is off."""
        if not self.max_in_row:
            scaler.step(optimizer)
            return None
        finite = torch.isfinite(grad_norm)
        self.unread.append((step, finite))
        if not optimizer.defaults.get("fused"):
            if bool(finite):  # the one host read per step this path costs
                scaler.step(optimizer)
            return finite.float()
        optimizer.found_inf = (~finite).float()  # an enabled GradScaler sets (and removes) its own, which covers this
        try:
            scaler.step(optimizer)
        finally:
            if hasattr(optimizer, "found_inf"):
                del optimizer.found_inf
        return finite.float()

    def read(self) -> None:
        """Count and name the skipped steps since the last read (one host read of all their flags)."""
        if not self.unread:
            return
        flags = torch.stack([finite for _, finite in self.unread]).tolist()
        for (step, _), finite in zip(self.unread, flags):
            self.in_row = 0 if finite else self.in_row + 1
            self.skipped += not finite
            if not finite:
                log.warning("step %d skipped: non-finite gradient norm (%d skipped in a row, %d in all)", step + 1,
                            self.in_row, self.skipped)
        self.unread = []

    def diverged(self, done: int, last_checkpoint) -> bool:
        """On check steps: True when the last `max_in_row` steps were all skipped (the run should stop)."""
        if not self.max_in_row or done % self.check_every:
            return False
        self.read()
        if self.in_row < self.max_in_row:
            return False
        log.error("stopping: %d non-finite steps in a row up to step %d; the last good checkpoint is %s", self.in_row,
                  done, last_checkpoint)
        return True

    def metrics(self) -> dict[str, int]:
        self.read()
        return {"skipped_steps": self.skipped}

    def state_dict(self) -> dict[str, int]:
        self.read()
        return {"skipped": self.skipped, "in_row": self.in_row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped, self.in_row = state["skipped"], state["in_row"]
