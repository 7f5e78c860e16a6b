"""Validation from the EMA weights: images of fixed prompts from fixed noise, and the loss on held-out items
at fixed noise levels, every `validation.every` steps and at the end of a run.

- Images (`PromptImages`): the prompts, their text input, how to turn samples into pictures and how to score
  them all come from the dataset (configs/build.py puts them together): the shapes data scores all 90
  captions for prompt fidelity; latent datasets decode their validation prompts with a VAE. The grid goes to
  `samples/step_XXXXXXXX.png`, TensorBoard's Images tab and wandb.
- Held-out loss (`HeldOutLoss`, `data.holdout` items): the flow-matching loss at `validation.loss_sigmas` evenly
  spaced noise levels with noise keyed by (seed, item, level), so the curve is deterministic and comparable
  across runs: `val/loss` and `val/loss_by_sigma/<sigma>` (per dataset of a mixture: `val/<dataset>/loss`...),
  weighted by the items' loss masks where they have them.

Every rank takes an equal share of the prompts and items (padded, so that under FSDP all ranks run the same
forwards and so the same collectives); results are gathered to rank 0. The EMA weights are swapped into the
training model in place (one extra copy of the trained weights, no second model), compiled code runs eagerly
(no recompilation for other batch shapes), and when validation is off nothing is built or loaded.
"""

import json
import logging
import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from data.images import save_grid
from data.latents import publish_json
from models.pipeline import Sampler, generate, initial_noise
from models.rectified_flow import VALIDATION_STREAM, interpolate, per_sample_loss, sample_key
from optim.ema import EMA
from perf.parallel import reshard, unwrap
from perf.precision import autocast
from runtime.distributed import World, gather_objects, is_distributed
from runtime.outputs import Output

log = logging.getLogger("mmdit")
FINAL = "validation.json"  # in the run directory: the final validation's step and metrics


def share(items: list, world: World) -> tuple[list, int]:
    """This rank's share of `items` (every world_size-th one), padded with its first item to the length every
    rank gets; returns the share and how many of it are real."""
    mine = items[world.rank :: world.world_size]
    length = math.ceil(len(items) / world.world_size)
    return mine + [items[0]] * (length - len(mine)), len(mine)


def gather_to_main(values: list, world: World) -> list:
    """Rank 0: everyone's values, in the order `share` dealt them (item i from rank i % world_size)."""
    parts = gather_objects(values)
    out = []
    for i in range(max(len(p) for p in parts)):
        out += [p[i] for p in parts if i < len(p)]
    return out


@contextmanager
def evaluating(model, ema: EMA):
    """The EMA weights, eval mode (no adapter dropout), eager execution; then back to training."""
    with ema.applied(), torch.compiler.set_stance("force_eager"):
        model.eval()
        try:
            yield unwrap(model)
        finally:
            model.train()
            reshard(model)


class PromptImages:
    """Samples of fixed prompts from fixed noise: `text` is the model's text input for `captions` (one row
    each) and `uncond` the one-row unconditional input; `decode` turns the model's outputs into [N, 3, H, W] images
    in [0, 1] (on rank 0), `score` (if any) rates them, and the grid shows `shown` of them. An edit model's
    samples edit `references` (each [N, C, h, w], a row per caption; the unconditional branch edits them too), and
    the grid shows each beside its references."""

    def __init__(self, captions: list[str], text: dict, uncond: dict, shape: tuple, decode, score, shown: list[int],
                 sampler: Sampler, seed: int, dtype: str, batch_size: int, references: tuple = ()):
        self.captions, self.text, self.uncond, self.shape = captions, text, uncond, shape
        self.decode, self.score, self.shown = decode, score, shown
        self.sampler, self.seed, self.dtype, self.batch_size = sampler, seed, dtype, batch_size
        self.references = references
        self.columns = 4 if not references else 2 * (len(references) + 1)  # two edits a row

    def __call__(self, model, world: World, device) -> tuple[torch.Tensor | None, list[str], dict]:
        indices, real = share(list(range(len(self.captions))), world)
        with autocast(device, self.dtype):
            samples = generate(model, {k: v[indices] for k, v in self.text.items()}, self.uncond,
                               initial_noise(self.seed, indices, self.shape), self.sampler, self.batch_size,
                               tuple(r[indices] for r in self.references))
        samples = gather_to_main(list(samples[:real]), world)
        if not world.is_main:
            return None, [], {}
        images = self.decode(torch.stack(samples))
        scores = self.score(images, self.captions) if self.score else {}
        if not self.references:
            return images[self.shown], [self.captions[i] for i in self.shown], scores
        cells, captions = [], []
        for i in self.shown:  # each edit's references (at its result's size), then the result
            cells += [resized(self.decode(r[i : i + 1])[0], images.shape[-2:]) for r in self.references] + [images[i]]
            captions += [f"reference {j + 1}" for j in range(len(self.references))] + [self.captions[i]]
        return torch.stack(cells), captions, scores


def resized(image: torch.Tensor, size) -> torch.Tensor:
    """[3, h, w] at `size` (a reference beside its edit in the grid)."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    return torch.nn.functional.interpolate(image[None], size=tuple(size), mode="bilinear", antialias=True)[0]


class HeldOutLoss:
    """The loss on the held-out items at fixed noise levels with fixed noise. `text(item, rows)` is the model's
    text input for an item, repeated `rows` times."""

    def __init__(self, dataset, items: list[int], text, loss_sigmas: int, seed: int, dtype: str, prefix: str = "val/"):
        self.dataset, self.items, self.text, self.seed, self.dtype = dataset, items, text, seed, dtype
        self.prefix = prefix
        self.sigmas = torch.tensor([(k + 0.5) / loss_sigmas for k in range(loss_sigmas)])

    @torch.no_grad()
    def __call__(self, model, world: World, device: torch.device) -> dict[str, float]:
        items, real = share(self.items, world)
        sums = torch.zeros(len(self.sigmas), device=device)
        for i, index in enumerate(items):  # one forward per item, its noise levels as the batch
            item = self.dataset[index]
            x0 = item["latents"][None].expand(len(self.sigmas), *item["latents"].shape)
            noise = torch.stack([torch.randn(x0.shape[1:], generator=torch.Generator().manual_seed(
                sample_key(self.seed, VALIDATION_STREAM, f"{index}/{k}"))) for k in range(len(x0))])
            references = tuple(r[None].expand(len(x0), *r.shape).to(device) for r in item.get("references", ()))
            with autocast(device, self.dtype):
                v = model(interpolate(x0, noise, self.sigmas).to(device), self.sigmas.to(device),
                          {k: t.to(device) for k, t in self.text(item, len(x0)).items()}, references=references)
            if i < real:
                mask = item.get("loss_mask")
                sums += per_sample_loss(v, x0.to(device), noise.to(device),
                                        None if mask is None else mask[None].expand(len(x0), *mask.shape).to(device))
        if is_distributed():
            dist.all_reduce(sums)
        means = sums.cpu() / len(self.items)
        out = {f"{self.prefix}loss_by_sigma/{s:.3f}": float(m) for s, m in zip(self.sigmas.tolist(), means)}
        return {f"{self.prefix}loss": float(means.mean()), **out}


def final_step(run_dir: Path) -> int | None:
    """The step of the final validation `validation.json` records; None without one (or one that does not read:
    the final validation is then done again, and rewrites it)."""
    try:
        return json.loads((run_dir / FINAL).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None


class Validation:
    """At every `every`-th step (`every` > 0) and, with `at_end`, at the end of the run (also with `every` 0: a
    run's final grid and scores are what its user looks at first)."""

    def __init__(self, every: int, at_end: bool, max_steps: int, images: PromptImages | None,
                 losses: list[HeldOutLoss], world: World, device: torch.device):
        self.every, self.final, self.max_steps, self.images, self.losses = every, at_end, max_steps, images, losses
        self.world, self.device = world, device
        self.grids = Output("sample grid")

    def due(self, done: int) -> bool:
        """At every `every`-th step but the last (`at_end` covers that, after the final checkpoint)."""
        return self.every > 0 and done % self.every == 0 and done != self.max_steps

    @property
    def runs_at_end(self) -> bool:
        return self.final and (self.every > 0 or self.images is not None or bool(self.losses))

    def finished(self, run_dir: Path, step: int) -> bool:
        """Whether a run at its last step has nothing left to do: no final validation, or one recorded for this
        step in `validation.json` (a run stopped during it does it when rerun). Rank 0's reading, on every rank."""
        done = (not self.runs_at_end or final_step(run_dir) == step) if self.world.is_main else None
        return gather_objects(done)[0]

    def at_end(self, model, ema: EMA, run_dir: Path, logger) -> None:
        """The final validation; its metrics and step also go to `validation.json`, written last: the record
        that the run is finished."""
        if not self.runs_at_end:
            return
        if self.images is not None and self.world.is_main:  # it can take longer than a short run's training
            log.info("final validation: sampling %d caption(s) from the EMA weights, %d Euler steps each (cfg %g)%s",
                     len(self.images.captions), self.images.sampler.steps, self.images.sampler.cfg_scale,
                     ", then scoring their prompt fidelity" if self.images.score else "")
            log.info("(validation.at_end=false ends a run at its last checkpoint instead)")
        metrics = self(model, ema, self.max_steps, run_dir, logger)
        if self.world.is_main:
            Output(FINAL, "rerunning the command does the final validation again").write(
                run_dir / FINAL, publish_json, run_dir / FINAL, {"step": self.max_steps, **metrics})

    def __call__(self, model, ema: EMA, step: int, run_dir: Path, logger) -> dict[str, float]:
        """Run it (every rank); rank 0 writes the grid and logs the metrics, which it returns."""
        metrics = {}
        with evaluating(model, ema) as plain:
            for loss in self.losses:  # one per dataset of a mixture
                metrics |= loss(plain, self.world, self.device)
            if self.images is not None:
                images, captions, scores = self.images(plain, self.world, self.device)
                metrics |= scores
                if images is not None:
                    grid = run_dir / "samples" / f"step_{step:08d}.png"
                    if self.grids.write(grid, save_grid, images, captions, grid, self.images.columns,
                                        partial=(grid, grid.with_suffix(".txt"))):
                        logger.image(step, "samples", grid, captions)
        if metrics and self.world.is_main:
            logger.scalars(step, metrics)
            log.info("step %d validation: %s", step, "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                               if "loss_by_sigma" not in k))
        return metrics
