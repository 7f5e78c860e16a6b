"""LoKr and LoHa files (models/lycoris.py): the factors and stems ComfyUI loads, applied as ComfyUI applies them,
give peft's update; every linear module of every family gets a stem ComfyUI's LoRA key map has; what cannot be
written is refused, naming why. Training, resuming and exporting them on every family: tests/test_families.py."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from peft import inject_adapter_in_model

import export_mmdit
from models.families import FAMILIES
from models.flux2.bfl import TOP
from models.lycoris import comfyui_lycoris, folded_factors
from models.lora import ADAPTER, adapter_config, adapter_settings
from tests.families import CASES
from train_mmdit_stable import main

# The factor names ComfyUI's weight adapters read (comfy/weight_adapter/lokr.py, loha.py: `load`)
COMFYUI_FACTORS = {"lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2",
                   "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"}


def comfyui_delta(factors: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """A module's update as ComfyUI's LoKr and LoHa adapters form it (`calculate_weight` at strength 1, for a file
    without `.alpha`: scale 1): kron(w1, w2), each factor whole or the product of its two halves; or the Hadamard
    product of two products."""
    if "hada_w1_a" in factors:
        return ((factors["hada_w1_a"] @ factors["hada_w1_b"]) * (factors["hada_w2_a"] @ factors["hada_w2_b"])).reshape(
            shape)
    def whole(n: int) -> torch.Tensor:
        name = f"lokr_w{n}"
        return factors[name] if name in factors else factors[f"{name}_a"] @ factors[f"{name}_b"]
    return torch.kron(whole(1), whole(2)).reshape(shape)


def apply_as_comfyui(state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], names: dict[str, str]) -> None:
    """Add each stem's update to the weight it names (`transformer.<module>`, or a family's own stem), in place."""
    module_of = {stem: module for module, stem in names.items()}
    stems: dict[str, dict] = {}
    for key, tensor in tensors.items():
        stem, _, factor = key.rpartition(".")
        assert factor in COMFYUI_FACTORS, key
        stems.setdefault(stem, {})[factor] = tensor.float()
    for stem, factors in stems.items():
        weight = state[f"{module_of.get(stem, stem.removeprefix('transformer.'))}.weight"]
        weight += comfyui_delta(factors, weight.shape)


def comfyui_mapped(family: str, model: nn.Module) -> set[str]:
    """The stems ComfyUI's LoRA key map gives a family's weights (comfy/lora.py `model_lora_keys_unet`, comfy/utils.py,
    Comfy-Org/ComfyUI 09708eae): `transformer.<diffusers name>` from `mmdit_to_diffusers` (SD3) and
    `flux_to_diffusers` (FLUX.1, FLUX.2), every weight for Qwen-Image, and `diffusion_model.<its own name>` for every
    weight of its model (FLUX.2's: BFL's)."""
    if family == "qwen_image":
        return {f"transformer.{name}" for name, _ in model.named_modules()}
    if family == "flux2":
        return comfyui_mapped("flux", model) | {f"diffusion_model.{bfl}" for bfl in TOP}
    blocks = len(getattr(model, "transformer_blocks", []))
    singles = len(getattr(model, "single_transformer_blocks", []))
    if family == "sd3":
        block = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                 "attn2.to_q", "attn2.to_k", "attn2.to_v", "norm1_context.linear", "attn.to_add_out",
                 "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear", "attn.to_out.0", "attn2.to_out.0",
                 "ff.net.0.proj", "ff.net.2"]
        top, single = ["context_embedder", "time_text_embed.timestep_embedder.linear_1",
                       "time_text_embed.timestep_embedder.linear_2", "time_text_embed.text_embedder.linear_1",
                       "time_text_embed.text_embedder.linear_2", "norm_out.linear", "proj_out"], []
    else:
        block = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                 "attn.to_out.0", "norm1.linear", "norm1_context.linear", "attn.to_add_out", "ff.net.0.proj",
                 "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "ff.linear_in", "ff.linear_out",
                 "ff_context.linear_in", "ff_context.linear_out"]
        single = ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "norm.linear", "proj_out", "attn.to_qkv_mlp_proj",
                  "attn.to_out"]
        top = ["proj_out", "x_embedder", "time_text_embed.timestep_embedder.linear_1",
               "time_text_embed.timestep_embedder.linear_2", "context_embedder",
               "time_text_embed.text_embedder.linear_1", "time_text_embed.text_embedder.linear_2",
               "time_text_embed.guidance_embedder.linear_1", "time_text_embed.guidance_embedder.linear_2",
               "norm_out.linear"]
    names = [*top, *(f"transformer_blocks.{i}.{m}" for i in range(blocks) for m in block),
             *(f"single_transformer_blocks.{i}.{m}" for i in range(singles) for m in single)]
    return {f"transformer.{name}" for name in names}


@pytest.mark.parametrize("family", CASES)
def test_every_linear_of_each_family_gets_a_stem_comfyui_maps(family):
    """A LoKr or LoHa on any linear module (lora.target_modules may name any) is written under a stem ComfyUI's key
    map has for that family; the modules ComfyUI fuses (q, k, v) it maps to their rows of the fused weight."""
    record = FAMILIES[family]
    config = CASES[family].config(CASES[family].config_names()[0])
    model = record.transformer(record.config(**config))
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    stems = {record.comfyui_names.get(name, f"transformer.{name}") for name in linears}
    assert linears and stems <= comfyui_mapped(family, model), sorted(stems - comfyui_mapped(family, model))


@pytest.mark.parametrize("kind,rank", [("lokr", 1), ("lokr", 8), ("loha", 2)])
def test_the_files_factors_applied_as_comfyui_does_give_pefts_update(kind, rank):
    """LoKr with w2 as a rank-1 product and with both factors whole (where ComfyUI ignores alpha), LoHa: ComfyUI's
    factor names, no `.alpha`, and the update ComfyUI forms from them equals peft's (its scale alpha / r folded in)."""
    lora = SimpleNamespace(type=kind, rank=rank, alpha=3.0, target_modules=["proj"])
    layer = nn.Sequential()
    layer.add_module("proj", nn.Linear(12, 20))
    settings = adapter_settings(lora)
    inject_adapter_in_model(adapter_config(kind, settings), layer, adapter_name=ADAPTER)
    torch.manual_seed(0)
    weights = {name: p.detach().normal_() for name, p in layer.named_parameters() if p.requires_grad}
    tensors = comfyui_lycoris(folded_factors(weights, settings, "test"), {})
    assert all(key.startswith("transformer.proj.") and key.rpartition(".")[2] in COMFYUI_FACTORS for key in tensors)
    assert ("transformer.proj.lokr_w2_a" in tensors) == (kind == "lokr" and rank == 1)
    state = {"proj.weight": torch.zeros(20, 12)}
    apply_as_comfyui(state, tensors, {})
    torch.testing.assert_close(state["proj.weight"], layer.proj.get_delta_weight(ADAPTER), rtol=1e-6, atol=1e-6)


def test_what_diffusers_does_not_load_is_refused_with_the_reason(lora_run, tmp_path, caplog):
    """SD3's pipeline loads no LoKr (only FLUX.2's does) and none loads LoHa: --format peft of them is refused,
    naming that, with nothing written; --format kohya (ComfyUI's layout) writes them for SD3 too."""
    for kind in ("lokr", "loha"):
        assert main(lora_run(f"lora.type={kind}", "training.max_steps=1", run=kind)) == 0
        out = tmp_path / f"{kind}-peft"
        assert export_mmdit.main(["--checkpoint", str(tmp_path / kind), "--out", str(out)]) == 2
        assert "load_lora_weights does not load" in caplog.text and not out.exists()
        assert export_mmdit.main(["--checkpoint", str(tmp_path / kind), "--out", str(tmp_path / f"{kind}-comfy"),
                                  "--format", "kohya"]) == 0


@pytest.mark.parametrize("setting", ["lora.use_dora=true", "lora.use_rslora=true", "lora.dropout=0.1"])
def test_lora_only_settings_with_lokr_are_refused(setting, lora_run, tmp_path, caplog):
    assert main(lora_run("lora.type=lokr", setting)) == 2
    key = setting.split("=")[0]
    assert f"config error: {key} must be" in caplog.text and "with type=lokr" in caplog.text
    assert not (tmp_path / "run").exists()
