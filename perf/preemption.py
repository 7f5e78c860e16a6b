"""Pre-emption: SIGTERM / SIGINT (what SLURM, Kubernetes and torchrun send) ask for a checkpoint at the next
step boundary and a clean exit. SIGTERM may arrive more than once (a scheduler and torchrun both pass it on)
and is always answered this way; a second SIGINT (Ctrl-C twice) falls back to the default and interrupts."""

import logging
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from perf.distributed import is_distributed

log = logging.getLogger("mmdit")
PREEMPTED_DIR = "MMDIT_PREEMPTED_DIR"  # set by the launcher: where each pre-empted worker leaves a mark


class PreemptionHandler:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self.previous = {sig: signal.signal(sig, self.handle) for sig in self.SIGNALS}

    def handle(self, signum: int, frame) -> None:
        if self.received is None:
            log.warning("received %s: checkpointing at the next step boundary, then exiting",
                        signal.Signals(signum).name)
        self.received = signum
        if signum == signal.SIGINT:
            signal.signal(signum, self.previous[signum])  # a second Ctrl-C interrupts

    def should_stop(self, device: torch.device) -> bool:
        """True on every rank as soon as any rank was signalled (so all ranks stop at the same step)."""
        stop = self.received is not None
        if is_distributed():
            flag = torch.tensor([float(stop)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        return stop

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def mark_preempted(rank: int) -> None:
    """Tell the launcher this worker checkpointed and exits because it was asked to (see train_mmdit_stable.sh:
    torchrun itself reports a signal as a failure)."""
    if os.environ.get(PREEMPTED_DIR):
        (Path(os.environ[PREEMPTED_DIR]) / f"rank{rank}").write_text("0")
