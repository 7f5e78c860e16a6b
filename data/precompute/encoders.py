"""A pipeline's encoders as precompute runs them: the VAE for latents, the family's text encoders for captions
(SD3: CLIP-L, CLIP-G and T5; FLUX.1: CLIP-L and T5; Qwen-Image: Qwen2.5-VL; FLUX.2: Qwen3 or Mistral-Small-3)."""

import json
import logging
from pathlib import Path

import torch

from data.precompute.images import pixels_of, to_unit_range
from models.diffusers_io import save_safetensors
from models.families import Family
from models.vae import load_vae

log = logging.getLogger("mmdit")


class PipelineEncoders:
    """The VAE of a pipeline directory of `family`, and its text encoders unless text embeddings are not
    stored."""

    def __init__(self, model_dir: Path, family: Family, device: torch.device, dtype: torch.dtype,
                 max_sequence_length: int, text_embeddings: bool, resolution: int = 1024, multiple: int = 16,
                 references: int = 0):
        self.device, self.family = device, family
        self.resolution, self.multiple = resolution, multiple  # of reference images
        self.vae = load_vae(model_dir / "vae", device, dtype)
        # an edit pipeline's instruction encoder that sees the references (Qwen-Image-Edit) encodes every text
        self.edit_text = family.edit_text(model_dir, max_sequence_length, device, dtype) \
            if references and text_embeddings and family.edit_text else None
        self.tokenizers = family.tokenizers(model_dir, max_sequence_length)
        with torch.device("meta"):
            self.text = family.text_encoders(model_dir, max_sequence_length)
        self.text_dims, self.text_mask = (self.text.joint_dim, self.text.pooled_dim), self.text.MASKED
        if text_embeddings and self.edit_text is None:
            self.text.check("--model")
            self.text.load(device, dtype)
        elif not text_embeddings:
            self.text = None
        self.truncated = 0

    def reference(self, image) -> tuple[torch.Tensor, object]:
        """An edit's reference image (PIL) -> (its pixels as the family's edit pipeline sizes them for its VAE, what
        its instruction encoder sees of it: None where the instruction is encoded alone)."""
        pixels = pixels_of(self.family.reference_image(image, self.resolution, self.multiple))
        return pixels, self.edit_text.condition_image(image) if self.edit_text else None

    @torch.no_grad()
    def encode_text(self, captions: list[str], references: list[tuple] = ()) -> dict[str, torch.Tensor]:
        """The captions' embeddings; an edit pipeline's instruction encoder sees each sample's references (none: the
        prompts of caption dropout and validation's unconditional input, the edit template without pictures)."""
        if self.edit_text is not None:
            rows = [self.edit_text(caption, [condition for _, condition in refs])
                    for caption, refs in zip(captions, references or [()] * len(captions))]
            return {name: torch.stack([row[name] for row in rows]) for name in rows[0]}
        self.truncated += self.tokenizers.truncated(captions)
        return self.text(**{k: v.to(self.device) for k, v in self.tokenizers(captions).items()})

    def encode(self, pixels: torch.Tensor, captions: list[str], flip: bool, store: torch.dtype,
               references: list[tuple] = ()) -> dict:
        """A batch's stored fields, in the storage dtype, on the host; `references`: each sample's `reference`s."""
        rows = {"latents": self.vae.encode(to_unit_range(pixels))}
        if flip:
            rows["latents_flipped"] = self.vae.encode(to_unit_range(pixels.flip(-1)))
        for i, images in enumerate(zip(*references)):  # reference i of every sample: one size in a bucket
            rows[f"reference_latents_{i}"] = self.vae.encode(to_unit_range(torch.stack([p for p, _ in images])))
        if self.text is not None:
            rows.update(self.encode_text(captions, references))
        return {name: values.to(store).cpu() for name, values in rows.items()}


def encode_prompts(encoders: PipelineEncoders, prompts: list[str], store: torch.dtype, path: Path) -> None:
    save_safetensors({name: values.to(store) for name, values in encoders.encode_text(prompts).items()}, path,
                     {"captions": json.dumps(prompts)})
