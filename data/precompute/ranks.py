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
    units with the images encoded per second, in all and per rank, and waits there for the other ranks to finish.
    A line is drawn when what it shows changes, and the last one once, when the bar closes (a log file keeps
    every line drawn)."""

    def __init__(self, out: Path, ranks: Ranks, units: int, done: int):
        self.path = out / PROGRESS / f"rank-{ranks.rank:05d}.json"
        self.ranks, self.start, self.written = ranks, time.monotonic(), 0.0
        self.state = dict(NOT_STARTED, failed=[])
        self.bar, self.shown = None, None
        if ranks.rank == 0 and done < units:  # with every unit finished before, there is nothing to show
            from tqdm import tqdm
            self.bar = tqdm(total=units, initial=done, unit="unit", desc="precompute", file=sys.stdout)

    def __call__(self, images: int = 0, units: int = 0, failed: int = 0) -> None:
        self.state["images"] += images
        self.state["units"] += units
        self.state["failed_units"] += failed
        if time.monotonic() - self.written > 2 or units or failed:
            self.write()
            if self.bar is not None:
                self.show(self.states())

    def write(self) -> None:
        self.state["seconds"] = time.monotonic() - self.start
        self.written = time.monotonic()
        publish_json(self.path, self.state)

    def states(self) -> list[dict]:
        """Every rank's last written state."""
        states = []
        for rank in range(self.ranks.size):
            path = self.path.with_name(f"rank-{rank:05d}.json")
            try:
                states.append(json.loads(path.read_text()))
            except (OSError, ValueError):  # not started yet
                states.append(NOT_STARTED)
        return states

    def show(self, states: list[dict], draw: bool = True) -> None:
        """Set the bar to `states`, and draw it if what it shows changed, unless every unit is accounted for:
        that line is drawn once, by `finish`."""
        failed = sum(s["failed_units"] for s in states)
        shown = (self.bar.initial + sum(s["units"] for s in states),
                 rate_text(states, self.ranks.size) + (f", {failed} failed" if failed else ""))
        if shown == self.shown:
            return
        self.shown = shown
        self.bar.n = shown[0]
        self.bar.set_postfix_str(shown[1], refresh=draw and shown[0] + failed < self.bar.total)

    def finish(self, failed: list[str]) -> list[str]:
        """This rank is done; on rank 0, wait for the others. Returns the units that failed on any rank."""
        self.state.update(finished=True, failed=failed)
        self.write()
        if self.bar is None:
            return failed
        states = self.states()
        while not all(s["finished"] for s in states):
            self.show(states)
            time.sleep(1)
            states = self.states()
        self.show(states, draw=False)
        self.bar.close()  # draws the last line
        return [f for s in states for f in s["failed"]]


def rate_text(states: list[dict], ranks: int) -> str:
    """Images per second over all ranks (seconds per image below one a second: a large model on a CPU), and
    each rank's in the same unit under several ranks ("-": none encoded yet); empty before the first image."""
    rates = [s["images"] / s["seconds"] if s["images"] else None for s in states]
    total = sum(r for r in rates if r)
    if not total:
        return ""
    unit, value = ("img/s", lambda r: r) if total >= 1 else ("s/img", lambda r: 1 / r)
    return f"{value(total):.1f} {unit}" + (
        f" ({' '.join('-' if r is None else f'{value(r):.1f}' for r in rates)} per rank)" if ranks > 1 else "")
