"""The model families, one record each: SD3 / SD3.5 (`sd3`) and FLUX.1 (`flux`). What differs between them
beyond their modules (the class a diffusers folder names, the keys its config.json may hold, the LoRA targets of
diffusers' training scripts) is in this table, so the trainer, its plugins and the tools serve every family
through the same calls. Each transformer module has `cfg` (its config.json keys), `blocks` (the repeated blocks the
plugins wrap), `initial_value(name, seed)` and `DIFFUSERS_CLASS`.

A diffusers transformer folder says which family it holds (config.json's `_class_name`); a pipeline folder too
(model_index.json's `_class_name`). A single .safetensors file is FLUX.1's original (BFL) checkpoint
(models/flux/bfl.py).
"""

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from models.diffusers_io import CheckpointFormatError, WeightReader, load_diffusers_weights
from models.flux.bfl import BFLReader, is_bfl_file
from models.flux.model import Flux, FluxConfig
from models.flux.text import FluxTextEncoders, FluxTokenizers
from models.sd3.model import MMDiT, MMDiTConfig
from models.sd3.text import SD3TextEncoders, SD3Tokenizers

# config.json keys diffusers writes that do not change the architecture
BOOKKEEPING_KEYS = {"_class_name", "_diffusers_version", "_name_or_path"}


@dataclass(frozen=True)
class Family:
    name: str  # model.family
    transformer: type  # the module, built from its config
    config: type  # the config dataclass: diffusers' config.json keys
    pipeline_class: str  # model_index.json's _class_name of its pipelines
    lora_targets: tuple[str, ...]  # the modules diffusers' LoRA training script adapts, by their names in a block
    text_encoders: type  # its pipeline's frozen text encoders (models/pipeline_text.py)
    tokenizers: type  # and their tokenizers
    max_sequence_length: int  # T5 tokens its pipelines use by default
    # config.json keys of newer diffusers versions this module does not implement: accepted at these values only
    neutral_values: dict = field(default_factory=dict)

    @property
    def diffusers_class(self) -> str:
        return self.transformer.DIFFUSERS_CLASS


# diffusers' train_dreambooth_lora_sd3.py: the joint attention's projections
SD3_LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out")
# diffusers' train_dreambooth_lora_flux.py: the attention projections of both block kinds (a name matches in every
# block that has it) and the double blocks' feed-forwards. Adding "proj_mlp" adapts the single blocks' MLPs too;
# "proj_out" would also adapt the final projection, outside the blocks
FLUX_LORA_TARGETS = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                     "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                     "ff_context.net.2")

FAMILIES = {
    "sd3": Family("sd3", MMDiT, MMDiTConfig, "StableDiffusion3Pipeline", SD3_LORA_TARGETS, SD3TextEncoders,
                  SD3Tokenizers, 256, {"pos_embed_type": "sincos", "use_pos_embed": True, "context_pre_only": None,
                                       "qk_norm_eps": 1e-6}),
    # FLUX.1-dev's pipeline pads T5 to 512 tokens; schnell is used with 256 (precompute_latents.py picks by the
    # transformer's guidance embedding)
    "flux": Family("flux", Flux, FluxConfig, "FluxPipeline", FLUX_LORA_TARGETS, FluxTextEncoders, FluxTokenizers,
                   512),
}
BY_CLASS = {f.diffusers_class: f for f in FAMILIES.values()}
BY_PIPELINE = {f.pipeline_class: f for f in FAMILIES.values()}


def family_of_model(transformer: nn.Module) -> Family:
    return BY_CLASS[transformer.DIFFUSERS_CLASS]


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointFormatError(f"{path} is not readable JSON ({e}): expected {what}") from None


def family_of_pipeline(folder: Path) -> Family:
    """The family of a diffusers pipeline folder, from its model_index.json."""
    path = Path(folder) / "model_index.json"
    if not path.is_file():
        raise CheckpointFormatError(f"{folder} has no model_index.json: expected a diffusers pipeline folder "
                                    f"({' or '.join(BY_PIPELINE)})")
    name = read_json(path, "a diffusers pipeline's index").get("_class_name")
    if name not in BY_PIPELINE:
        raise CheckpointFormatError(f"{path}: _class_name is {name!r}; this trainer knows {', '.join(BY_PIPELINE)}")
    return BY_PIPELINE[name]


def open_weights(path: Path) -> WeightReader | BFLReader:
    """The weights of a transformer folder (diffusers' layout) or of FLUX.1's original single file, read one block
    of one tensor at a time under diffusers' names."""
    return BFLReader(Path(path)) if is_bfl_file(path) else WeightReader(Path(path))


def read_config(directory: Path) -> tuple[Family, MMDiTConfig | FluxConfig]:
    """The family and the config of a diffusers transformer folder (or of FLUX.1's original single file); what
    this project's modules do not implement is named."""
    if is_bfl_file(directory):
        return FAMILIES["flux"], BFLReader(Path(directory)).config()
    path = Path(directory) / "config.json"
    if not path.is_file():
        hint = " (a pipeline folder: point at its transformer/ folder)" if (Path(directory) / "model_index.json").is_file() else ""
        raise CheckpointFormatError(f"{path} does not exist: expected a diffusers transformer directory "
                                    f"({', '.join(BY_CLASS)}){hint}")
    raw = read_json(path, "a diffusers transformer's config")
    name = raw.get("_class_name")
    if name not in BY_CLASS:
        raise CheckpointFormatError(f"{path}: _class_name is {name!r}, expected one of {', '.join(BY_CLASS)} "
                                    f"(point at the pipeline's transformer/ folder)")
    family = BY_CLASS[name]
    fields = {f.name for f in dataclasses.fields(family.config)}
    unknown = {k: v for k, v in raw.items() if k not in fields and k not in BOOKKEEPING_KEYS
               and family.neutral_values.get(k, object()) != v}
    if unknown:
        raise CheckpointFormatError(f"{path}: settings this {family.name} transformer does not implement: {unknown}")
    config = family.config(**{k: v for k, v in raw.items() if k in fields})
    try:
        check_config(family, config)
    except ValueError as e:
        raise CheckpointFormatError(f"{path} is inconsistent: {e}") from None
    return family, config


def check_config(family: Family, config) -> None:
    """The module's constructor's checks, on the meta device: nothing is allocated."""
    with torch.device("meta"):
        family.transformer(dataclasses.replace(config))


def transformer_of_record(family: str, config: dict) -> nn.Module:
    """The transformer a checkpoint records (its family and config), on the current default device."""
    family = FAMILIES[family]
    return family.transformer(family.config(**config))


def load_diffusers_transformer(directory: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The transformer of a diffusers folder (any family) with its config and weights (cast to `dtype`). Public
    API, for users rather than the trainer (which builds on the meta device and fills its shards with
    `WeightReader`): a released or exported transformer folder as this repository's module, to inspect it or call
    it from one's own code."""
    family, config = read_config(directory)
    model = family.transformer(config)
    load_diffusers_weights(model, directory, dtype, open_weights(directory))
    return model
