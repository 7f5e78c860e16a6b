"""Where a run's numbers and pictures go: metrics.jsonl, TensorBoard and (optionally) Weights & Biases.

Only rank 0 writes; on other ranks every method is a no-op. No sink stops training (runtime/outputs.py):
- metrics.jsonl, the primary record, is written a whole line at a time; a row that cannot be written (a full
  disk) is dropped, with no cut line left to merge with the next, and each later row is tried again.
- TensorBoard and wandb: a missing package, a failing service or a failed write is one warning, and that sink is
  off for the rest of the run (an event file cut mid-record cannot be continued).
"""

import json
import logging
import os
import threading
import time
import uuid
from contextlib import suppress
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from PIL import Image, ImageDraw

from data.latents import publish_text
from perf.compile import compile_metrics
from runtime.distributed import mean_over_ranks
from runtime.outputs import Output

log = logging.getLogger("mmdit")


class RunLogger:
    """The sinks. A run that resumes at `start_step` redoes the steps after it: their rows are dropped from
    metrics.jsonl and TensorBoard (wandb keeps its own history)."""

    def __init__(self, run_dir: Path, cfg: DictConfig, enabled: bool, start_step: int = 0):
        path = run_dir / "metrics.jsonl"
        self.metrics_output = Output("metrics.jsonl", "its rows are dropped until one can be written; the run goes on")
        if enabled:
            Output("metrics.jsonl", f"the rows of steps after {start_step} stay beside the redone ones; the run "
                   f"goes on").write(path, drop_rows_after, path, start_step)
        self.jsonl = JsonLines(path) if enabled else None
        on = enabled and cfg.logging.tensorboard
        self.tensorboard = start_tensorboard(run_dir / "tensorboard", start_step) if on else None
        self.tensorboard_output = Output("TensorBoard", "TensorBoard is off for the rest of the run (an event file "
                                                        "cut mid-record cannot be continued); the run goes on")
        self.wandb = start_wandb(run_dir, cfg) if enabled and cfg.logging.wandb.enabled else None

    def scalars(self, step: int, record: dict[str, float]) -> None:
        if self.jsonl is None:
            return
        self.metrics_output.write(self.jsonl.path, self.jsonl.append, {"step": step, **record, "time": time.time()})

        def add_scalars(writer) -> None:
            for key, value in record.items():
                writer.add_scalar(key, value, step)
            writer.flush()
        self.to_tensorboard(add_scalars)
        self.to_wandb(record, step)

    def image(self, step: int, tag: str, path: Path, captions: list[str]) -> None:
        """A sample grid (a PNG on disk) with its captions."""
        if self.jsonl is None:
            return

        def add_image(writer) -> None:
            writer.add_image(tag, np.asarray(Image.open(path).convert("RGB")), step, dataformats="HWC")
            writer.add_text(f"{tag}/captions", "  \n".join(captions), step)
            writer.flush()
        self.to_tensorboard(add_image)
        if self.wandb:
            self.to_wandb({tag: self.wandb.Image(str(path), caption=" | ".join(captions))}, step)

    def to_tensorboard(self, write) -> None:
        """`write(writer)`; a failure turns TensorBoard off."""
        if self.tensorboard and not self.tensorboard_output.write(self.tensorboard.log_dir, write, self.tensorboard):
            self.tensorboard = None

    def to_wandb(self, record: dict, step: int) -> None:
        if not self.wandb:
            return
        try:
            self.wandb.log(record, step=step)
        except Exception as e:  # a failing service must not stop training
            log.warning("wandb logging failed (%s: %s); wandb is off for the rest of the run", type(e).__name__, e)
            self.wandb = None

    def close(self) -> None:
        if self.jsonl:  # a network filesystem may report a failed write only now
            Output("metrics.jsonl").write(self.jsonl.path, self.jsonl.close)
            self.jsonl = None
        self.to_tensorboard(lambda writer: writer.close())
        if self.wandb:
            try:
                self.wandb.finish()
            except Exception as e:
                log.warning("wandb finish failed: %s", e)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TrainingLog:
    """The metrics row and progress line of every `log_every`-th step and of the last: loss, learning rate,
    gradient norm, throughput (and MFU when the device's peak is known), and what each source reports through
    `.metrics()` (time per phase, memory, loss by noise level, skipped steps, micro-batch, checkpoint stall), and
    in a compiled run the graphs that run eagerly because the compiler failed on them (perf/compile.py).
    Reading the loss is the row's host synchronisation; steps in between read nothing."""

    def __init__(self, logger: RunLogger, log_every: int, start_step: int, max_steps: int, throughput, sources: list):
        self.logger, self.log_every, self.start_step, self.max_steps = logger, log_every, start_step, max_steps
        self.throughput, self.sources = throughput, sources
        self.started = self.last_time = time.perf_counter()
        self.last_step = start_step

    def step(self, done: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        if done % self.log_every and done != self.max_steps:
            return
        now = time.perf_counter()
        steps_per_s = (done - self.last_step) / max(now - self.last_time, 1e-9)
        self.last_time, self.last_step = now, done
        record = {"loss": mean_over_ranks(loss).item(), "lr": lr, "grad_norm": grad_norm.item(),
                  **self.throughput(steps_per_s)}
        for source in self.sources:
            record.update(source.metrics())
        record.update(compile_metrics())
        self.logger.scalars(done, record)
        mfu = f" MFU {record['mfu']:.1%}" if "mfu" in record else ""
        log.info("%s loss %.4f lr %.2e grad %.3f %.0f img/s%s", self.progress(done), record["loss"], lr,
                 record["grad_norm"], record["samples_per_s"], mfu)

    def progress(self, done: int, width: int = 20) -> str:
        """A bar, the step, the time so far and an estimate of the time left."""
        filled = round(width * done / self.max_steps)
        elapsed = self.last_time - self.started
        left = elapsed / max(done - self.start_step, 1) * (self.max_steps - done)
        return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.max_steps} {elapsed:.0f}s <{left:.0f}s"


class JsonLines:
    """An append-only file of JSON rows, written a whole line at a time: a write that fails part-way (a full disk)
    is cut back to the last whole line before the error goes on, so no cut line is left to merge with the next
    row; the file is opened at the first row, so that a failed open is a failed row too."""

    def __init__(self, path: Path):
        self.path, self.fd, self.end = path, None, 0  # end: where the whole lines end

    def append(self, row: dict) -> None:
        line = (json.dumps(row) + "\n").encode()
        try:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
                self.end = os.fstat(self.fd).st_size
            elif os.fstat(self.fd).st_size > self.end:  # the cut of an earlier failure could not be undone then
                os.ftruncate(self.fd, self.end)
            rest = memoryview(line)
            while rest:  # a full disk may take part of a write before it refuses the rest
                rest = rest[os.write(self.fd, rest):]
        except OSError:
            if self.fd is not None:
                with suppress(OSError):  # if not now, before the next row
                    os.ftruncate(self.fd, self.end)
            raise
        self.end += len(line)

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


def parse_row(line: str) -> dict | None:
    """A line of metrics.jsonl as its row; None for a line that is not one whole row (cut by a kill mid-write)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def read_rows(path: Path) -> list[dict]:
    """The whole rows of a metrics.jsonl."""
    return [row for line in path.read_text().splitlines() if (row := parse_row(line)) is not None]


def drop_rows_after(path: Path, step: int) -> None:
    """Rewrite metrics.jsonl without the rows of steps after `step` (and lines cut by a kill), atomically."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if (row := parse_row(line)) is not None and row["step"] <= step]
    if len(kept) == len(lines):
        return
    publish_text(path, "".join(f"{line}\n" for line in kept))


def start_tensorboard(log_dir: Path, start_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
        if not isinstance(threading.excepthook, QuietTensorBoardWriterErrors):
            threading.excepthook = QuietTensorBoardWriterErrors(threading.excepthook)

        # hide what an interrupted run logged after the step this start resumes from: those steps are redone
        return SummaryWriter(str(log_dir), purge_step=start_step + 1)
    except Exception as e:  # ImportError without the tensorboard package; an unwritable directory
        log.warning("TensorBoard logging is off: %s: %s%s", type(e).__name__, e,
                    " (pip install tensorboard)" if isinstance(e, ImportError) else "")
        return None


class QuietTensorBoardWriterErrors:
    """threading.excepthook without the traceback of a failed write in TensorBoard's writer thread: the thread
    ends, its error is raised again in the training thread at the next flush, and RunLogger reports it there as
    one warning. Every other thread's error goes to the hook before, as it did."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, args) -> None:
        if not (issubclass(args.exc_type, OSError) and type(args.thread).__module__.startswith("tensorboard.")):
            self.previous(args)


def start_wandb(run_dir: Path, cfg: DictConfig):
    """The wandb module with a started run, or None with a warning."""
    w = cfg.logging.wandb
    try:
        import wandb
        id_file = run_dir / "wandb_run_id"  # a resumed run continues the same wandb run
        if not id_file.is_file():
            id_file.write_text(uuid.uuid4().hex[:12])
        wandb.init(project=w.project, entity=w.entity, name=w.name or run_dir.name, mode=w.mode, dir=str(run_dir),
                   config=OmegaConf.to_container(cfg, resolve=True), id=id_file.read_text(), resume="allow")
        log.info("wandb: project %s, run %s, mode %s", w.project, w.name or run_dir.name, w.mode)
        return wandb
    except Exception as e:  # not installed, no network, bad credentials
        log.warning("wandb is off: %s: %s; training goes on", type(e).__name__, e)
        return None


def smoothed(values: np.ndarray, span: float = 0.05) -> np.ndarray:
    """Each value's mean with its neighbours within `span` of the points on either side (fewer at the ends).
    Centred, so the line follows the logged values to the last one: an average of past values alone (an EMA)
    lags a falling loss by its window, which over a run's few logged rows is most of the run."""
    half = max(1, round(len(values) * span))
    sums = np.concatenate([[0.0], np.cumsum(values)])
    lo = np.maximum(np.arange(len(values)) - half, 0)
    hi = np.minimum(np.arange(len(values)) + half + 1, len(values))
    return (sums[hi] - sums[lo]) / (hi - lo)


def save_loss_curve(metrics_path: Path, out: Path, size: tuple[int, int] = (640, 360)) -> None:
    """The loss of every logged step (raw, and smoothed) as a PNG with a step axis."""
    rows = read_rows(metrics_path)
    points = sorted({r["step"]: r["loss"] for r in rows if "loss" in r and np.isfinite(r["loss"])}.items())
    if len(points) < 2:
        return
    steps, losses = np.array(points, dtype=float).T
    smooth = smoothed(losses)
    width, height = size
    left, right, top, bottom = 60, 20, 30, 40
    lo, hi = float(losses.min()), float(losses.max()) or 1.0
    hi = hi if hi > lo else lo + 1.0

    def xy(step, loss):
        x = left + (step - steps[0]) / (steps[-1] - steps[0]) * (width - left - right)
        return x, top + (hi - loss) / (hi - lo) * (height - top - bottom)

    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    draw.line([xy(s, v) for s, v in zip(steps, losses)], fill=(160, 180, 230), width=1)
    draw.line([xy(s, v) for s, v in zip(steps, smooth)], fill=(20, 60, 200), width=2)
    draw.text((left, 8), "training loss (light: logged, dark: smoothed)", fill="black")
    draw.text((4, top), f"{hi:.3f}", fill="black")
    draw.text((4, height - bottom - 10), f"{lo:.3f}", fill="black")
    draw.text((left, height - bottom + 6), f"step {int(steps[0])}", fill="black")
    draw.text((width - right - 80, height - bottom + 6), f"step {int(steps[-1])}", fill="black")
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)
