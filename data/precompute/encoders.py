"""A pipeline's encoders as precompute runs them: the VAE for latents, the family's text encoders for captions
(SD3: CLIP-L, CLIP-G and T5; FLUX.1: CLIP-L and T5; Qwen-Image: Qwen2.5-VL; FLUX.2: Qwen3 or Mistral-Small-3)."""

import json
import logging
from pathlib import Path

import torch

from data.precompute.images import pixels_of, to_unit_range
from data.precompute.inputs import PrecomputeError
from models.diffusers_io import save_safetensors
from models.families import Family
from models.quantized import stored_bytes
from models.vae import load_vae

log = logging.getLogger("mmdit")
QUANTIZATIONS = ("auto", "none", "int8", "nf4")
GIB = 2**30
HEADROOM = 2 * GIB  # beside the weights: the VAE's, the text encoders' activations, the allocator's slack
VAE_ACTIVATIONS = 3 * 128  # values per pixel: the VAE encoder's full-resolution activations (128 wide), ~3 alive


def text_quantization(requested: str, sizes: dict[str, int], free: int | None, room: int) -> str:
    """The storage of the text encoders' linears: `requested`, or for auto the first of none, int8, nf4 whose
    `sizes` (bytes) leave `room` bytes of the `free` device memory (a batch's encoding); none on the CPU (`free`
    None)."""
    if requested != "auto":
        return requested
    if free is None:
        return "none"
    fits = [scheme for scheme in ("none", "int8", "nf4") if sizes[scheme] + room <= free]
    if not fits:
        raise PrecomputeError(f"the text encoders need {sizes['nf4'] / GIB:.1f} GiB even in nf4, beside "
                              f"{room / GIB:.1f} GiB to encode a batch, and {free / GIB:.1f} GiB is free on the "
                              f"fullest GPU: precompute on a larger GPU, with a smaller --batch-size, on the CPU "
                              f"(--device cpu), or without them (--text-embeddings none: training encodes the captions)")
    return fits[0]


def text_storage(model_dir: Path, family: Family, max_sequence_length: int, device: torch.device,
                 dtype: torch.dtype, requested: str, share, batch_pixels: int) -> tuple[torch.dtype, str]:
    """The text encoders' dtype (their own on a GPU where they have one) and the storage of their linears
    (--text-encoder-quantization; auto: quantized only where they do not fit the free memory of every rank's GPU,
    `share` giving every rank's, beside the VAE's encoding of `batch_pixels` pixels), said in the log."""
    with torch.device("meta"):
        text = family.text_encoders(model_dir, max_sequence_length)
    if device.type == "cuda" and text.GPU_DTYPE is not None:
        dtype = text.GPU_DTYPE
    sizes = {scheme: stored_bytes(text, scheme, dtype) for scheme in QUANTIZATIONS[1:]}
    free = min(share(torch.cuda.mem_get_info(device)[0])) if device.type == "cuda" else None
    chosen = text_quantization(requested, sizes, free, HEADROOM + VAE_ACTIVATIONS * batch_pixels * dtype.itemsize)
    room = "" if free is None else f"; {free / GIB:.1f} GiB free on the fullest GPU"
    log.info("text encoders in %s, their linears %s: %.1f GiB (unquantized %.1f GiB%s)",
             str(dtype).removeprefix("torch."), "unquantized" if chosen == "none" else f"in {chosen}",
             sizes[chosen] / GIB, sizes["none"] / GIB, room)
    return dtype, chosen


class PipelineEncoders:
    """The VAE of a pipeline directory of `family` in `dtype`, and its text encoders in `text` (their dtype and
    their linears' quantization: `text_storage`) unless text embeddings are not stored (`text` None)."""

    def __init__(self, model_dir: Path, family: Family, device: torch.device, dtype: torch.dtype,
                 max_sequence_length: int, text: tuple[torch.dtype, str] | None, resolution: int = 1024,
                 multiple: int = 16, references: int = 0):
        self.device, self.family = device, family
        self.resolution, self.multiple = resolution, multiple  # of reference images
        self.vae = load_vae(model_dir / "vae", device, dtype)
        # an edit pipeline's instruction encoder that sees the references (Qwen-Image-Edit) encodes every text
        # (in the text encoders' dtype; unquantized: it is the whole Qwen2.5-VL, loaded by transformers)
        self.edit_text = family.edit_text(model_dir, max_sequence_length, device, text[0]) \
            if references and text is not None and family.edit_text else None
        self.tokenizers = family.tokenizers(model_dir, max_sequence_length)
        with torch.device("meta"):
            self.text = family.text_encoders(model_dir, max_sequence_length)
        self.text_dims, self.text_mask = (self.text.joint_dim, self.text.pooled_dim), self.text.MASKED
        if text is not None and self.edit_text is None:
            self.text.check("--model")
            self.text.load(device, *text)
        elif text is None:
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

    def encode(self, pixels: torch.Tensor, variants: list[list[str]], flip: bool, store: torch.dtype,
               references: list[tuple] = ()) -> dict:
        """A batch's stored fields, in the storage dtype, on the host. `variants`: the batch's captions as encoded,
        one list per variant; several are stacked as dimension 1 of each text field (data/latents.py).
        `references`: each sample's `reference`s."""
        rows = {"latents": self.vae.encode(to_unit_range(pixels))}
        if flip:
            rows["latents_flipped"] = self.vae.encode(to_unit_range(pixels.flip(-1)))
        for i, images in enumerate(zip(*references)):  # reference i of every sample: one size in a bucket
            rows[f"reference_latents_{i}"] = self.vae.encode(to_unit_range(torch.stack([p for p, _ in images])))
        if self.text is not None:
            encoded = [self.encode_text(list(captions), references) for captions in variants]
            rows.update(encoded[0] if len(encoded) == 1 else {k: torch.stack([e[k] for e in encoded], 1)
                                                              for k in encoded[0]})
        return {name: values.cpu() for name, values in stored(rows, store).items()}


def stored(rows: dict[str, torch.Tensor], store: torch.dtype) -> dict[str, torch.Tensor]:
    """`rows` in the storage dtype, each value finite: a language model's hidden states before its final norm (FLUX.2's)
    can outgrow fp16, and an overflow would be stored as inf and trained on."""
    rows = {name: values.to(store) for name, values in rows.items()}
    for name, values in rows.items():
        if values.is_floating_point() and not torch.isfinite(values).all():
            raise FloatingPointError(f"{name}: values beyond the range of {store} (or not finite as computed); "
                                     f"precompute again with --dtype bf16 (into a new --out)")
    return rows


def encode_prompts(encoders: PipelineEncoders, prompts: list[str], store: torch.dtype, path: Path) -> None:
    save_safetensors(stored(encoders.encode_text(prompts), store), path, {"captions": json.dumps(prompts)})
