"""Generating from captions: Euler sampling with classifier-free guidance, from noise keyed by image index."""

import torch

from models.rectified_flow import SAMPLING_STREAM, euler_sample, sample_key
from models.text_encoder import TextToImage


def initial_noise(seed: int, indices: list[int], shape: tuple) -> torch.Tensor:
    """Starting noise of the images `indices`, image i keyed by (seed, i): the same whoever generates it."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(
        sample_key(seed, SAMPLING_STREAM, i))) for i in indices])


@torch.no_grad()
def generate(model: TextToImage, text: dict[str, torch.Tensor], uncond: dict[str, torch.Tensor], noise: torch.Tensor,
             steps: int, cfg_scale: float, shift: float, guidance_interval: tuple[float, float] = (0.0, 1.0),
             batch_size: int = 96) -> torch.Tensor:
    """The model's output space (pixels in [-1, 1] for the shapes data, latents otherwise), one sample per row
    of `text` (token ids, or precomputed embeddings) from the matching row of `noise`; `uncond` is the one-row
    unconditional input of guidance. Returned in float32 on the CPU."""
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(noise), batch_size):
        cond = {k: v[start : start + batch_size].to(device) for k, v in text.items()}
        n = len(next(iter(cond.values())))
        x = euler_sample(model, noise[start : start + n].to(device), cond,
                         {k: v.to(device).expand(n, *v.shape[1:]) for k, v in uncond.items()}, steps, cfg_scale,
                         shift, guidance_interval)
        out.append(x.float().cpu())
    return torch.cat(out) if out else noise.new_zeros((0, *noise.shape[1:]))
