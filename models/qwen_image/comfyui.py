"""Qwen-Image LoRA files in the layout ComfyUI loads (`export_mmdit.py --format kohya`): each adapted module under
its name in ComfyUI's model, which is diffusers' name under `diffusion_model.`
(`diffusion_model.transformer_blocks.0.attn.to_q`), holding `.lora_A.weight` (down), `.lora_B.weight` (up) and
`.alpha`. At ComfyUI a125cd84, comfy/lora.py:184 maps that name to the weight for every model,
comfy/weight_adapter/lora.py:95 and 110-113 read lora_B / lora_A as up / down, and L174-177 and 194-196 add
alpha / rank * up @ down to the weight. diffusers' QwenImagePipeline.load_lora_weights converts the same file (it
strips `diffusion_model.` and folds alpha: `_convert_non_diffusers_qwen_lora_to_diffusers`).

Not kohya's spelling (`lora_unet_transformer_blocks_0_attn_to_q` with lora_down / lora_up), which ComfyUI maps too
(comfy/lora.py:182-183): its dots are underscores, which a loader must turn back into a module path by guessing
(diffusers' converter does it with a list of Qwen-Image's module names); the dotted name needs no guess.

The scale (alpha / rank, or / sqrt(rank) with rsLoRA) is folded into lora_B and alpha is the rank: every loader's
alpha / rank is 1, and the adapter applies at the strength it was trained with. DoRA is refused: diffusers' Qwen-Image
loader drops `dora_scale` keys (with a warning), so the one file would be another model there.
"""

import torch

from models.diffusers_io import adapter_pairs, lora_scale, transformer_adapters

PREFIX = "diffusion_model."  # the transformer's place in ComfyUI's model


def comfyui_lora(adapters: dict[str, tuple[dict[str, torch.Tensor], dict]], source: str) -> dict[str, torch.Tensor]:
    """The tensors of a Qwen-Image LoRA in ComfyUI's layout. `adapters`: "transformer" -> (its adapter weights
    under peft's names, their LoraConfig fields)."""
    weights, settings = transformer_adapters(adapters, "Qwen-Image", source)
    tensors = {}
    for module, (down, up) in adapter_pairs(weights, lora_scale(settings), source).items():
        name = PREFIX + module
        tensors.update({f"{name}.lora_A.weight": down, f"{name}.lora_B.weight": up,
                        f"{name}.alpha": torch.tensor(float(down.shape[0]))})
    return tensors


def comfyui_tensors(adapters: dict, config, source: str) -> dict[str, torch.Tensor]:
    """The family's `kohya` layout (its config is not needed: the names are diffusers')."""
    return comfyui_lora(adapters, source)
