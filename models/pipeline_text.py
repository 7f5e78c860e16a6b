"""A diffusers pipeline's frozen text encoders (transformers' CLIP and T5 models) and their tokenizers, as every
family uses them: built from their configs (on the meta device they allocate nothing), filled from their
safetensors files block by block (`read`: under FSDP each rank reads only the rows it holds), always in inference
mode, sharded layer by layer. A family says which encoders its pipeline has and how it combines their outputs
(models/sd3/text.py, models/flux/text.py); precompute stores what `forward` computes, and training with
data.text_encoding=on_the_fly computes it per micro-batch instead of storing megabytes of embeddings per image.
"""

from pathlib import Path

import torch
import torch.nn as nn

from models.diffusers_io import CheckpointFormatError, WeightReader, check_shapes
from models.quantized import QuantizedLinear, QuantizingReader, quantize_linears


class PipelineTokenizers:
    """Captions -> the token ids a pipeline's encoders take, padded and truncated as the pipeline does: CLIP to its
    own length, T5 to `max_sequence_length`. Runs in the data loader's workers. `PARTS`: part -> (encoder folder,
    tokenizer folder), as in the family's text encoders."""

    PARTS: dict[str, tuple[str, str]] = {}
    OPTIONAL: tuple[str, ...] = ()

    def __init__(self, folder: Path, max_sequence_length: int):
        from transformers import AutoTokenizer

        self.folder, self.max_sequence_length = Path(folder), max_sequence_length
        self.parts = {part: AutoTokenizer.from_pretrained(self.folder / tokenizer)
                      for part, (encoder, tokenizer) in self.PARTS.items() if (self.folder / encoder).is_dir()}

    def length(self, part: str) -> int:
        """The tokens a part's encoder is given: T5 max_sequence_length, a CLIP its own limit."""
        return self.max_sequence_length if part == "t5" else self.parts[part].model_max_length

    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        return {f"{part}_ids": tokenizer(captions, padding="max_length", max_length=self.length(part),
                                         truncation=True, return_tensors="pt").input_ids
                for part, tokenizer in self.parts.items()}

    def truncated(self, captions: list[str]) -> int:
        """How many captions are longer than some encoder's token limit (and are cut)."""
        return sum(any(len(tokenizer(c, verbose=False).input_ids) > self.length(part)
                       for part, tokenizer in self.parts.items()) for c in captions)


class PipelineTextEncoders(nn.Module):
    """The frozen text encoders of a pipeline folder, one submodule per part; `forward(**tokenizers(captions))`
    gives the embeddings by a latent dataset's names (`prompt_embeds` [B, L, joint_dim], and the family's others:
    `pooled_prompt_embeds` [B, pooled_dim], or the padding mask `prompt_embeds_mask` [B, L]). Build it under `torch.device("meta")` and fill it
    with `read` (or `load`). `PARTS` names each part's encoder and tokenizer folders; `OPTIONAL` the parts a
    pipeline may lack; `build(part, config)` makes a part's module."""

    PARTS: dict[str, tuple[str, str]] = {}
    OPTIONAL: tuple[str, ...] = ()
    NAME = ""  # the family, in error messages
    MASKED = False  # its text is padded, with a `prompt_embeds_mask` (Qwen-Image)
    pooled_dim = 0  # the width of `pooled_prompt_embeds`, for the families that have them
    GPU_DTYPE: torch.dtype | None = None  # the dtype they run in on a GPU, where not the caller's (language models: bf16)

    def __init__(self, folder: Path, max_sequence_length: int):
        super().__init__()
        from transformers import AutoConfig

        self.folder, self.max_sequence_length = Path(folder), max_sequence_length
        for part, (encoder, _) in self.PARTS.items():
            present = (self.folder / encoder).is_dir()
            setattr(self, part, self.build(part, AutoConfig.from_pretrained(self.folder / encoder)) if present else None)
        self.requires_grad_(False)
        self.train()
        self.readers: dict[str, WeightReader] = {}
        self.quantized = QuantizingReader(self.read)

    @classmethod
    def check_pipeline(cls, folder: Path, source: str) -> None:
        """The folders the encoders need, named before anything loads."""
        if not Path(folder).is_dir():
            raise CheckpointFormatError(f"{source}={folder} " + ("is not a directory" if Path(folder).exists() else
                                        "does not exist") + f"; expected a {cls.NAME} pipeline directory (diffusers' "
                                        f"layout)")
        for part, folders in cls.PARTS.items():
            for name in folders if part not in cls.OPTIONAL else ():
                if not (Path(folder) / name).is_dir():
                    raise CheckpointFormatError(f"{source}={folder}: no {name}/ folder; expected a {cls.NAME} "
                                                f"pipeline directory (diffusers' layout)")

    def build(self, part: str, config) -> nn.Module:
        raise NotImplementedError

    def present(self) -> list[str]:
        return [part for part in self.PARTS if getattr(self, part) is not None]

    def train(self, mode: bool = True) -> "PipelineTextEncoders":
        """Always in inference mode, whatever the model around it is switched to (T5 has dropout), except the LoRA
        layers of adapted encoders (lora.text_encoders), whose adapter dropout follows `mode`."""
        super().train(False)
        for module in self.modules():
            if hasattr(module, "lora_dropout"):  # a peft LoRA layer
                module.train(mode)
        return self

    def encoders(self) -> list[nn.Module]:
        return [getattr(self, part) for part in self.present()]

    def blocks(self) -> list[nn.Module]:
        """The layers FSDP shards one by one (the rest of each encoder is sharded with it)."""
        layers = []
        for encoder in self.encoders():
            if hasattr(encoder, "shared"):  # T5
                layers += list(encoder.encoder.block)
            else:  # CLIP: CLIPTextModelWithProjection wraps a text_model, CLIPTextModel (transformers 5) is one
                layers += list(getattr(encoder, "text_model", encoder).encoder.layers)
        return layers

    def run(self, encoder: nn.Module, ids: torch.Tensor, **kwargs):
        """A CLIP's forward: without a graph for its backward unless it has trained adapters."""
        adapted = any(p.requires_grad for p in encoder.parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and adapted):
            return encoder(ids, **kwargs)

    def reader(self, part: str) -> WeightReader:
        if part not in self.readers:
            self.readers[part] = WeightReader(self.folder / self.PARTS[part][0], stem="model")
        return self.readers[part]

    def file_key(self, part: str, name: str) -> str:
        """The key under which a part's files hold its parameter `name` (its own name, unless the family's
        files name it otherwise)."""
        return name

    def check(self, source: str) -> None:
        """Every weight is in the pipeline's files, in the right shape, before a byte of them is read (the files
        may hold more: a language model's output head, say)."""
        for part in self.present():
            expected = {self.file_key(part, name.replace(".base_layer.", ".")): p.shape  # LoRA's are not in the files
                        for name, p in getattr(self, part).named_parameters() if ".lora_" not in name}
            found = dict(self.reader(part).shapes)
            tied = found.pop("encoder.embed_tokens.weight", None)  # T5's input embedding is shared.weight too
            if tied is not None:
                found.setdefault("shared.weight", tied)
            check_shapes(expected, {k: v for k, v in found.items() if k in expected}, f"{source} {self.PARTS[part][0]}/")

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The block of parameter or buffer `name` (e.g. "t5.shared.weight") at `offsets` of `sizes`, read from
        the pipeline's files (a quantized layer's codes and scales: from its weight's rows); a language model's rotary
        frequencies, which no file holds, computed from its config (by the rotary module rebuilt on the CPU)."""
        module_name, _, buffer = name.rpartition(".")
        layer = self.get_submodule(module_name)
        if isinstance(layer, QuantizedLinear) and buffer in ("codes", "scales"):
            return self.quantized(f"{module_name}.weight", layer, buffer, offsets, sizes)
        if buffer in ("inv_freq", "original_inv_freq"):
            module = self.get_submodule(module_name)
            with torch.device("cpu"):
                values = getattr(type(module)(module.config), buffer)
            return values[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
        part, _, key = name.replace(".base_layer.", ".").partition(".")  # a LoRA layer's frozen weight
        reader, key = self.reader(part), self.file_key(part, key)
        if key.endswith("embeddings.position_ids") and key not in reader.shapes:  # not saved by newer versions
            return torch.arange(offsets[1], offsets[1] + sizes[1]).expand(sizes)
        tied = {"shared.weight": "encoder.embed_tokens.weight", "encoder.embed_tokens.weight": "shared.weight"}
        if key in tied and key not in reader.shapes:  # T5's input embedding, tied: saved once
            key = tied[key]
        return reader.read(key, offsets, sizes)

    def load(self, device: torch.device, dtype: torch.dtype, quantization: str = "none") -> "PipelineTextEncoders":
        """Allocate on `device` in `dtype` and fill from the files (for a process that holds them whole); with
        `quantization` (nf4, int8) their linears are stored so (models/quantized.py), each filled from its
        weight's rows: the encoders are never whole in a float dtype."""
        if quantization != "none":
            quantize_linears(self, quantization)
        holders: dict[int, list[tuple[nn.Module, str]]] = {}  # tied parameters (T5's input embedding)
        for module in self.modules():
            for attr, parameter in module._parameters.items():
                if parameter is not None:
                    holders.setdefault(id(parameter), []).append((module, attr))
        self.to_empty(device=device)
        for (first, attr), *others in holders.values():  # to_empty gives each holder its own copy: tie them again
            for module, other in others:
                module._parameters[other] = first._parameters[attr]
        with torch.no_grad():
            for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
                tensor.copy_(self.read(name, (0,) * tensor.dim(), tuple(tensor.shape)))
        for module in self.modules():  # the floating tensors in `dtype`, but quantized layers' scales (bf16)
            for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is not None and tensor.is_floating_point() and not (isinstance(module, QuantizedLinear)
                                                                               and name == "scales"):
                    tensor.data = tensor.data.to(dtype)
        return self
