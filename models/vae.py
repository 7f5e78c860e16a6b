"""A pipeline's VAE as the MMDiT sees it: diffusers' autoencoder from a pipeline's vae/ folder, between images in
[-1, 1] and the latents the MMDiT is trained on.

A latent is the mean of the VAE's posterior, shifted and scaled to about unit variance, as the family's pipeline
does it:
- `AutoencoderKL` (SD3 / SD3.5, FLUX.1): `(mean - shift_factor) * scaling_factor`, both factors from the VAE's
  config (SD3: 16 channels at 1/8 of the resolution, shift 0.0609, scale 1.5305; FLUX.1: 0.1159, 0.3611);
- `AutoencoderKLQwenImage` (Qwen-Image, a Wan-2.1-style video VAE that sees an image as one frame):
  `(mean - latents_mean) * (1 / latents_std)`, per channel, from its config;
- `AutoencoderKLFlux2` (FLUX.2: 32 channels at 1/8): the mean patchified 2 x 2, channel-major (channel c, row
  offset dy, column offset dx -> c * 4 + dy * 2 + dx: 128 channels at 1/16), then `(z - running_mean) /
  sqrt(running_var + batch_norm_eps)` per channel, the statistics of its BatchNorm (`bn`, which has no affine
  weights and is never trained here), as `Flux2KleinPipeline._encode_vae_image` does. The transformer sees one
  latent pixel of these per token.
Precompute encodes with `VAE.encode`; validation decodes a dataset's latents with `VAE.decode`, which undoes the
normalisation the dataset was encoded with (dataset.json records it: `VAE.record`).
"""

from pathlib import Path

import torch

from errors import InputError

AUTOENCODERS = ("AutoencoderKL", "AutoencoderKLQwenImage", "AutoencoderKLFlux2")  # vae/config.json's _class_name
PATCH = 2  # AutoencoderKLFlux2's patchify (its config's patch_size: 2 x 2)


class VAE:
    """An autoencoder in eval mode, with the normalisation between its posterior and the MMDiT's latents: its
    config's, unless given (that a dataset was encoded with: `record()`'s keys)."""

    def __init__(self, autoencoder, **normalisation):
        self.autoencoder = autoencoder.eval()
        config = autoencoder.config
        self.frames = hasattr(config, "temperal_downsample")  # a video VAE: images are one frame
        self.patchified = hasattr(autoencoder, "bn")  # FLUX.2's: patchified, normalised by its BatchNorm
        if self.frames:
            self.latent_channels = config.z_dim
            self.normalisation = {key: list(normalisation.get(key) or getattr(config, key))
                                  for key in ("latents_mean", "latents_std")}
        elif self.patchified:
            self.latent_channels = config.latent_channels * PATCH * PATCH
            bn = autoencoder.bn
            statistics = {"latents_mean": bn.running_mean,
                          "latents_std": (bn.running_var + config.batch_norm_eps).sqrt()}
            self.normalisation = {key: list(normalisation.get(key) or statistics[key].float().tolist())
                                  for key in statistics}
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
        pipelines multiply by 1 / std, as here; FLUX.2's divides by std: `encode` and `decode` do)."""
        if not self.frames and not self.patchified:
            return self.normalisation["shift_factor"], self.normalisation["scaling_factor"]
        channel = lambda values: torch.tensor(values).view(1, -1, 1, 1).to(like.device, like.dtype)  # noqa: E731
        if self.patchified:
            return channel(self.normalisation["latents_mean"]), channel(self.normalisation["latents_std"])
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
        if self.patchified:
            mean = patchify(mean)
            shift, std = self.shift_and_scale(mean)
            return (mean - shift) / std
        shift, scale = self.shift_and_scale(mean)
        return (mean - shift) * scale

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, h, w] -> images [B, 3, f h, f w] in about [-1, 1], in the VAE's dtype and on its
        device."""
        vae = self.autoencoder
        latents = latents.to(vae.device, vae.dtype)
        shift, scale = self.shift_and_scale(latents)
        if self.patchified:
            return vae.decode(unpatchify(latents * scale + shift)).sample
        latents = latents / scale + shift
        if self.frames:
            return vae.decode(latents[:, :, None]).sample[:, :, 0]
        return vae.decode(latents).sample


def patchify(z: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, 4 C, H/2, W/2], channel c * 4 + dy * 2 + dx (FLUX.2's `_patchify_latents`)."""
    b, c, h, w = z.shape
    return z.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 1, 3, 5, 2, 4).reshape(
        b, c * PATCH * PATCH, h // PATCH, w // PATCH)


def unpatchify(z: torch.Tensor) -> torch.Tensor:
    """The inverse of `patchify`."""
    b, c, h, w = z.shape
    return z.reshape(b, c // (PATCH * PATCH), PATCH, PATCH, h, w).permute(0, 1, 4, 2, 5, 3).reshape(
        b, c // (PATCH * PATCH), h * PATCH, w * PATCH)


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
