"""The model families the trainer knows, one record each (models/family.py; each family's folder holds its
record): SD3 / SD3.5 (`sd3`), FLUX.1 (`flux`), Qwen-Image (`qwen_image`), FLUX.2 (`flux2`). This module finds a
family and its config from what the user gives:
a diffusers transformer folder says which family it holds (config.json's `_class_name`), a pipeline folder too
(model_index.json's `_class_name`), and a single .safetensors file is a family's original checkpoint, recognised
by its keys (FLUX.1's BFL file: models/flux/bfl.py; Qwen-Image's, as ComfyUI loads it:
models/qwen_image/single_file.py; FLUX.2's BFL file: models/flux2/bfl.py).
"""

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn as nn

from models.diffusers_io import CheckpointFormatError, WeightReader, load_diffusers_weights, open_safetensors
from models.family import Family
from models.flux.family import FAMILY as FLUX
from models.flux2.family import FAMILY as FLUX2
from models.qwen_image.family import FAMILY as QWEN_IMAGE
from models.sd3.family import FAMILY as SD3

# config.json keys diffusers writes that do not change the architecture
BOOKKEEPING_KEYS = {"_class_name", "_diffusers_version", "_name_or_path"}

FAMILIES: dict[str, Family] = {f.name: f for f in (SD3, FLUX, QWEN_IMAGE, FLUX2)}
BY_CLASS = {f.diffusers_class: f for f in FAMILIES.values()}
BY_PIPELINE = {pipeline: f for f in FAMILIES.values() for pipeline in (*f.pipelines, *f.edit_pipelines)}


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


def is_single_file(path: Path) -> bool:
    return Path(path).is_file() and Path(path).suffix == ".safetensors"


def single_file_family(path: Path) -> Family:
    """The family whose original single-file layout a .safetensors file has, from its keys alone."""
    keys = set(open_safetensors(Path(path)).keys())
    readers = [f for f in FAMILIES.values() if f.single_file is not None]
    for family in readers:
        if family.single_file.recognizes(keys):
            return family
    raise CheckpointFormatError(f"{path} is not the original single-file checkpoint of a family this trainer reads ("
                                f"{'; '.join(f'{f.title}: {f.single_file.LAYOUT}' for f in readers)})")


def open_weights(path: Path):
    """The weights of a transformer folder (diffusers' layout) or of a family's original single file, read one
    block of one tensor at a time under diffusers' names (`WeightReader`'s calls)."""
    return single_file_family(path).single_file(Path(path)) if is_single_file(path) else WeightReader(Path(path))


def read_config(directory: Path) -> tuple[Family, object]:
    """The family and the config of a diffusers transformer folder (or of a family's original single file); what
    this project's modules do not implement is named."""
    if is_single_file(directory):
        family = single_file_family(directory)
        return family, family.single_file(Path(directory)).config()
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
