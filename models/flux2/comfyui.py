"""FLUX.2 LoRA files in the layout ComfyUI loads (`export_mmdit.py --format kohya`): each adapted module under its
name in Black Forest Labs' model, which is ComfyUI's FLUX.2 model, under `diffusion_model.`
(`diffusion_model.double_blocks.0.img_attn.qkv`, `diffusion_model.single_blocks.3.linear1`), holding
`.lora_A.weight` (down) and `.lora_B.weight` (up). ComfyUI maps `diffusion_model.<its weight's name>` to the
weight for every model (comfy/lora.py, `model_lora_keys_unet`) and adds up @ down to it (alpha / rank with an
`.alpha`, 1 without). diffusers' `Flux2KleinPipeline.load_lora_weights` / `Flux2Pipeline`'s convert the same file
(`_convert_non_diffusers_flux2_lora_to_diffusers`: the `diffusion_model.` names of ai-toolkit's FLUX.2 files).

The adapters are trained on diffusers' modules; BFL's model fuses three of them by rows in each double block
(`img_attn.qkv` = to_q, to_k, to_v; `txt_attn.qkv` = the add_*_proj), as models/flux/bfl.py's FLUX.1 does. The
fused adapter is FLUX.1's kohya one (models/flux/kohya.py: `fused`): lora_A the A's stacked (rank: their sum),
lora_B the B's block-diagonally, a part without an adapter a zero block; up @ down then stacks the B_i A_i exactly.
diffusers' converter gives each of q, k, v the whole stacked A and its rows of B, the same product. A single
block's fused projections are single modules in diffusers too (`attn.to_qkv_mlp_proj` -> `linear1`, `attn.to_out`
-> `linear2`).

No `.alpha` is written: the scale (alpha / rank, or / sqrt(rank) with rsLoRA) is folded into lora_B, which ComfyUI
applies at 1 without an alpha, and diffusers' converter refuses a file with alphas (it leaves them unconverted and
stops). DoRA is refused (diffusers drops `dora_scale` keys). An adapter of the final norm's modulation
(norm_out.linear, outside the default targets) is written with BFL's (shift, scale) halves, right for ComfyUI;
diffusers' converter does not swap them back, which is said.
"""

import logging

import torch

from errors import InputError
from models.diffusers_io import adapter_pairs, lora_scale, transformer_adapters
from models.flux.kohya import fused
from models.flux2.bfl import DOUBLE, FINAL, QKV, SINGLE, TOP

log = logging.getLogger("mmdit")
PREFIX = "diffusion_model."  # the transformer's place in ComfyUI's model


def bfl_modules(dim: int, double_blocks: int, single_blocks: int) -> dict[str, tuple[tuple[str, int], ...]]:
    """BFL's linear modules -> the diffusers modules each stacks by rows, with their rows (0 for a module BFL
    does not fuse)."""
    modules = {bfl: ((ours, 0),) for bfl, ours in (*TOP.items(), FINAL)}
    for i in range(double_blocks):
        bfl, ours = f"double_blocks.{i}", f"transformer_blocks.{i}"
        modules.update({f"{bfl}.{a}": ((f"{ours}.{b}", 0),) for a, b in DOUBLE.items() if "norm" not in a})
        modules.update({f"{bfl}.{a}": tuple((f"{ours}.{p}", dim) for p in parts) for a, parts in QKV.items()})
    for i in range(single_blocks):
        bfl, ours = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        modules.update({f"{bfl}.{a}": ((f"{ours}.{b}", 0),) for a, b in SINGLE.items() if "norm" not in a})
    return modules


def comfyui_lora(adapters: dict[str, tuple[dict[str, torch.Tensor], dict]], dims: tuple[int, int, int],
                 source: str) -> dict[str, torch.Tensor]:
    """The tensors of a FLUX.2 LoRA in ComfyUI's layout. `adapters`: "transformer" -> (its adapter weights under
    peft's names, their LoraConfig fields); `dims`: (hidden size, double blocks, single blocks)."""
    weights, settings = transformer_adapters(adapters, "FLUX.2", source)
    pairs = adapter_pairs(weights, lora_scale(settings), source)
    tensors = {}
    for bfl, parts in bfl_modules(*dims).items():
        if not any(name in pairs for name, _ in parts):
            continue
        down, up = fused(parts, pairs, settings["r"])
        if bfl == FINAL[0]:  # diffusers' (scale, shift) halves are BFL's (shift, scale)
            up = torch.cat(up.chunk(2)[::-1])
            log.warning("%s adapts norm_out.linear: written with BFL's (shift, scale) halves, as ComfyUI applies "
                        "them; diffusers' converter (0.42) does not swap them back: load the PEFT file in diffusers",
                        source)
        tensors.update({f"{PREFIX}{bfl}.lora_A.weight": down, f"{PREFIX}{bfl}.lora_B.weight": up})
    if pairs:
        raise InputError(f"{source}: adapted modules ComfyUI's FLUX.2 model has no name for: {sorted(pairs)[:5]}")
    return tensors


def comfyui_tensors(adapters: dict, config, source: str) -> dict[str, torch.Tensor]:
    """The family's `kohya` layout, for a transformer of `config`."""
    return comfyui_lora(adapters, (config.hidden_size, config.num_layers, config.num_single_layers), source)
