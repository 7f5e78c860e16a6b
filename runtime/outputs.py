"""The run's own outputs beside its checkpoints: metrics.jsonl, TensorBoard, sample grids, validation.json,
loss_curve.png, profiler traces. A full disk (or a quota, a read-only or failing filesystem) must not end a run
whose results are its checkpoints: writing these is best-effort, and a failure is said once, with the path.

Checkpoints have their own handling (perf/checkpoint.py): a failed save is logged and retried at the next one.
"""

import logging
from contextlib import suppress
from pathlib import Path

log = logging.getLogger("mmdit")


class Output:
    """One kind of output. `write(path, func, *args)` calls `func(*args)`, which writes `path`: an OSError is a
    warning naming the path and the reason when this output starts failing (`then` says what follows), and an
    info line when it is written again; the run goes on either way. Any other error is a bug and raises.
    `partial`: files that a failed write may have left cut, removed (a picture that does not open is worse than
    none)."""

    def __init__(self, name: str, then: str = "the run goes on"):
        self.name, self.then, self.failing = name, then, False

    def write(self, path: Path, func, *args, partial: tuple[Path, ...] = ()) -> bool:
        try:
            func(*args)
        except OSError as e:
            for file in partial:
                with suppress(OSError):  # the disk's failure is the one reported
                    file.unlink(missing_ok=True)
            if not self.failing:
                log.warning("%s: could not write %s (%s: %s); %s", self.name, path, type(e).__name__, e, self.then)
                self.failing = True
            return False
        if self.failing:
            log.info("%s: written again (%s)", self.name, path)
            self.failing = False
        return True

