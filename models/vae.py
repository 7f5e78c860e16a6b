"""The SD3 VAE as the MMDiT sees it: diffusers' `AutoencoderKL` from a pipeline's vae/ folder, between
images in [-1, 1] and the latents the MMDiT is trained on.

An SD3 latent is the mean of the VAE's posterior, shifted and scaled to about unit variance:
`(mean - shift_factor) * scaling_factor`, with both factors from the VAE's config (SD3 / SD3.5: 16 channels at
1/8 of the resolution, shift 0.0609, scale 1.5305; VAEs without a shift have none). Precompute encodes with
`VAE.encode`; validation decodes a dataset's latents with `VAE.decode`, which undoes the scale and shift the
dataset was encoded with (dataset.json records them).
"""

from pathlib import Path

import torch

from errors import InputError


class VAE:
    """An `AutoencoderKL` in eval mode, with the scale and shift between its posterior and the MMDiT's
    latents: its config's, unless given (those a dataset was encoded with)."""

    def __init__(self, autoencoder, scaling_factor: float | None = None, shift_factor: float | None = None):
        self.autoencoder = autoencoder.eval()
        config = autoencoder.config
        self.latent_channels = config.latent_channels
        self.scaling_factor = config.scaling_factor if scaling_factor is None else scaling_factor
        self.shift_factor = (config.shift_factor if shift_factor is None else shift_factor) or 0.0

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] -> latents [B, C, H/f, W/f] (f = 8 for SD3), in the VAE's dtype
        and on its device."""
        vae = self.autoencoder
        mean = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
        return (mean - self.shift_factor) * self.scaling_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, h, w] -> images [B, 3, f h, f w] in about [-1, 1], in the VAE's dtype and on its
        device."""
        vae = self.autoencoder
        return vae.decode(latents.to(vae.device, vae.dtype) / self.scaling_factor + self.shift_factor).sample


def load_vae(folder: Path, device: torch.device, dtype: torch.dtype, scaling_factor: float | None = None,
             shift_factor: float | None = None) -> VAE:
    """The VAE in `folder` (an `AutoencoderKL` folder, such as an SD3 pipeline's vae/), its weights in
    `dtype` on `device`; a folder that does not load is the user's input error, named."""
    try:
        from diffusers import AutoencoderKL
    except ImportError:
        raise InputError("the VAE needs diffusers: pip install -e '.[finetune]'") from None
    try:
        autoencoder = AutoencoderKL.from_pretrained(folder, torch_dtype=dtype)
    except (OSError, ValueError) as e:
        raise InputError(f"the VAE in {folder} does not load: {e}") from None
    return VAE(autoencoder.to(device), scaling_factor, shift_factor)
