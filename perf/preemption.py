"""Pre-emption: SIGTERM / SIGINT (what SLURM and torchrun send) ask for a checkpoint at the next step
boundary and a clean exit. A second signal of the same kind falls back to the default behaviour."""

import logging
import signal

import torch
import torch.distributed as dist

from perf.distributed import is_distributed

log = logging.getLogger("mmdit")


class PreemptionHandler:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self.previous = {sig: signal.signal(sig, self.handle) for sig in self.SIGNALS}

    def handle(self, signum: int, frame) -> None:
        self.received = signum
        signal.signal(signum, self.previous[signum])  # a second one is not caught
        log.warning("received %s: checkpointing at the next step boundary, then exiting",
                    signal.Signals(signum).name)

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
