"""Diffusers transformer directories in and out, for every family (`SD3Transformer2DModel`,
`FluxTransformer2DModel`): config.json plus safetensors (one file, or shards with an index), and LoRA files. The
models use diffusers' parameter names, so weights map key for key; anything that does not fit is reported by name
before a single weight is copied. Which family a folder holds is models/families.py's question."""

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from errors import InputError
from models.lora import ADAPTER

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
LORA_METADATA_KEY = "lora_adapter_metadata"
ADAPTER_KEY = re.compile(rf"(.+)\.lora_([AB])\.{ADAPTER}\.weight")  # peft's names of a module's A and B


class CheckpointFormatError(InputError):
    pass


def file_mode() -> int:
    """What `open()` would give a new file (0666 less the umask): safetensors writes 0600 instead, which would
    make a shared dataset or export unreadable by colleagues."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    """Write a safetensors file whole or not at all (a temporary name, then a rename), with the usual
    permissions."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
    os.chmod(tmp, file_mode())
    os.replace(tmp, path)


def open_safetensors(path: Path):
    """`safe_open(path)`, naming a file that is not a whole safetensors file: most often a download that did not
    finish."""
    try:
        return safe_open(path, "pt")
    except Exception as e:  # safetensors reports a truncated or corrupt header without the file's name
        raise CheckpointFormatError(f"{path} is not a whole safetensors file ({e}); a download that did not finish "
                                    f"leaves one like it: download it again") from None


class WeightReader:
    """A model directory's weights (one safetensors file, or shards with their index; `stem` names them:
    diffusers' transformers use diffusion_pytorch_model, transformers' text encoders model), read one tensor,
    or one slice of a tensor, at a time from the memory-mapped files: a rank that holds rows 1000-1999 of a
    weight reads just those bytes, and no reader ever holds the whole state dict, nor more than one file mapped."""

    def __init__(self, directory: Path, stem: str = "diffusion_pytorch_model"):
        self.directory = Path(directory)
        weights, index = f"{stem}.safetensors", f"{stem}.safetensors.index.json"
        if (self.directory / weights).is_file():
            files = [weights]
        elif (self.directory / index).is_file():
            files = sorted(set(json.loads((self.directory / index).read_text())["weight_map"].values()))
            absent = [f for f in files if not (self.directory / f).is_file()]
            if absent:
                raise CheckpointFormatError(f"{self.directory / index} names shards that are missing: {absent[:5]}")
        else:
            raise CheckpointFormatError(f"{self.directory} has neither {weights} nor {index}")
        self.file_of, self.shapes = {}, {}
        for file in files:
            with open_safetensors(self.directory / file) as f:
                for key in f.keys():
                    self.file_of[key], self.shapes[key] = file, tuple(f.get_slice(key).get_shape())
        self.handles: dict[str, object] = {}
        self.bytes_read = 0

    def check(self, expected: dict[str, tuple], source) -> None:
        """The keys and shapes of the model that will be filled: every difference named, before any read."""
        check_shapes(expected, self.shapes, source)

    def read(self, key: str, offsets: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None):
        """Tensor `key`, or its block starting at `offsets` of `sizes`."""
        file = self.file_of[key]
        if file not in self.handles:
            # one file mapped at a time: the pages read of the others leave the process with their mapping, so filling
            # a model holds at most one shard of it beyond what it keeps (what was read and is still referenced keeps
            # its own mapping alive)
            self.handles.clear()
            self.handles[file] = open_safetensors(self.directory / file)
        region = self.handles[file].get_slice(key)
        if offsets is not None:
            region = region[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
        else:
            region = region[:]
        self.bytes_read += region.numel() * region.element_size()
        return region


def check_shapes(expected: dict[str, tuple], found: dict[str, tuple], source) -> None:
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    shapes = {k: (tuple(found[k]), tuple(expected[k])) for k in expected.keys() & found.keys()
              if tuple(found[k]) != tuple(expected[k])}
    if missing or unexpected or shapes:
        raise CheckpointFormatError(f"{source} does not fit the model: missing {missing[:20]}, unexpected "
                                    f"{unexpected[:20]}, shape (found, expected) {dict(list(shapes.items())[:20])}")


def check_state_dict(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], source) -> None:
    check_shapes({k: v.shape for k, v in expected.items()}, {k: v.shape for k, v in found.items()}, source)


def load_diffusers_weights(model: nn.Module, directory: Path, dtype: torch.dtype = torch.float32,
                           reader: "WeightReader | None" = None) -> None:
    """Fill `model` (which must have exactly the directory's keys and shapes) tensor by tensor (from `reader`,
    if given: one with WeightReader's calls over another layout)."""
    reader = reader or WeightReader(directory)
    state = model.state_dict()
    reader.check({k: v.shape for k, v in state.items()}, directory)
    with torch.no_grad():
        for key, tensor in state.items():
            tensor.copy_(reader.read(key).to(dtype))


def refuse_existing(directory: Path) -> None:
    """What a command writes goes into a new directory: an existing one is never overwritten."""
    if directory.exists():
        raise FileExistsError(f"{directory} exists; write into a new directory (nothing was overwritten)")


def write_new_directory(directory: Path, write) -> Path:
    """Call `write(tmp)` on a temporary sibling, then rename it to `directory`: an existing directory is
    never overwritten, and a half-written export never appears under the final name."""
    directory = Path(directory)
    refuse_existing(directory)
    blocking = next((p for p in directory.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise NotADirectoryError(f"cannot create {directory}: {blocking} is a file, not a directory")
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def cpu_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}


def export_diffusers_transformer(model: nn.Module, directory: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write a directory that diffusers' class of the model (`SD3Transformer2DModel`, `FluxTransformer2DModel`)
    loads with `from_pretrained`."""
    def write(tmp: Path) -> None:
        config = {"_class_name": model.DIFFUSERS_CLASS, "_diffusers_version": "0.30.0",
                  **dataclasses.asdict(model.cfg)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # persistent buffers are recomputed by diffusers too, but it stores them; keep the state dict whole
        save_safetensors(cpu_tensors(model.state_dict(), dtype), tmp / WEIGHTS, metadata={"format": "pt"})
    return write_new_directory(directory, write)


def diffusers_lora_state(adapter_weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """peft parameter names relative to an adapted module (`…to_q.lora_A.default.weight`) -> the names diffusers'
    `save_lora_weights` writes, under the component's prefix: the adapter name dropped. DoRA's magnitudes keep their
    `.weight` (`…lora_magnitude_vector.weight`), which peft's own files drop: peft's loader (the transformer's)
    accepts both, transformers' `load_adapter` (the text encoders', transformers 5) only this one."""
    return {f"{prefix}.{name.replace(f'.{ADAPTER}.', '.')}": w for name, w in adapter_weights.items()}


def transformers4_clip_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CLIP text model's parameter names as transformers 4 has them (`text_model.encoder.layers…`; transformers 5
    dropped CLIPTextModel's `text_model.`): diffusers loads these into either version (it strips the prefix where
    the model has none), an adapter file is the same whichever version trained it, and kohya's names
    (`lora_te1_text_model_…`) are built on them."""
    return {name if name.startswith("text_model.") else f"text_model.{name}": w for name, w in weights.items()}


def lora_scale(settings: dict) -> float:
    """The factor peft applies to B @ A: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
    return settings["lora_alpha"] / (settings["r"] ** 0.5 if settings.get("use_rslora") else settings["r"])


def header_settings(weights: dict[str, torch.Tensor], settings: dict) -> dict:
    """The LoraConfig fields a loader rebuilds the adapter from. Where some modules that lora.target_modules names
    were left out (`exclude_modules`), the targets are the adapted modules by their full names instead: diffusers'
    loader builds the adapter from the file's targets and finds exactly those, with nothing to exclude."""
    if not settings.get("exclude_modules"):
        return settings
    adapted = sorted({name.split(".lora_")[0] for name in weights})
    return {k: v for k, v in settings.items() if k != "exclude_modules"} | {"target_modules": adapted}


def transformer_adapters(adapters: dict[str, tuple[dict[str, torch.Tensor], dict]], title: str,
                         source: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The transformer's adapters and settings of a LoRA for a layout that holds those alone (ComfyUI's of
    Qwen-Image and FLUX.2), refusing what it cannot carry: other components' adapters, and DoRA, whose
    `dora_scale` keys diffusers' loaders drop (so the one file would be another model there)."""
    others = sorted(set(adapters) - {"transformer"})
    if others:
        raise InputError(f"{source}: ComfyUI's layout of a {title} LoRA holds the transformer's adapters, not "
                         f"{others}")
    weights, settings = adapters["transformer"]
    if settings.get("use_dora"):
        raise InputError(f"{source} was trained with DoRA (lora.use_dora=true), which --format kohya cannot carry: "
                         f"diffusers' {title} loader drops its dora_scale keys (with a warning) and would load "
                         f"another model; export the default --format peft, whose magnitudes diffusers loads")
    return weights, settings


def export_diffusers_lora(adapters: dict[str, tuple[dict[str, torch.Tensor], dict]], directory: Path,
                          dtype: torch.dtype = torch.float32) -> Path:
    """Write `pytorch_lora_weights.safetensors` (`peft_lora_file`) into the new `directory`, for
    `pipe.load_lora_weights(directory)`."""
    tensors, metadata = peft_lora_file(adapters)
    return write_new_directory(directory, lambda tmp: save_safetensors(
        cpu_tensors(tensors, dtype), tmp / LORA_WEIGHTS, metadata=metadata))


def peft_lora_file(adapters: dict[str, tuple[dict[str, torch.Tensor], dict]]) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and header of a LoRA file as `StableDiffusion3Pipeline.save_lora_weights` writes it, for
    `pipe.load_lora_weights(file or its folder)` (or `transformer.load_lora_adapter(directory, prefix="transformer",
    weight_name=...)`). `adapters`: pipeline component ("transformer", "text_encoder", "text_encoder_2") -> (its
    adapter weights under peft's names, their LoraConfig fields).

    The scale (alpha / rank, or alpha / sqrt(rank) with rsLoRA) is folded into lora_B and the header says
    alpha = rank without rsLoRA: diffusers has no rank-stabilised flag outside the header, and loaders that ignore
    the `lora_adapter_metadata` header (older diffusers, other tools) then apply the adapter at the strength it was
    trained with. DoRA is unchanged by the fold: its output depends on W + scale * B @ A only."""
    tensors, header = {}, {}
    for prefix, (weights, settings) in adapters.items():
        scale = lora_scale(settings)
        folded = {k: v * scale if ".lora_B." in k else v for k, v in weights.items()}
        tensors.update(diffusers_lora_state(folded, prefix))
        header.update({f"{prefix}.{k}": v for k, v in {**header_settings(weights, settings), "lora_alpha": settings["r"],
                                                       "use_rslora": False}.items()})
    return tensors, {"format": "pt", LORA_METADATA_KEY: json.dumps(header)}


def adapter_pairs(weights: dict[str, torch.Tensor], scale: float, source: str) -> dict[str, tuple]:
    """peft's adapter weights -> {module: (A, scale * B)}, for the layouts of other tools, which hold nothing else."""
    pairs: dict[str, dict] = {}
    for key, tensor in weights.items():
        match = ADAPTER_KEY.fullmatch(key)
        if match is None:
            raise InputError(f"{source}: {key} is not a LoRA A or B weight; the kohya / ComfyUI format holds nothing "
                             f"else")
        pairs.setdefault(match[1], {})[match[2]] = tensor * scale if match[2] == "B" else tensor
    lone = sorted(module for module, ab in pairs.items() if len(ab) != 2)
    if lone:
        raise InputError(f"{source}: LoRA modules without both A and B: {lone[:5]}")
    return {module: (ab["A"], ab["B"]) for module, ab in pairs.items()}


def save_named_lora_file(tensors: dict[str, torch.Tensor], directory: Path, dtype: torch.dtype,
                         metadata: dict[str, str] | None = None) -> Path:
    """Write `directory/<its name>.safetensors` (a name that tells the file apart once copied into ComfyUI's
    models/loras) into the new `directory` (`save_lora_file`). Returns the file."""
    directory = Path(directory)
    file = directory / f"{directory.name}.safetensors"
    write_new_directory(directory, lambda tmp: save_lora_file(tensors, tmp / file.name, dtype, metadata))
    return file


def save_lora_file(tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype,
                   metadata: dict[str, str] | None = None) -> None:
    """A LoRA file of another tool's layout, whole or not at all: the weights in `dtype`, the `.alpha` scalars in
    fp32 (a bf16 alpha would round some ranks above 256), `metadata` in its header."""
    alphas = {k: v for k, v in tensors.items() if k.endswith(".alpha")}
    weights = cpu_tensors({k: v for k, v in tensors.items() if k not in alphas}, dtype)
    save_safetensors({**weights, **alphas}, path, metadata={"format": "pt", **(metadata or {})})
