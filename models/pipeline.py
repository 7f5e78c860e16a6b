"""Generating from captions: Euler sampling with classifier-free guidance (and a guidance-distilled model's
embedded guidance), from noise keyed by image index."""

from dataclasses import dataclass
from functools import partial

import torch

from models.rectified_flow import SAMPLING_STREAM, euler_sample, sample_key
from models.text_encoder import TextToImage


def initial_noise(seed: int, indices: list[int], shape: tuple) -> torch.Tensor:
    """Starting noise of the images `indices`, image i keyed by (seed, i): the same whoever generates it."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(
        sample_key(seed, SAMPLING_STREAM, i))) for i in indices])


@dataclass(frozen=True)
class Sampler:
    """How images are made: `steps` Euler steps from sigma 1 to 0 on a schedule shifted by `shift` (and stretched
    to end at `terminal`, where the family's scheduler does), classifier-free guidance `cfg_scale` at the sigmas
    in `guidance_interval` (1: none, one forward per step; `renorm`: rescaled per token of renorm x renorm latent
    pixels, as Qwen-Image's true CFG), and for a guidance-distilled model (FLUX.1-dev) its embedded `guidance`
    scale."""
    steps: int
    cfg_scale: float
    shift: float
    guidance_interval: tuple[float, float] = (0.0, 1.0)
    guidance: float | None = None
    terminal: float | None = None
    renorm: int | None = None


def with_references(model, references: tuple[torch.Tensor, ...]):
    """`model` as euler_sample calls it, given an edit's reference latents (a row per sample): the rows doubled
    where guidance doubles the batch (the unconditional branch edits the same images, as the edit pipelines do)."""
    def velocity(x: torch.Tensor, sigma: torch.Tensor, text: dict) -> torch.Tensor:
        repeats = len(x) // len(references[0])
        return model(x, sigma, text, references=tuple(r.repeat(repeats, 1, 1, 1) for r in references))
    return velocity


@torch.no_grad()
def generate(model: TextToImage, text: dict[str, torch.Tensor], uncond: dict[str, torch.Tensor], noise: torch.Tensor,
             sampler: Sampler, batch_size: int = 96, references: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """The model's output space (pixels in [-1, 1] for the shapes data, latents otherwise), one sample per row
    of `text` (token ids, or precomputed embeddings) from the matching row of `noise`, editing the matching rows
    of `references` (an edit model's reference latents, each [N, C, h, w]); `uncond` is the one-row unconditional
    input of guidance. Returned in float32 on the CPU."""
    device = next(model.parameters()).device
    velocity = model if sampler.guidance is None else partial(model, guidance=sampler.guidance)
    out = []
    for start in range(0, len(noise), batch_size):
        cond = {k: v[start : start + batch_size].to(device) for k, v in text.items()}
        n = len(next(iter(cond.values())))
        velocity_of = with_references(velocity, tuple(r[start : start + n].to(device) for r in references)) \
            if references else velocity
        x = euler_sample(velocity_of, noise[start : start + n].to(device), cond,
                         {k: v.to(device).expand(n, *v.shape[1:]) for k, v in uncond.items()}, sampler.steps,
                         sampler.cfg_scale, sampler.shift, sampler.guidance_interval, sampler.terminal,
                         sampler.renorm)
        out.append(x.float().cpu())
    return torch.cat(out) if out else noise.new_zeros((0, *noise.shape[1:]))
