"""A pipeline's encoders as precompute runs them: the VAE for latents, the family's text encoders for captions
(SD3: CLIP-L, CLIP-G and T5; FLUX.1: CLIP-L and T5; Qwen-Image: Qwen2.5-VL; FLUX.2: Qwen3 or Mistral-Small-3)."""

import json
import logging
from pathlib import Path

import torch

from data.precompute.images import to_unit_range
from models.diffusers_io import save_safetensors
from models.families import Family
from models.vae import load_vae

log = logging.getLogger("mmdit")


class PipelineEncoders:
    """The VAE of a pipeline directory of `family`, and its text encoders unless text embeddings are not
    stored."""

    def __init__(self, model_dir: Path, family: Family, device: torch.device, dtype: torch.dtype,
                 max_sequence_length: int, text_embeddings: bool):
        self.device, self.family = device, family
        self.vae = load_vae(model_dir / "vae", device, dtype)
        self.tokenizers = family.tokenizers(model_dir, max_sequence_length)
        with torch.device("meta"):
            self.text = family.text_encoders(model_dir, max_sequence_length)
        self.text_dims, self.text_mask = (self.text.joint_dim, self.text.pooled_dim), self.text.MASKED
        if text_embeddings:
            self.text.check("--model")
            self.text.load(device, dtype)
        else:
            self.text = None
        self.truncated = 0

    @torch.no_grad()
    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        self.truncated += self.tokenizers.truncated(captions)
        return self.text(**{k: v.to(self.device) for k, v in self.tokenizers(captions).items()})

    def encode(self, pixels: torch.Tensor, variants: list[list[str]], flip: bool, store: torch.dtype) -> dict:
        """A batch's stored fields, in the storage dtype, on the host. `variants`: the batch's captions as encoded,
        one list per variant; several are stacked as dimension 1 of each text field (data/latents.py)."""
        rows = {"latents": self.vae.encode(to_unit_range(pixels))}
        if flip:
            rows["latents_flipped"] = self.vae.encode(to_unit_range(pixels.flip(-1)))
        if self.text is not None:
            encoded = [self.encode_text(list(captions)) for captions in variants]
            rows.update(encoded[0] if len(encoded) == 1 else {k: torch.stack([e[k] for e in encoded], 1)
                                                              for k in encoded[0]})
        return {name: values.to(store).cpu() for name, values in rows.items()}


def encode_prompts(encoders: PipelineEncoders, prompts: list[str], store: torch.dtype, path: Path) -> None:
    save_safetensors({name: values.to(store) for name, values in encoders.encode_text(prompts).items()}, path,
                     {"captions": json.dumps(prompts)})
