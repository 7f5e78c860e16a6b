"""SD3's text conditioning: CLIP-L, CLIP-G and (optionally) T5-XXL combined as diffusers'
`StableDiffusion3Pipeline.encode_prompt` combines them. Precompute stores what this computes; training with
data.text_encoding=on_the_fly computes it per micro-batch (frozen, without gradients, unless lora.text_encoders
adapts CLIP-L or CLIP-G: those then run with gradients for their adapters) instead of storing 2.7 MB of embeddings
per image.

- tokens [B, clip_length + max_sequence_length, joint]: the penultimate hidden states of CLIP-L and CLIP-G
  (both padded to CLIP-L's length), concatenated, zero-padded to T5's width, then T5's last hidden states (zeros
  when the pipeline has no T5, as the pipeline does);
- pooled [B, pooled]: CLIP-L's and CLIP-G's projected pooled outputs, concatenated.

The pipeline directory is diffusers' layout: text_encoder/ + tokenizer/ (CLIP-L), text_encoder_2/ +
tokenizer_2/ (CLIP-G), text_encoder_3/ + tokenizer_3/ (T5, optional). The encoders are built from their configs
(on the meta device, they allocate nothing) and filled from their safetensors files block by block (`read`), so
that under FSDP each rank reads only the rows it holds.
"""

import json
from pathlib import Path

import torch
import torch.nn as nn

from models.diffusers_io import CheckpointFormatError, WeightReader, check_shapes

PARTS = {"clip_l": ("text_encoder", "tokenizer"), "clip_g": ("text_encoder_2", "tokenizer_2"),
         "t5": ("text_encoder_3", "tokenizer_3")}
T5_WIDTH = 4096  # T5-XXL's width: the width of the zeros that stand in for T5 when the pipeline has none


def check_pipeline(folder: Path, source: str) -> None:
    """The folders the text encoders need (T5's are optional), named before anything loads."""
    if not Path(folder).is_dir():
        raise CheckpointFormatError(f"{source}={folder} " + ("is not a directory" if Path(folder).exists() else
                                    "does not exist") + "; expected an SD3 pipeline directory (diffusers' layout)")
    for encoder, tokenizer in (PARTS["clip_l"], PARTS["clip_g"]):
        for name in (encoder, tokenizer):
            if not (Path(folder) / name).is_dir():
                raise CheckpointFormatError(f"{source}={folder}: no {name}/ folder; expected an SD3 pipeline "
                                            f"directory (diffusers' layout)")


def has_t5(folder: Path) -> bool:
    return (Path(folder) / PARTS["t5"][0]).is_dir()


class SD3Tokenizers:
    """Captions -> the token ids SD3's encoders take (as the pipeline pads and truncates them). Runs in the data
    loader's workers."""

    def __init__(self, folder: Path, max_sequence_length: int):
        from transformers import AutoTokenizer

        self.folder, self.max_sequence_length = Path(folder), max_sequence_length
        self.parts = {part: AutoTokenizer.from_pretrained(self.folder / tokenizer)
                      for part, (_, tokenizer) in PARTS.items() if part != "t5" or has_t5(folder)}
        self.clip_length = self.parts["clip_l"].model_max_length  # the pipeline pads both CLIPs to CLIP-L's
        self.tokens = self.clip_length + max_sequence_length  # of the encoding the MMDiT sees

    def length(self, part: str) -> int:
        return self.max_sequence_length if part == "t5" else self.clip_length

    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        return {f"{part}_ids": tokenizer(captions, padding="max_length", max_length=self.length(part),
                                         truncation=True, return_tensors="pt").input_ids
                for part, tokenizer in self.parts.items()}

    def truncated(self, captions: list[str]) -> int:
        """How many captions are longer than some encoder's token limit (and are cut)."""
        return sum(any(len(tokenizer(c, verbose=False).input_ids) > self.length(part)
                       for part, tokenizer in self.parts.items()) for c in captions)


class SD3TextEncoders(nn.Module):
    """The frozen text encoders of an SD3 pipeline directory; `forward(**tokenizers(captions))` gives
    (tokens, pooled). Build it under `torch.device("meta")` and fill it with `read` (or `load`)."""

    def __init__(self, folder: Path, max_sequence_length: int):
        super().__init__()
        from transformers import AutoConfig, CLIPTextModelWithProjection, T5EncoderModel

        self.folder, self.max_sequence_length = Path(folder), max_sequence_length
        config = lambda part: AutoConfig.from_pretrained(self.folder / PARTS[part][0])
        self.clip_l = CLIPTextModelWithProjection(config("clip_l"))
        self.clip_g = CLIPTextModelWithProjection(config("clip_g"))
        self.t5 = T5EncoderModel(config("t5")) if has_t5(folder) else None
        self.requires_grad_(False)
        self.train()
        self.readers: dict[str, WeightReader] = {}
        transformer = self.folder / "transformer" / "config.json"
        self.joint_dim = (self.t5.config.d_model if self.t5 else
                          json.loads(transformer.read_text())["joint_attention_dim"] if transformer.is_file()
                          else T5_WIDTH)
        self.pooled_dim = self.clip_l.config.projection_dim + self.clip_g.config.projection_dim

    def train(self, mode: bool = True) -> "SD3TextEncoders":
        """Always in inference mode, whatever the model around it is switched to (T5 has dropout), except the LoRA
        layers of adapted encoders (lora.text_encoders), whose adapter dropout follows `mode`."""
        super().train(False)
        for module in self.modules():
            if hasattr(module, "lora_dropout"):  # a peft LoRA layer
                module.train(mode)
        return self

    def blocks(self) -> list[nn.Module]:
        """The layers FSDP shards one by one (the rest of each encoder is sharded with it)."""
        layers = [*self.clip_l.text_model.encoder.layers, *self.clip_g.text_model.encoder.layers]
        return layers + (list(self.t5.encoder.block) if self.t5 is not None else [])

    def encoders(self) -> list[nn.Module]:
        return [self.clip_l, self.clip_g, *([self.t5] if self.t5 is not None else [])]

    def forward(self, clip_l_ids: torch.Tensor, clip_g_ids: torch.Tensor,
                t5_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, pooled = [], []
        for encoder, ids in ((self.clip_l, clip_l_ids), (self.clip_g, clip_g_ids)):
            # a frozen encoder keeps no activations for a backward; one with trained adapters does
            adapted = any(p.requires_grad for p in encoder.parameters())
            with torch.set_grad_enabled(torch.is_grad_enabled() and adapted):
                out = encoder(ids, output_hidden_states=True)
            hidden.append(out.hidden_states[-2])  # the penultimate layer, as SD3 was trained
            pooled.append(out.text_embeds)
        clip = torch.cat(hidden, dim=-1)
        if self.t5 is None:
            t5 = clip.new_zeros(len(clip), self.max_sequence_length, self.joint_dim)
        else:
            with torch.no_grad():
                t5 = self.t5(t5_ids).last_hidden_state.to(clip.dtype)
        clip = nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat(pooled, dim=-1)

    def reader(self, part: str) -> WeightReader:
        if part not in self.readers:
            self.readers[part] = WeightReader(self.folder / PARTS[part][0], stem="model")
        return self.readers[part]

    def check(self, source: str) -> None:
        """Every weight is in the pipeline's files, in the right shape, before a byte of them is read."""
        for part in ("clip_l", "clip_g", "t5"):
            if getattr(self, part) is None:
                continue
            expected = {name.replace(".base_layer.", "."): p.shape  # LoRA's adapters are not in the files
                        for name, p in getattr(self, part).named_parameters() if ".lora_" not in name}
            found = {k: v for k, v in self.reader(part).shapes.items() if not k.endswith("position_ids")}
            tied = found.pop("encoder.embed_tokens.weight", None)  # T5's input embedding is shared.weight too
            if tied is not None:
                found.setdefault("shared.weight", tied)
            check_shapes(expected, found, f"{source} {PARTS[part][0]}/")

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The block of parameter or buffer `name` (e.g. "t5.shared.weight") at `offsets` of `sizes`, read from
        the pipeline's files."""
        part, _, key = name.replace(".base_layer.", ".").partition(".")  # a LoRA layer's frozen weight
        reader = self.reader(part)
        if key.endswith("embeddings.position_ids") and key not in reader.shapes:  # not saved by newer versions
            return torch.arange(offsets[1], offsets[1] + sizes[1]).expand(sizes)
        tied = {"shared.weight": "encoder.embed_tokens.weight", "encoder.embed_tokens.weight": "shared.weight"}
        if key in tied and key not in reader.shapes:  # T5's input embedding, tied (a copy once materialized)
            key = tied[key]
        return reader.read(key, offsets, sizes)

    def load(self, device: torch.device, dtype: torch.dtype) -> "SD3TextEncoders":
        """Allocate on `device` in `dtype` and fill from the files (for a process that holds them whole)."""
        self.to_empty(device=device)
        with torch.no_grad():
            for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
                tensor.copy_(self.read(name, (0,) * tensor.dim(), tuple(tensor.shape)))
        return self.to(dtype)
