"""The released SD3 / SD3.5 fine-tuning configs (medium and large, full and LoRA) describe the released
architectures (checked against diffusers' SD3Transformer2DModel on the meta device: no weights, no memory)
and run as written."""

import dataclasses
from pathlib import Path

import pytest
import torch

from configs.build import transformer_config
from configs.schema import load_config
from models.lora import apply_lora
from models.sd3.model import MMDiT
from models.text_encoder import TextToImage
from tests.conftest import export_random_base, losses, write_latent_shards
from train_mmdit_stable import main

diffusers = pytest.importorskip("diffusers")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# docs/sd3-architecture.md: released sizes, and SD3's latents and text conditioning
RELEASED = {"sd3_medium": dict(num_layers=24, num_attention_heads=24, pos_embed_max_size=192, qk_norm=None,
                               dual_attention_layers=[]),
            "sd35_medium": dict(num_layers=24, num_attention_heads=24, pos_embed_max_size=384, qk_norm="rms_norm",
                                dual_attention_layers=list(range(13))),
            "sd35_large": dict(num_layers=38, num_attention_heads=38, pos_embed_max_size=192, qk_norm="rms_norm",
                               dual_attention_layers=[])}
SD3_INPUTS = dict(latent_channels=16, latent_sizes=[(128, 128)], text_dims=(4096, 2048))


@pytest.mark.parametrize("name", ["sd3_medium", "sd3_medium_lora", "sd35_medium", "sd35_medium_lora", "sd35_large",
                                  "sd35_large_lora", "sd35_medium_lora_24gb", "sd35_large_lora_24gb"])
def test_config_with_the_released_transformer_is_the_released_architecture(name, tmp_path):
    """The configs take the MMDiT's sizes from model.init_from's config.json; pointed at (the config of) the
    released transformer, they build diffusers' SD3Transformer2DModel key for key."""
    model_name = name.removesuffix("_24gb").removesuffix("_lora")
    released = {**RELEASED[model_name], "attention_head_dim": 64, "patch_size": 2, "in_channels": 16,
                "out_channels": 16, "sample_size": 128, "joint_attention_dim": 4096, "pooled_projection_dim": 2048,
                "caption_projection_dim": 64 * RELEASED[model_name]["num_attention_heads"]}
    with torch.device("meta"):
        theirs = diffusers.SD3Transformer2DModel(**released)
    theirs.save_config(tmp_path / "transformer")  # config.json only, as in the released folder
    cfg = load_config(CONFIGS / f"{name}.yaml", ["data.path=unused", f"model.init_from={tmp_path / 'transformer'}"])
    ours = transformer_config(cfg, **SD3_INPUTS)
    assert dataclasses.asdict(ours) == released
    with torch.device("meta"):
        model = TextToImage(MMDiT(ours))
    expected = {k: v.shape for k, v in theirs.state_dict().items()}
    assert {k: v.shape for k, v in model.transformer.state_dict().items()} == expected
    apply_lora(model, cfg.lora)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # LoRA: 8 square attention projections per block (the last block has no to_add_out), rank x (in + out) each
    adapters = (8 * released["num_layers"] - 1) * cfg.lora.rank * 2 * released["caption_projection_dim"]
    assert trained == (sum(p.numel() for p in model.parameters()) if not cfg.lora.enabled else adapters)


@pytest.mark.parametrize("name", ["sd3_medium_lora", "sd35_medium", "sd35_large_lora_24gb"])
def test_config_runs_as_written_on_a_shrunken_model(name, tmp_path):
    """Every setting of the file (bf16, activation checkpointing, batch sizer, accumulation, buckets, LoRA)
    but the model's size, shrunk to the test data; compile off to keep the test short."""
    config = CONFIGS / f"{name}.yaml"
    data = write_latent_shards(tmp_path / "latents", sizes=[(8, 8), (8, 4)], per_shard=8)
    shrink = ["model.num_layers=2", "model.num_attention_heads=2", "model.attention_head_dim=8",
              "model.sample_size=8", "model.pos_embed_max_size=8", f"data.path={data}"]
    shrink += ["model.dual_attention_layers=[0]"] if "sd35" in name else []
    base = export_random_base([*shrink, "lora.enabled=false", "lora.base_quantization=none"], tmp_path / "base",
                              config=config)
    run = ["--config", str(config), *shrink, f"model.init_from={base}", "training.train_batch_size=2",
           "training.gradient_accumulation_steps=2", "training.max_steps=3", "compile.enabled=false",
           "logging.log_every=1", f"logging.output_dir={tmp_path / 'run'}"]
    assert main(run) == 0
    assert len(losses(tmp_path / "run")) == 3


FLUX_RELEASED = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=19, num_single_layers=38,
                     attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                     axes_dims_rope=[16, 56, 56])  # docs/flux.md


@pytest.mark.parametrize("name,gpus,gib", [("flux_dev_lora", 1, 80), ("flux_dev_lora_24gb", 1, 24),
                                           ("flux_dev", 8, 80), ("flux_schnell_lora", 1, 80)])
def test_flux_configs_are_the_released_architecture_and_fit_where_they_say(name, gpus, gib, tmp_path):
    """Pointed at (the config of) the released FLUX.1 transformer, each config builds diffusers'
    FluxTransformer2DModel key for key (12B parameters on the meta device), and the memory plan of the config as
    written (plan_memory.py's first row) fits the GPUs its header names, at 1024 px. (schnell's plan is dev's but for
    the guidance embedding and T5's length: it is not counted again, for time.)"""
    import plan_memory
    from models.flux.model import Flux
    from runtime.memory_plan import GIB, plan
    released = {**FLUX_RELEASED, "guidance_embeds": "schnell" not in name}
    with torch.device("meta"):
        theirs = diffusers.FluxTransformer2DModel(**released)
    theirs.save_config(tmp_path / "transformer")
    cfg = load_config(CONFIGS / f"{name}.yaml", ["data.path=unused", f"model.init_from={tmp_path / 'transformer'}"])
    assert cfg.model.family == "flux" and cfg.model.patch_size == 2
    ours = transformer_config(cfg, latent_channels=16, latent_sizes=[(128, 128)], text_dims=(4096, 768))
    assert dataclasses.asdict(ours) == released
    with torch.device("meta"):
        model = Flux(ours)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    if "schnell" in name:
        return
    cfg, _ = plan_memory.planning_config(str(CONFIGS / f"{name}.yaml"), [], "flux-dev")
    _, choice = plan_memory.choices(cfg, gpus)[0]
    counted = plan_memory.count(cfg, *plan_memory.data_like(cfg, 1024), choice["quantization"])
    result = plan(counted, checkpointing=choice["checkpointing"], every=choice["every"],
                  **plan_memory.settings(cfg, choice, gpus))
    assert result.peak / GIB <= gib, result
