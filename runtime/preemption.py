"""Pre-emption: SIGTERM / SIGINT (what SLURM, Kubernetes and torchrun send) ask for a checkpoint at a step
boundary and an exit with 128 + the signal, as a shell reports a command the signal ended (130, 143): the run is
not finished, and a wrapper that reruns until success resumes it. SIGTERM may arrive more than once (a scheduler
and torchrun both pass it on) and is always answered this way; a second SIGINT (Ctrl-C twice) falls back to the
default and interrupts.

Several ranks must stop at the same step. Each step starts an all-reduce of "which signal came?" (the largest
number, 0 for none) on a gloo group of host tensors and reads the result the previous step started: no step
waits on the device or on the network, and every rank learns of a signal one step after it arrived, at the same
step, and with it the same exit status (also a rank, or a node, that was not signalled itself).
"""

import logging
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.distributed import host_group, is_distributed

log = logging.getLogger("mmdit")
STATUS_DIR = "MMDIT_STATUS_DIR"  # set by the launcher: where each worker leaves why it exits (see mark_exit)


class PreemptionHandler:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, timeout_s: int = 1800):
        self.received: int | None = None
        self.agreed: int | None = None  # the signal every rank stops for
        self.group = host_group(timeout_s) if is_distributed() else None
        self.flag = torch.zeros(1)
        self.agreement = None  # the all-reduce in flight
        self.previous = {sig: signal.signal(sig, self.handle) for sig in self.SIGNALS}

    def handle(self, signum: int, frame) -> None:
        if self.received is None:
            log.warning("received %s: checkpointing at the next step boundary, then exiting",
                        signal.Signals(signum).name)
        self.received = signum
        if signum == signal.SIGINT:
            signal.signal(signum, self.previous[signum])  # a second Ctrl-C interrupts

    def should_stop(self) -> bool:
        """Once per step on every rank: True on all of them at the same step once any rank was signalled."""
        if self.group is None:
            self.agreed = self.received
            return self.agreed is not None
        if self.agreement is not None:
            self.agreement.wait()
            self.agreed = int(self.flag.tolist()[0]) or None  # a host tensor: no device involved
        self.agreement = None
        if self.agreed is None:
            self.flag = torch.tensor([float(self.received or 0)])
            self.agreement = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return self.agreed is not None

    @property
    def exit_status(self) -> int:
        """What a shell reports for a command the agreed signal ended: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.agreed

    def close(self) -> None:
        if self.agreement is not None:  # every rank has the same one in flight
            self.agreement.wait()
            self.agreement = None
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def mark_exit(rank: int, reason: str, status: int) -> int:
    """The exit status of a worker that stops for `reason`: "preempted" (128 + the signal), "input-error" (2:
    rank 0 said what is wrong), "failed" (1: rank 0 said why) or "interrupted" (130). Under the launcher
    (launch.sh) "REASON STATUS" goes to its status folder and the worker exits 0: torchrun reports a signal as a
    failure, prints a long traceback for any non-zero exit and restarts such workers (MAX_RESTARTS), so the
    launcher sets the status."""
    if not os.environ.get(STATUS_DIR):
        return status
    (Path(os.environ[STATUS_DIR]) / f"rank{rank}").write_text(f"{reason} {status}")
    return 0
