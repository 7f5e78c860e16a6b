"""The processes of a precompute launch and its progress bar."""

import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before the group exists: see Ranks.close

from data.latents import publish_json
from data.precompute.units import PROGRESS
from runtime.distributed import gather_objects

log = logging.getLogger("mmdit")
# Ranks meet twice: at the start, and when every unit is verified; verifying a large dataset's checksums can
# take a while on the slowest rank.
MEETING_TIMEOUT = timedelta(hours=6)
# a rank's progress file: images and units finished, units that failed (their errors once it has finished)
NOT_STARTED = {"images": 0, "units": 0, "failed_units": 0, "failed": [], "finished": False, "seconds": 0.0}


class Ranks:
    """The processes of a torchrun launch (or one), meeting over gloo: only to agree on the output directory
    and on which units are left. Otherwise they share nothing but the output directory."""

    def __init__(self):
        self.rank, self.size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if self.size > 1:
            dist.init_process_group("gloo", timeout=MEETING_TIMEOUT)

    def share(self, value) -> list:
        """Every rank's `value`, in rank order."""
        return gather_objects(value)

    def close(self) -> None:
        """Leave the group, which is then freed: diffusers imports torch.distributed.nn, whose functions, when
        first imported after the group exists, would hold it in their default arguments until the interpreter
        shuts down, where gloo aborts the process now and then (runtime/distributed.py:destroy_distributed)."""
        if dist.is_initialized():
            dist.destroy_process_group()


class Progress:
    """A rank's images and units, written to `out/.progress/` every few seconds; rank 0 shows a bar over all
    units with images/s in all and per rank, and waits there for the other ranks to finish."""

    def __init__(self, out: Path, ranks: Ranks, units: int, done: int):
        self.path = out / PROGRESS / f"rank-{ranks.rank:05d}.json"
        self.ranks, self.start, self.written = ranks, time.monotonic(), 0.0
        self.state = dict(NOT_STARTED, failed=[])
        self.bar = None
        if ranks.rank == 0:
            from tqdm import tqdm
            self.bar = tqdm(total=units, initial=done, unit="unit", desc="precompute", file=sys.stdout)

    def __call__(self, images: int = 0, units: int = 0, failed: int = 0) -> None:
        self.state["images"] += images
        self.state["units"] += units
        self.state["failed_units"] += failed
        if time.monotonic() - self.written > 2 or units or failed:
            self.write()

    def write(self) -> None:
        self.state["seconds"] = time.monotonic() - self.start
        self.written = time.monotonic()
        publish_json(self.path, self.state)
        if self.bar is not None:
            self.show()

    def show(self) -> list[dict]:
        states = []
        for rank in range(self.ranks.size):
            path = self.path.with_name(f"rank-{rank:05d}.json")
            try:
                states.append(json.loads(path.read_text()))
            except (OSError, ValueError):  # not started yet
                states.append(NOT_STARTED)
        rates = [s["images"] / s["seconds"] if s["seconds"] else 0.0 for s in states]
        self.bar.n = self.bar.initial + sum(s["units"] for s in states)
        failed = sum(s["failed_units"] for s in states)
        self.bar.set_postfix_str(f"{sum(rates):.1f} img/s" + (
            f" ({' '.join(f'{r:.1f}' for r in rates)} per rank)" if self.ranks.size > 1 else "") +
            (f", {failed} failed" if failed else ""), refresh=True)
        return states

    def finish(self, failed: list[str]) -> list[str]:
        """This rank is done; on rank 0, wait for the others. Returns the units that failed on any rank."""
        self.state.update(finished=True, failed=failed)
        self.write()
        if self.bar is None:
            return failed
        states = self.show()
        while not all(s["finished"] for s in states):
            time.sleep(1)
            states = self.show()
        self.bar.close()
        return [f for s in states for f in s["failed"]]
