"""Non-finite guard: a step whose gradient norm is NaN/inf is skipped (by `optimizer_step`) and counted here;
`max_in_row` skips in a row mean the run diverged, and it stops naming the last good checkpoint."""

import logging

log = logging.getLogger("mmdit")


class NonFiniteGuard:
    def __init__(self, max_in_row: int):
        self.max_in_row = max_in_row  # 0: off, no check and no host sync per step
        self.in_row = self.skipped = 0

    @property
    def enabled(self) -> bool:
        return self.max_in_row > 0

    def diverged(self, applied: bool, step: int, loss, grad_norm, last_checkpoint) -> bool:
        """Record whether `step` (1-based) was applied; True when the run should stop."""
        if applied:
            self.in_row = 0
            return False
        self.in_row += 1
        self.skipped += 1
        log.warning("step %d skipped: loss %s, grad norm %s (%d skipped in a row, %d in all)",
                    step, loss.item(), grad_norm.item(), self.in_row, self.skipped)
        if self.in_row >= self.max_in_row:
            log.error("stopping: %d non-finite steps in a row up to step %d; the last good checkpoint is %s",
                      self.in_row, step, last_checkpoint)
            return True
        return False
