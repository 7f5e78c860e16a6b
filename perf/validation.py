"""Validation from the EMA weights: images of fixed prompts from fixed noise, and the loss on held-out items
at fixed noise levels, every `validation.every` steps and at the end of a run.

- Images: for the shapes data, all 90 captions, scored for prompt fidelity (always at the end of a shapes
  run, validation on or off); for latent data, the prompts `data.precompute --validation-prompts` encoded,
  decoded by the VAE of the pipeline that encoded the dataset (`validation.vae_from` to override). The grid
  goes to `samples/step_XXXXXXXX.png`, TensorBoard's Images tab and wandb.
- Held-out loss (`data.holdout` items): the flow-matching loss at `validation.loss_sigmas` evenly spaced noise
  levels with noise keyed by (seed, item, level), so the curve is deterministic and comparable across runs:
  `val/loss` and `val/loss_by_sigma/<sigma>`.

Every rank takes an equal share of the prompts and items (padded, so that under FSDP all ranks run the same
forwards and so the same collectives); results are gathered to rank 0. The EMA weights are swapped into the
training model in place (one extra copy of the trained weights, no second model), compiled code runs eagerly
(no recompilation for other batch shapes), and when validation is off nothing is built or loaded.
"""

import logging
import math
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from configs.schema import ConfigError
from data.images import save_grid, to_unit
from data.shapes import all_prompts, caption, prompt_fidelity
from models.pipeline import generate, initial_noise
from models.rectified_flow import VALIDATION_STREAM, interpolate, per_sample_loss, sample_key
from optim.ema import EMA
from perf.distributed import World, is_distributed
from perf.parallel import reshard, unwrap
from perf.precision import DTYPES, autocast

log = logging.getLogger("mmdit")


def share(items: list, world: World) -> tuple[list, int]:
    """This rank's share of `items` (every world_size-th one), padded with its first item to the length every
    rank gets; returns the share and how many of it are real."""
    mine = items[world.rank :: world.world_size]
    length = math.ceil(len(items) / world.world_size)
    return mine + [items[0]] * (length - len(mine)), len(mine)


def gather_to_main(values: list, world: World) -> list:
    """Rank 0: everyone's values, in the order `share` dealt them (item i from rank i % world_size)."""
    if not is_distributed():
        return values
    parts = [None] * world.world_size
    dist.all_gather_object(parts, values)
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


class ShapesImages:
    """All 90 captions of the shapes data: prompt fidelity and a captioned grid."""

    def __init__(self, cfg: DictConfig, tokenizer, shape: tuple):
        self.cfg, self.tokenizer, self.shape = cfg, tokenizer, shape
        self.prompts = all_prompts()
        self.captions = [caption(*p) for p in self.prompts]

    def __call__(self, model, world: World, device) -> tuple[torch.Tensor | None, list[str], dict]:
        indices, real = share(list(range(len(self.captions))), world)
        s, seed = self.cfg.sampling, self.cfg.training.seed
        text = {"input_ids": self.tokenizer([self.captions[i] for i in indices])}
        with autocast(device, self.cfg.training.dtype):
            x = generate(model, text, {"input_ids": self.tokenizer([""])}, initial_noise(seed, indices, self.shape),
                         s.steps, s.cfg_scale, s.shift, tuple(s.guidance_interval))
        images = gather_to_main(list(to_unit(x[:real])), world)
        if not world.is_main:
            return None, [], {}
        images = torch.stack(images)
        fidelity = prompt_fidelity(images, self.prompts)
        log.info("prompt fidelity (90 prompts): color %.2f  shape %.2f  position %.2f", fidelity["color"],
                 fidelity["shape"], fidelity["position"])
        shown = torch.linspace(0, len(self.prompts) - 1, s.grid_size).long().tolist()
        return images[shown], [self.captions[i] for i in shown], {f"fidelity/{k}": v for k, v in fidelity.items()}


class LatentImages:
    """The dataset's validation prompts, generated in latent space and decoded by the VAE (on rank 0)."""

    def __init__(self, cfg: DictConfig, dataset, world: World, device: torch.device):
        self.cfg, self.dataset, self.device = cfg, dataset, device
        self.shape = (dataset.latent_channels, *Counter(dataset.sizes).most_common(1)[0][0])
        folder = vae_folder(cfg, dataset)
        vae = dataset.index.get("vae", {})
        self.vae = load_vae(folder, device, cfg.training.dtype) if world.is_main else None
        config = self.vae.config if self.vae is not None else {}
        self.scaling = vae.get("scaling_factor", getattr(config, "scaling_factor", 1.0))
        self.shift = vae.get("shift_factor", getattr(config, "shift_factor", 0.0)) or 0.0

    def __call__(self, model, world: World, device) -> tuple[torch.Tensor | None, list[str], dict]:
        prompts, captions = self.dataset.validation_prompts, self.dataset.validation_captions
        indices, real = share(list(range(len(captions))), world)
        s, seed = self.cfg.sampling, self.cfg.training.seed
        text = {k: v[indices] for k, v in prompts.items()}
        uncond = self.dataset.empty_prompt or {k: torch.zeros_like(v[:1]) for k, v in prompts.items()}
        with autocast(device, self.cfg.training.dtype):
            latents = generate(model, text, uncond, initial_noise(seed, indices, self.shape), s.steps, s.cfg_scale,
                               s.shift, tuple(s.guidance_interval), batch_size=self.cfg.training.train_batch_size)
        latents = gather_to_main(list(latents[:real]), world)
        if not world.is_main:
            return None, [], {}
        return torch.stack([self.decode(x) for x in latents]), captions, {}

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """One image at a time: a 1024-px decode holds gigabytes of activations."""
        x = latents[None].to(self.device, self.vae.dtype) / self.scaling + self.shift
        return to_unit(self.vae.decode(x).sample[0].float()).cpu()


def vae_folder(cfg: DictConfig, dataset) -> Path:
    """validation.vae_from (a pipeline or its vae/ folder), else the VAE the precompute recorded."""
    if cfg.validation.vae_from:
        folder, key = Path(cfg.validation.vae_from), "validation.vae_from"
    else:
        index = dataset.index
        recorded = index.get("vae", {}).get("folder") or (index.get("model") and f"{index['model']}/vae")
        if not recorded:
            raise ConfigError(f"{cfg.data.path}/dataset.json records no VAE; set validation.vae_from to the "
                              f"pipeline (or its vae/ folder) that encoded the dataset")
        folder, key = Path(recorded), f"the VAE recorded in {cfg.data.path}/dataset.json"
    if (folder / "vae" / "config.json").is_file():
        folder = folder / "vae"
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{key}: {folder} is not a diffusers VAE folder (no config.json); set "
                          f"validation.vae_from to the SD3 pipeline (or its vae/ folder) that encoded the data")
    return folder


def load_vae(folder: Path, device: torch.device, dtype: str):
    try:
        from diffusers import AutoencoderKL
    except ImportError:
        raise ConfigError("validation images of latent runs need diffusers: pip install -e '.[finetune]'") from None
    try:
        vae = AutoencoderKL.from_pretrained(folder, torch_dtype=DTYPES.get(dtype, torch.float32))
    except (OSError, ValueError) as e:
        raise ConfigError(f"the VAE in {folder} does not load: {e}") from None
    log.info("validation images decoded by the VAE in %s", folder)
    return vae.to(device).eval()


class HeldOutLoss:
    """The loss on the held-out items at fixed noise levels with fixed noise."""

    def __init__(self, cfg: DictConfig, dataset, tokenizer, items: list[int]):
        self.cfg, self.dataset, self.tokenizer, self.items = cfg, dataset, tokenizer, items
        count = cfg.validation.loss_sigmas
        self.sigmas = torch.tensor([(k + 0.5) / count for k in range(count)])

    @torch.no_grad()
    def __call__(self, model, world: World, device: torch.device) -> dict[str, float]:
        items, real = share(self.items, world)
        sums = torch.zeros(len(self.sigmas), device=device)
        for i, index in enumerate(items):  # one forward per item, its noise levels as the batch
            item = self.dataset[index]
            x0 = item["latents"][None].expand(len(self.sigmas), *item["latents"].shape)
            noise = torch.stack([torch.randn(x0.shape[1:], generator=torch.Generator().manual_seed(
                sample_key(self.cfg.training.seed, VALIDATION_STREAM, f"{index}/{k}"))) for k in range(len(x0))])
            text = self.text(item, len(x0))
            with autocast(device, self.cfg.training.dtype):
                v = model(interpolate(x0, noise, self.sigmas).to(device), self.sigmas.to(device),
                          {k: t.to(device) for k, t in text.items()})
            if i < real:
                sums += per_sample_loss(v, x0.to(device), noise.to(device))
        if is_distributed():
            dist.all_reduce(sums)
        means = sums.cpu() / len(self.items)
        out = {f"val/loss_by_sigma/{s:.3f}": float(m) for s, m in zip(self.sigmas.tolist(), means)}
        return {"val/loss": float(means.mean()), **out}

    def text(self, item: dict, rows: int) -> dict[str, torch.Tensor]:
        if self.tokenizer is not None:
            return {"input_ids": self.tokenizer([item["caption"]] * rows)}
        return {k: item[k][None].expand(rows, *item[k].shape) for k in ("prompt_embeds", "pooled_prompt_embeds")}


class Validation:
    def __init__(self, every: int, images, loss: HeldOutLoss | None, world: World, device: torch.device):
        self.every, self.images, self.loss, self.world, self.device = every, images, loss, world, device

    def at_end(self) -> bool:
        return self.every > 0 or isinstance(self.images, ShapesImages)

    def __call__(self, model, ema: EMA, step: int, run_dir: Path, logger) -> dict[str, float]:
        """Run it (every rank); rank 0 writes the grid and logs the metrics, which it returns."""
        metrics = {}
        with evaluating(model, ema) as plain:
            if self.loss is not None:
                metrics |= self.loss(plain, self.world, self.device)
            if self.images is not None:
                images, captions, scores = self.images(plain, self.world, self.device)
                metrics |= scores
                if images is not None:
                    grid = run_dir / "samples" / f"step_{step:08d}.png"
                    save_grid(images, captions, grid)
                    logger.image(step, "samples", grid, captions)
        if metrics and self.world.is_main:
            logger.scalars(step, metrics)
            if "val/loss" in metrics:
                log.info("step %d: held-out loss %.4f", step, metrics["val/loss"])
        return metrics


def build_validation(cfg: DictConfig, dataset, tokenizer, holdout: list[int], world: World,
                     device: torch.device) -> Validation:
    """What validation runs for this config (a VAE is loaded only for latent runs with validation on);
    errors (no VAE to be found) are raised here, before any training."""
    on = cfg.validation.every > 0
    shape = (dataset.latent_channels, *dataset.latent_sizes[-1])
    if tokenizer is not None:
        images = ShapesImages(cfg, tokenizer, shape)
    elif on and dataset.validation_prompts is not None:
        images = LatentImages(cfg, dataset, world, device)
    else:
        images = None
        if on:
            log.warning("%s holds no validation prompts (data.precompute --validation-prompts FILE): no "
                        "validation images", cfg.data.path)
    loss = HeldOutLoss(cfg, dataset, tokenizer, holdout) if on and holdout else None
    if on and not holdout:
        log.info("data.holdout=0: no held-out loss")
    return Validation(cfg.validation.every, images, loss, world, device)
