"""FLUX.1 LoRA files in the kohya / ComfyUI layout, the names of kohya's sd-scripts (`networks/lora_flux.py`), which
ComfyUI and Forge load and diffusers converts (`FluxPipeline.load_lora_weights`): a module is named by its place in
BFL's original model with dots as underscores (`lora_unet_double_blocks_0_img_attn_qkv`, CLIP-L's
`lora_te1_text_model_encoder_layers_0_self_attn_q_proj`), and holds `.lora_down.weight` (A), `.lora_up.weight` (B)
and `.alpha`; a loader adds alpha / rank * up @ down to the module's weight.

The adapters are trained on diffusers' modules, some of which BFL's model fuses (models/flux/bfl.py): a double
block's img_attn.qkv stacks to_q, to_k and to_v by rows (txt_attn.qkv the add_*_proj), a single block's linear1
stacks to_q, to_k, to_v and proj_mlp. The fused adapter that equals the separate ones exactly has lora_down = the
A's stacked (rank: their sum) and lora_up = the B's block-diagonally, so that up @ down stacks the B_i A_i. A
part that was not adapted is a zero block of the same rank: every part has one rank, and diffusers' converter,
which recognises this block-diagonal form, splits it back into exactly the A and B of each module. The scale
(alpha / rank, or / sqrt(rank) with rsLoRA) is folded into lora_up and alpha is the module's rank: every loader's
alpha / rank is then 1. DoRA cannot be carried (diffusers drops kohya files' `dora_scale` keys).
"""

import torch

from errors import InputError
from models.diffusers_io import adapter_pairs, lora_scale
from models.flux.bfl import DOUBLE, EMBEDDERS, SINGLE

UNET, CLIP_L = "lora_unet_", "lora_te1_"  # sd-scripts' prefixes of the transformer's and CLIP-L's modules
COMPONENTS = ("transformer", "text_encoder")  # the pipeline components (FluxPipeline's) a file can hold


def bfl_modules(dim: int, double_blocks: int, single_blocks: int) -> dict[str, tuple[tuple[str, int], ...]]:
    """BFL's linear modules -> the diffusers modules each stacks by rows, with their rows (a single part for a
    module BFL does not fuse: its rows are not needed)."""
    modules = {"img_in": (("x_embedder", 0),), "txt_in": (("context_embedder", 0),),
               "final_layer.linear": (("proj_out", 0),), "final_layer.adaLN_modulation.1": (("norm_out.linear", 0),)}
    for bfl, ours in EMBEDDERS.items():
        modules.update({f"{bfl}.in_layer": ((f"{ours}.linear_1", 0),), f"{bfl}.out_layer": ((f"{ours}.linear_2", 0),)})
    for i in range(double_blocks):
        bfl, ours = f"double_blocks.{i}", f"transformer_blocks.{i}"
        modules.update({f"{bfl}.{a}": ((f"{ours}.{b}", 0),) for a, b in DOUBLE.items()})
        modules[f"{bfl}.img_attn.qkv"] = tuple((f"{ours}.attn.to_{p}", dim) for p in "qkv")
        modules[f"{bfl}.txt_attn.qkv"] = tuple((f"{ours}.attn.add_{p}_proj", dim) for p in "qkv")
    for i in range(single_blocks):
        bfl, ours = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        modules.update({f"{bfl}.{a}": ((f"{ours}.{b}", 0),) for a, b in SINGLE.items()})
        modules[f"{bfl}.linear1"] = (*((f"{ours}.attn.to_{p}", dim) for p in "qkv"), (f"{ours}.proj_mlp", 4 * dim))
    return modules


def fused(parts: tuple[tuple[str, int], ...], pairs: dict[str, tuple], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(down, up) of a module that stacks `parts` by rows: the A's stacked, the B's block-diagonally; a part that
    has no adapter is a zero block of `rank`."""
    adapted = [pairs[name] for name, _ in parts if name in pairs]
    columns, like = adapted[0][0].shape[1], adapted[0][0]
    downs, ups = [], []
    for name, rows in parts:
        a, b = pairs.pop(name, (like.new_zeros(rank, columns), like.new_zeros(rows, rank)))
        downs.append(a)
        ups.append(b)
    return torch.cat(downs), torch.block_diag(*ups)


def transformer_state(pairs: dict[str, tuple], rank: int, dims: tuple[int, int, int], source: str) -> dict:
    pairs = dict(pairs)
    state = {}
    for bfl, parts in bfl_modules(*dims).items():
        if not any(name in pairs for name, _ in parts):
            continue
        down, up = fused(parts, pairs, rank)
        if bfl == "final_layer.adaLN_modulation.1":  # diffusers' (scale, shift) halves are BFL's (shift, scale)
            up = torch.cat(up.chunk(2)[::-1])
        state[UNET + bfl.replace(".", "_")] = (down, up)
    if pairs:
        raise InputError(f"{source}: adapted modules the kohya layout has no name for: {sorted(pairs)[:5]}")
    return state


def kohya_lora(adapters: dict[str, tuple[dict[str, torch.Tensor], dict]], dims: tuple[int, int, int],
               source: str) -> dict[str, torch.Tensor]:
    """The kohya-layout tensors of a FLUX.1 LoRA. `adapters`: "transformer" / "text_encoder" (CLIP-L) -> (its
    adapter weights under peft's names, their LoraConfig fields); `dims`: (hidden size, double blocks, single
    blocks) of the transformer."""
    modules = {}
    for component, (weights, settings) in adapters.items():
        if component not in COMPONENTS:
            raise InputError(f"{source}: the kohya layout of FLUX.1 holds {' and '.join(COMPONENTS)} adapters, "
                             f"not {component}'s")
        if settings.get("use_dora"):
            raise InputError(f"{source} was trained with DoRA (lora.use_dora=true), which the kohya format cannot "
                             f"carry: diffusers' FLUX loader drops its dora_scale keys (with a warning) and would "
                             f"load another model; export the default --format peft, whose magnitudes diffusers "
                             f"loads")
        pairs = adapter_pairs(weights, lora_scale(settings), source)
        if component == "transformer":
            modules.update(transformer_state(pairs, settings["r"], dims, source))
        else:
            modules.update({CLIP_L + name.replace(".", "_"): pair for name, pair in pairs.items()})
    tensors = {}
    for name, (down, up) in modules.items():
        tensors.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                        f"{name}.alpha": torch.tensor(float(down.shape[0]))})
    return tensors


def outside_the_blocks(weights: dict[str, torch.Tensor]) -> list[str]:
    """The transformer's adapted modules outside its blocks (e.g. proj_out, which the target name proj_out adapts besides the single blocks'):
    diffusers' kohya converter (0.42) names them without the `transformer.` prefix its loader then selects by, so
    diffusers drops their adapters of a kohya file, silently; ComfyUI and Forge apply them."""
    return sorted({k.split(".lora_")[0] for k in weights
                   if not k.startswith(("transformer_blocks.", "single_transformer_blocks."))})

