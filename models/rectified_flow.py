"""Rectified flow as in SD3: x_t = (1 - sigma) x0 + sigma * noise, the model predicts v = noise - x0.

All training randomness of a sample (noise, sigma, caption dropout) comes from a generator keyed by
(seed, step, position of the sample in the global batch), never from a process-wide RNG stream: the math of
step s is then a function of (seed, s, global batch) alone, whatever the world size, accumulation or
micro-batch split.
"""

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SampleNoise:
    noise: torch.Tensor  # [B, C, H, W]
    sigma_normal: torch.Tensor  # [B] standard normal draws, mapped to sigma by `training_sigmas`
    sigma_uniform: torch.Tensor  # [B] U(0,1) draws for uniform sigma sampling
    dropout_uniform: torch.Tensor  # [B] U(0,1) draws for caption dropout


# Streams other than training steps use negative "step" keys, so no two uses share a generator.
(DATA_STREAM, ORDER_STREAM, SAMPLING_STREAM, FLIP_STREAM, HOLDOUT_STREAM, VALIDATION_STREAM, INIT_STREAM,
 CAPTION_STREAM) = range(-1, -9, -1)


def sample_key(seed: int, step: int, position: int | str) -> int:
    digest = hashlib.blake2b(f"{seed}/{step}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def draw_sample_noise(seed: int, step: int, positions: torch.Tensor, sample_shape: tuple) -> SampleNoise:
    """Per-sample randomness for training step `step`; `positions` index the samples in the global batch."""
    draws = {"noise": [], "sigma_normal": [], "sigma_uniform": [], "dropout_uniform": []}
    for position in positions.tolist():
        gen = torch.Generator().manual_seed(sample_key(seed, step, position))
        draws["noise"].append(torch.randn(sample_shape, generator=gen))
        draws["sigma_normal"].append(torch.randn((), generator=gen))
        draws["sigma_uniform"].append(torch.rand((), generator=gen))
        draws["dropout_uniform"].append(torch.rand((), generator=gen))
    return SampleNoise(**{k: torch.stack(v) for k, v in draws.items()})


def shift_sigmas(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3 timestep shift: sigma' = s*sigma / (1 + (s-1)*sigma); s > 1 spends more time at high noise."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def resolution_shift(image_tokens: int, base_tokens: int = 256, max_tokens: int = 4096, base_shift: float = 0.5,
                     max_shift: float = 1.15) -> float:
    """A pipeline's timestep shift for an image of `image_tokens` tokens (diffusers' `calculate_shift`): e^mu with mu
    linear in the token count, base_shift at base_tokens and max_shift at max_tokens (FLUX.1's: 0.5 at 256 and 1.15
    at 4096; a family's own: models/family.py's `ResolutionShift`). SD3's shift s and this one are the same map,
    sigma' = s sigma / (1 + (s - 1) sigma), with s = e^mu."""
    mu = base_shift + (max_shift - base_shift) * (image_tokens - base_tokens) / (max_tokens - base_tokens)
    return math.exp(mu)


def batch_sigmas(draw: SampleNoise, latent_size: tuple[int, int], patch_size: int, by_resolution: dict | None,
                 shift: float, **sampling) -> torch.Tensor:
    """`training_sigmas` of a batch of latents of `latent_size`: shifted by `shift`, or by the resolution's
    (`by_resolution`: `resolution_shift`'s constants, for tokens of patch_size x patch_size latents)."""
    if by_resolution is not None:
        shift = resolution_shift((latent_size[0] // patch_size) * (latent_size[1] // patch_size), **by_resolution)
    return training_sigmas(draw, shift=shift, **sampling)


def training_sigmas(draw: SampleNoise, sampling: str, logit_mean: float, logit_std: float, shift: float,
                    mode_scale: float = 1.29) -> torch.Tensor:
    """The noise level of each sample, drawn by one of the SD3 paper's schemes (sec. 3.1), then shifted."""
    u = draw.sigma_uniform
    if sampling == "logit_normal":
        sigma = torch.sigmoid(logit_mean + logit_std * draw.sigma_normal)
    elif sampling == "uniform":
        sigma = u
    elif sampling == "mode":  # f(u) = 1 - u - s (cos^2(pi u / 2) - 1 + u): density peaked in the middle for s > 0
        sigma = 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    elif sampling == "cosmap":  # f(u) = 1 - 1 / (tan(pi u / 2) + 1): density 2 / (pi (1 - 2t + 2t^2))
        sigma = 1 - 1 / (torch.tan(math.pi * u / 2) + 1)
    else:
        raise ValueError(f"unknown sigma sampling {sampling!r}; expected logit_normal, uniform, mode or cosmap")
    return shift_sigmas(sigma.clamp(0, 1), shift)


def interpolate(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    s = sigma.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise


def per_sample_loss(v_pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor,
                    loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error to the velocity target, one value per sample, in fp32.

    With a `loss_mask` ([B, 1, h, w] weights in [0, 1] at latent resolution, shared by the C channels) it is the
    mean over weighted latent elements: sum(w * (v - v*)^2) / (C * sum(w)) per sample. An all-ones mask gives
    the plain mean bit for bit (the same sum, divided by the same count); precompute skips samples whose mask
    is empty, so the division never meets zero."""
    squared = F.mse_loss(v_pred.float(), (noise - x0).float(), reduction="none")
    if loss_mask is None:
        return squared.flatten(1).mean(1)
    weights = loss_mask.float()
    return (squared * weights).flatten(1).sum(1) / (weights.flatten(1).sum(1) * squared.shape[1])


def sampling_sigmas(steps: int, shift: float, terminal: float | None = None,
                    device: torch.device | None = None) -> torch.Tensor:
    """The `steps` + 1 noise levels of Euler sampling from 1 to 0: evenly spaced, shifted, and (with `terminal`, a
    pipeline's `shift_terminal`) stretched so that the last before 0 is `terminal`, as diffusers'
    FlowMatchEulerDiscreteScheduler does."""
    sigmas = shift_sigmas(torch.linspace(1.0, 0.0, steps + 1, device=device), shift)
    if terminal is not None:
        rest = 1 - sigmas[:-1]
        sigmas[:-1] = 1 - rest / (rest[-1] / (1 - terminal))
    return sigmas


def guided(v_cond: torch.Tensor, v_uncond: torch.Tensor, cfg_scale: float, renorm: int | None) -> torch.Tensor:
    """Classifier-free guidance; with `renorm` (Qwen-Image's true CFG), each token's guided velocity rescaled to
    the norm of its conditional one, a token being a renorm x renorm patch of latent pixels over all channels."""
    v = v_uncond + cfg_scale * (v_cond - v_uncond)
    if renorm is None:
        return v
    norm = lambda t: torch.linalg.vector_norm(  # noqa: E731  over each token's (channel, row, column) patch
        t.unflatten(2, (-1, renorm)).unflatten(4, (-1, renorm)), dim=(1, 3, 5), keepdim=True)
    return (v.unflatten(2, (-1, renorm)).unflatten(4, (-1, renorm)) * (norm(v_cond) / norm(v))).flatten(4, 5).flatten(2, 3)


@torch.no_grad()
def euler_sample(velocity, noise: torch.Tensor, cond: dict, uncond: dict, steps: int, cfg_scale: float,
                 shift: float, guidance_interval: tuple[float, float] = (0.0, 1.0), terminal: float | None = None,
                 renorm: int | None = None) -> torch.Tensor:
    """Integrate dx/dsigma = v from sigma=1 to 0 (`sampling_sigmas`); `velocity(x, sigma, text)`; cond/uncond are
    text inputs (dicts of tensors, a row per sample). Classifier-free guidance (`guided`) applies at the steps whose
    sigma lies in `guidance_interval` (Kynkaanniemi et al. 2024: guidance helps where the image's layout is decided
    and hurts detail at low noise); elsewhere, and with cfg_scale == 1, the unconditional branch is skipped."""
    sigmas = sampling_sigmas(steps, shift, terminal, noise.device)
    both = {k: torch.cat([cond[k], uncond[k]]) for k in cond}
    x = noise
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        with_guidance = cfg_scale != 1.0 and guidance_interval[0] <= float(sigma) <= guidance_interval[1]
        x_in = torch.cat([x, x]) if with_guidance else x
        v = velocity(x_in, sigma.expand(x_in.shape[0]), both if with_guidance else cond).float()
        if with_guidance:
            v = guided(*v.chunk(2), cfg_scale, renorm)
        x = x + (sigma_next - sigma) * v
    return x
