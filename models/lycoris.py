"""LoKr and LoHa adapters (lora.type, peft's LoKrConfig / LoHaConfig) as the files other tools load.

peft names a layer's factors `<module>.lokr_w1.default`, `….lokr_w2_a.default`, … (LoKr) and
`<module>.hada_w1_a.default`, … (LoHa), the names LyCORIS gave them. A loader forms the update of `module`'s weight as
    LoKr:  kron(w1, w2), w1 = lokr_w1 (or lokr_w1_a @ lokr_w1_b), w2 = lokr_w2 (or lokr_w2_a @ lokr_w2_b)
    LoHa:  (hada_w1_a @ hada_w1_b) * (hada_w2_a @ hada_w2_b)
reshaped to the weight, times a scale: peft's alpha / r. The files here fold that scale into the first factor
(lokr_w1 or lokr_w1_a; hada_w1_a) and write no `.alpha`: ComfyUI then applies 1 (it reads no alpha as 1, and for
a LoKr whose factors are both whole matrices it ignores alpha altogether), diffusers sets alpha = r.

ComfyUI (`export_mmdit.py --format kohya`, any family): `<stem>.<factor>` with the stem `transformer.<diffusers
module>`, which ComfyUI's LoRA key map (comfy/lora.py, `model_lora_keys_unet`) maps for each family: SD3 through
`mmdit_to_diffusers`, FLUX.1 and FLUX.2 through `flux_to_diffusers` (comfy/utils.py; FLUX.2's model is a FLUX.1
subclass there), Qwen-Image directly; where ComfyUI's model fuses modules (SD3's and FLUX's q, k, v; FLUX.1's
single-block linear1) these names map to the rows of the fused weight each one is, and its weight adapters (comfy/
weight_adapter/lokr.py, loha.py) patch those rows: the fused weight gets exactly the trained update, where one LoKr
of the fused weight could not hold three (a Kronecker product does not stack). Modules ComfyUI's map does not name
take the family's `comfyui_names` (FLUX.2's embedders and shared modulations: their BFL names under
`diffusion_model.`, which the map gives every weight).

diffusers (`--format peft`): `pytorch_lora_weights.safetensors` with `transformer.<module>.<factor>` and the
LoKrConfig in its `lora_adapter_metadata` header, where the family's pipeline loads LoKr (`Family.diffusers_lycoris`:
FLUX.2's `Flux2LoraLoaderMixin` as of diffusers 0.42; SD3's, FLUX.1's and Qwen-Image's loaders take LoRA only, and
no loader takes LoHa).
"""

import json
import re
from pathlib import Path

import torch

from errors import InputError
from models.diffusers_io import (LORA_METADATA_KEY, LORA_WEIGHTS, cpu_tensors, save_named_lora_file, save_safetensors,
                                 write_new_directory)
from models.lora import ADAPTER

FACTOR = re.compile(rf"(.+)\.((?:lokr|hada)_\w+)\.{ADAPTER}")  # peft's name of a LoKr or LoHa factor
FIRST = ("lokr_w1", "lokr_w1_a", "hada_w1_a")  # the factor that takes the scale (one per module)
KINDS = {"lokr": "LoKr", "loha": "LoHa"}


def adapter_kind(weights: dict[str, torch.Tensor]) -> str:
    """lora, lokr or loha: the kind of adapter these trained weights are."""
    return "lokr" if any(".lokr_" in k for k in weights) else "loha" if any(".hada_" in k for k in weights) else "lora"


def folded_factors(weights: dict[str, torch.Tensor], settings: dict, source: str) -> dict[str, dict[str, torch.Tensor]]:
    """module -> {factor: tensor}, peft's scale alpha / r folded into the module's first factor."""
    scale = settings["alpha"] / settings["r"]
    modules: dict[str, dict] = {}
    for key, tensor in weights.items():
        match = FACTOR.fullmatch(key)
        if match is None:
            raise InputError(f"{source}: {key} is not a LoKr or LoHa factor; the LyCORIS layout holds nothing else")
        modules.setdefault(match[1], {})[match[2]] = tensor * scale if match[2] in FIRST else tensor
    return modules


def comfyui_lycoris(modules: dict[str, dict[str, torch.Tensor]], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """The file's tensors in ComfyUI's layout; `names`: the family's stems other than `transformer.<module>`."""
    return {f"{names.get(module, f'transformer.{module}')}.{factor}": tensor
            for module, factors in modules.items() for factor, tensor in factors.items()}


def lycoris_tensors(family, adapters: dict[str, tuple[dict[str, torch.Tensor], dict]], lora_format: str,
                    source: str) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """A LoKr or LoHa run's transformer adapters as ComfyUI (`kohya`) or diffusers (`peft`, with the header that
    carries its adapter config) loads them; refused where diffusers does not load the kind."""
    weights, settings = adapters["transformer"]
    kind = adapter_kind(weights)
    if lora_format == "peft" and kind not in family.diffusers_lycoris:
        loaders = "only FLUX.2's pipelines load LoKr, none loads LoHa"
        raise InputError(f"{source} holds {KINDS[kind]} adapters, which diffusers' {family.pipeline_class}."
                         f"load_lora_weights does not load (diffusers 0.42: {loaders}): export --format kohya, the "
                         f"layout ComfyUI loads")
    modules = folded_factors(weights, settings, source)
    if lora_format == "kohya":
        return comfyui_lycoris(modules, family.comfyui_names), None
    tensors = {f"transformer.{module}.{factor}": t for module, factors in modules.items()
               for factor, t in factors.items()}
    header = {**{k: v for k, v in settings.items() if k != "exclude_modules"}, "alpha": settings["r"],
              "target_modules": sorted(modules)}
    return tensors, {"format": "pt", LORA_METADATA_KEY: json.dumps({f"transformer.{k}": v for k, v in header.items()})}


def export_lycoris(family, adapters: dict[str, tuple[dict[str, torch.Tensor], dict]], out: Path,
                   dtype: torch.dtype, lora_format: str, source: str, metadata: dict[str, str] | None = None) -> Path:
    """`lycoris_tensors` written to `out` (kohya: with `metadata` in its header); every check before `out` is made.
    Returns what was written."""
    tensors, header = lycoris_tensors(family, adapters, lora_format, source)
    if lora_format == "kohya":
        return save_named_lora_file(tensors, out, dtype, metadata)
    return write_new_directory(out, lambda tmp: save_safetensors(cpu_tensors(tensors, dtype), tmp / LORA_WEIGHTS,
                                                                 metadata=header))
