"""A pipeline's VAE as the MMDiT sees it: diffusers' autoencoder from a pipeline's vae/ folder, between images in
[-1, 1] and the latents the MMDiT is trained on.

A latent is the mean of the VAE's posterior, shifted and scaled to about unit variance, as the family's pipeline
does it:
- `AutoencoderKL` (SD3 / SD3.5, FLUX.1): `(mean - shift_factor) * scaling_factor`, both factors from the VAE's
  config (SD3: 16 channels at 1/8 of the resolution, shift 0.0609, scale 1.5305; FLUX.1: 0.1159, 0.3611);
- `AutoencoderKLQwenImage` (Qwen-Image, a Wan-2.1-style video VAE that sees an image as one frame):
  `(mean - latents_mean) * (1 / latents_std)`, per channel, from its config.
Precompute encodes with `VAE.encode`; validation decodes a dataset's latents with `VAE.decode`, which undoes the
normalisation the dataset was encoded with (dataset.json records it: `VAE.record`).
"""

from pathlib import Path

import torch

from errors import InputError

AUTOENCODERS = ("AutoencoderKL", "AutoencoderKLQwenImage")  # vae/config.json's _class_name


class VAE:
    """An autoencoder in eval mode, with the normalisation between its posterior and the MMDiT's latents: its
    config's, unless given (that a dataset was encoded with: `record()`'s keys)."""

    def __init__(self, autoencoder, **normalisation):
        self.autoencoder = autoencoder.eval()
        config = autoencoder.config
        self.frames = hasattr(config, "temperal_downsample")  # a video VAE: images are one frame
        if self.frames:
            self.latent_channels = config.z_dim
            self.normalisation = {key: list(normalisation.get(key) or getattr(config, key))
                                  for key in ("latents_mean", "latents_std")}
        else:
            self.latent_channels = config.latent_channels
            scale, shift = normalisation.get("scaling_factor"), normalisation.get("shift_factor")
            self.normalisation = {"scaling_factor": config.scaling_factor if scale is None else scale,
                                  "shift_factor": (config.shift_factor if shift is None else shift) or 0.0}

    def record(self) -> dict:
        """What dataset.json keeps of it, for `load_vae` to decode the dataset's latents as they were encoded."""
        return dict(self.normalisation)

    def shift_and_scale(self, like: torch.Tensor) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """latents = (mean - shift) * scale, in `like`'s dtype and device (per channel for a video VAE, whose
        pipelines multiply by 1 / std, as here)."""
        if not self.frames:
            return self.normalisation["shift_factor"], self.normalisation["scaling_factor"]
        channel = lambda values: torch.tensor(values).view(1, -1, 1, 1).to(like.device, like.dtype)  # noqa: E731
        return channel(self.normalisation["latents_mean"]), 1.0 / channel(self.normalisation["latents_std"])

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] -> latents [B, C, H/f, W/f] (f = 8 for the released VAEs), in the VAE's
        dtype and on its device."""
        vae = self.autoencoder
        pixels = pixels.to(vae.device, vae.dtype)
        if self.frames:
            mean = vae.encode(pixels[:, :, None]).latent_dist.mean[:, :, 0]
        else:
            mean = vae.encode(pixels).latent_dist.mean
        shift, scale = self.shift_and_scale(mean)
        return (mean - shift) * scale

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, h, w] -> images [B, 3, f h, f w] in about [-1, 1], in the VAE's dtype and on its
        device."""
        vae = self.autoencoder
        latents = latents.to(vae.device, vae.dtype)
        shift, scale = self.shift_and_scale(latents)
        latents = latents / scale + shift
        if self.frames:
            return vae.decode(latents[:, :, None]).sample[:, :, 0]
        return vae.decode(latents).sample


def autoencoder_class(folder: Path) -> str:
    """vae/config.json's class, one this trainer reads, before any weight is loaded."""
    import json
    try:
        name = json.loads((Path(folder) / "config.json").read_text()).get("_class_name", "AutoencoderKL")
    except (OSError, ValueError) as e:
        raise InputError(f"the VAE in {folder} does not load: its config.json is not readable ({e})") from None
    if name not in AUTOENCODERS:
        raise InputError(f"the VAE in {folder} is a {name}; this trainer reads {', '.join(AUTOENCODERS)}")
    return name


def load_vae(folder: Path, device: torch.device, dtype: torch.dtype, **normalisation) -> VAE:
    """The VAE in `folder` (a pipeline's vae/), its weights in `dtype` on `device`, normalising latents as
    `normalisation` says (`VAE.record`'s keys; default: its config's); a folder that does not load is the user's
    input error, named."""
    try:
        import diffusers
    except ImportError:
        raise InputError("the VAE needs diffusers: pip install -e '.[finetune]'") from None
    try:
        autoencoder = getattr(diffusers, autoencoder_class(folder)).from_pretrained(folder, torch_dtype=dtype)
    except (OSError, ValueError) as e:
        raise InputError(f"the VAE in {folder} does not load: {e}") from None
    return VAE(autoencoder.to(device), **normalisation)
