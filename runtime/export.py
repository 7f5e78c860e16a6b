"""A trained checkpoint as the files users load: the transformer as a diffusers folder, a LoRA in diffusers' or
ComfyUI's (kohya) layout with kohya's metadata (`export`, run by export_mmdit.py), and the LoRA files a LoRA run
writes beside each complete checkpoint (`CheckpointLoras`, run by training's checkpointer)."""

import json
import logging
import math
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from configs.run_dir import global_batch
from configs.schema import load_config
from errors import InputError
from models.diffusers_io import (CheckpointFormatError, check_state_dict, cpu_tensors, export_diffusers_lora,
                                 export_diffusers_transformer, peft_lora_file, save_lora_file, save_named_lora_file,
                                 save_safetensors, transformers4_clip_names)
from models.families import FAMILIES, transformer_of_record
from models.family import Family
from models.lycoris import adapter_kind, export_lycoris, lycoris_tensors
from perf.checkpoint import read_checkpoint, step_of
from runtime.outputs import Output

log = logging.getLogger("mmdit")
PREFIX = "transformer."  # the MMDiT's place in the trained TextToImage module
FORMATS = ("peft", "kohya")
LORAS = "loras"  # in a LoRA run's directory: the files of each checkpoint (`CheckpointLoras`)


def export(checkpoint: Path, out: Path, use_ema: bool = True, dtype: torch.dtype = torch.float32,
           lora_format: str = "peft") -> Path:
    """Write the export of `checkpoint` to `out`; returns what was written (the directory, or the kohya file)."""
    family, meta, weights = read_trained(checkpoint, use_ema)
    transformer = part(weights, PREFIX)
    if meta["lora"] and adapter_kind(transformer) != "lora":  # LoKr, LoHa: every family, both formats
        return export_lycoris(family, {"transformer": (transformer, meta["lora"])}, out, dtype, lora_format,
                              str(checkpoint), kohya_metadata(run_config(checkpoint), meta, family))
    if lora_format == "kohya" and (family.kohya is None or not meta["lora"]):
        what = "a full fine-tune (no adapters)" if family.kohya else f"of model.family={family.name}"
        titles = [f.title for f in FAMILIES.values() if f.kohya]
        kinds = " or ".join(titles) if len(titles) < 3 else f"{', '.join(titles[:-1])} or {titles[-1]}"
        raise InputError(f"--format kohya writes a {kinds} LoRA, and {checkpoint} is {what}: export it in the "
                         f"default format (--format peft)")
    if meta["lora"]:
        adapters = lora_adapters(family, meta, weights)
        if lora_format == "peft":
            return export_diffusers_lora(adapters, out, dtype)
        return save_named_lora_file(family.kohya(adapters, family.config(**meta["mmdit"]), str(checkpoint)), out,
                                    dtype, kohya_metadata(run_config(checkpoint), meta, family))
    model = transformer_of_record(family.name, meta["mmdit"])
    check_state_dict(model.state_dict(), transformer, checkpoint)
    model.load_state_dict(transformer)
    if family.packing:
        packing = run_config(checkpoint).model.patch_size
        if packing != family.packing:
            log.warning("%s packs %dx%d latents into a token (model.patch_size=%d): %s loads it, %s (which packs "
                        "%dx%d) cannot drive it", checkpoint, packing, packing, packing, family.diffusers_class,
                        family.pipeline_class, family.packing, family.packing)
    return export_diffusers_transformer(model, out, dtype)


def read_trained(checkpoint: Path, use_ema: bool = True) -> tuple[Family, dict, dict[str, torch.Tensor]]:
    """The family and state.json of `checkpoint`, and its weights: the EMA (which covers the trained parameters)
    over the model's, or the model's alone."""
    tensors, meta = read_checkpoint(checkpoint)
    if "mmdit" not in meta:
        raise CheckpointFormatError(f"{checkpoint} predates export support (no 'mmdit' in state.json); "
                                    f"resume it for one step to write a new checkpoint")
    return FAMILIES[meta.get("family", "sd3")], meta, {**tensors["model"], **(tensors["ema"] if use_ema else {})}


def part(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}


def lora_adapters(family: Family, meta: dict, weights: dict[str, torch.Tensor]) -> dict[str, tuple[dict, dict]]:
    """Pipeline component ("transformer", "text_encoder", ...) -> (its adapter weights, their LoraConfig fields)."""
    adapters = {"transformer": (part(weights, PREFIX), meta["lora"])}
    for encoder, settings in meta.get("text_encoder_lora", {}).items():  # lora.text_encoders
        clip = transformers4_clip_names(part(weights, f"text_encoder.{encoder}."))
        adapters[family.text_encoders.PARTS[encoder][0]] = (clip, settings)
    return adapters


def trigger_words(cfg: DictConfig) -> str:
    """The words every caption of the run began with (data.caption_prefix), or ""."""
    return OmegaConf.select(cfg, "data.caption_prefix", default=None) or ""


def run_config(checkpoint: Path) -> DictConfig:
    return load_config(checkpoint / "config.yaml", resolve=False)  # as the run resolved it


def kohya_metadata(cfg: DictConfig, meta: dict, family: Family) -> dict[str, str]:
    """The header keys of a kohya / ComfyUI LoRA file that ComfyUI's LoRA browsers and model sites read: kohya's
    `ss_*` (sd-scripts' train_network.py names) for the base model, the network module, the rank and alpha as the
    file holds them (the scale is folded into the up weights: alpha = rank), the steps, the epoch of the last step,
    the precompute resolution, the training images, and the trigger words, which every caption carries (its one tag
    in `ss_tag_frequency`, and the SAI model spec's `modelspec.trigger_phrase`). `cfg`, `meta`: the checkpoint's
    config and state.json. A LoKr or LoHa file names LyCORIS's network module and its algorithm, as LyCORIS writes
    them."""
    base, module = family.kohya_names or (family.name, None)
    kind = OmegaConf.select(cfg, "lora.type", default="lora")
    if kind != "lora":
        module = "lycoris.kohya"
    rank, step, data = meta["lora"]["r"], meta["step"], meta.get("data", {})
    init = Path(cfg.model.init_from)
    found = {"ss_base_model_version": base, "ss_network_module": module, "ss_network_dim": str(rank),
             "ss_network_alpha": str(float(rank)), "ss_steps": str(step),
             "ss_output_name": Path(cfg.logging.output_dir).name,
             "ss_sd_model_name": init.parent.name if init.name == "transformer" else init.name,
             **({"ss_network_args": json.dumps({"algo": kind})} if kind != "lora" else {})}
    items, resolution = data.get("items"), data.get("resolution")
    if items:
        found |= {"ss_num_train_images": str(items),
                  "ss_epoch": str(math.ceil(step * global_batch(cfg, meta["world_size"]) / items))}
    if resolution:
        found["ss_resolution"] = f"({resolution}, {resolution})"
    words = trigger_words(cfg)
    if words:
        dataset = Path(cfg.data.path).name if cfg.data.path else "data"
        found |= {"modelspec.trigger_phrase": words, "ss_tag_frequency": json.dumps({dataset: {words: items or 1}})}
    return found


class CheckpointLoras:
    """The files a user loads, beside each complete checkpoint of a LoRA run (the `Checkpointer`'s companion, on
    rank 0): `loras/step_XXXXXXXX.safetensors` in diffusers' format (`pipe.load_lora_weights(FILE)`) and, for a
    family with a kohya / ComfyUI layout (not for DoRA, which it cannot carry), `loras/step_XXXXXXXX_kohya.safetensors`
    with kohya's metadata: what `export_mmdit.py` writes by default (the EMA weights, fp32), read back from the
    checkpoint once it is complete (all ranks' shards, whatever the sharding). A LoKr or LoHa run: the ComfyUI
    layout's file for every family, the diffusers file where its pipeline loads the kind. A disk that cannot take
    them is a warning: the checkpoint is complete without them."""

    def __init__(self, run_dir: Path, cfg: DictConfig):
        family = FAMILIES[cfg.model.family]
        self.folder = Path(run_dir) / LORAS
        self.lycoris = cfg.lora.type != "lora"  # LoKr, LoHa: ComfyUI's layout always, diffusers' where it loads
        self.diffusers = not self.lycoris or cfg.lora.type in family.diffusers_lycoris
        self.kohya = self.lycoris or (family.kohya is not None and not cfg.lora.use_dora)
        self.output = Output("LoRA file", "the checkpoint is complete without it; the next one is tried again")

    def files(self, step: int) -> list[Path]:
        name = f"step_{step:08d}"
        return [*([self.folder / f"{name}.safetensors"] if self.diffusers else []),
                *([self.folder / f"{name}_kohya.safetensors"] if self.kohya else [])]

    def write(self, checkpoint: Path) -> None:
        files = self.files(step_of(checkpoint))
        self.output.write(files[0], self.write_files, checkpoint, files, partial=tuple(files))

    def write_files(self, checkpoint: Path, files: list[Path]) -> None:
        family, meta, weights = read_trained(checkpoint)
        metadata = kohya_metadata(run_config(checkpoint), meta, family) if self.kohya else None
        self.folder.mkdir(exist_ok=True)
        if self.lycoris:
            adapters = {"transformer": (part(weights, PREFIX), meta["lora"])}
            for file, lora_format in zip(files, [*(["peft"] if self.diffusers else []), "kohya"]):
                tensors, header = lycoris_tensors(family, adapters, lora_format, str(checkpoint))
                save_lora_file(tensors, file, torch.float32, header or metadata)
            return
        adapters = lora_adapters(family, meta, weights)
        tensors, header = peft_lora_file(adapters)
        save_safetensors(cpu_tensors(tensors, torch.float32), files[0], header)
        if self.kohya:
            tensors = family.kohya(adapters, family.config(**meta["mmdit"]), str(checkpoint))
            save_lora_file(tensors, files[1], torch.float32, metadata)

    def ensure(self, checkpoint: Path) -> None:
        """Write the files of `checkpoint` if they are missing (a run killed between the two)."""
        if not all(f.is_file() for f in self.files(step_of(checkpoint))):
            self.write(checkpoint)

    def remove(self, step: int) -> None:
        for file in self.files(step):
            file.unlink(missing_ok=True)
