"""The SD3-medium / SD3.5-medium fine-tuning configs describe the released architectures (checked against
diffusers' SD3Transformer2DModel on the meta device: no weights, no memory) and run as written."""

import dataclasses
from pathlib import Path

import pytest
import torch

from configs.schema import load_config
from models.lora import apply_lora
from models.mmdit import MMDiT
from models.pipeline import mmdit_config
from models.text_encoder import TextToImage
from tests.conftest import export_random_base, losses, write_latent_shards
from train_mmdit_stable import main

diffusers = pytest.importorskip("diffusers")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# ../shared/reference/sd3-mmdit-facts.md: released sizes, and SD3's latents and text conditioning
RELEASED = {"sd3_medium": dict(num_layers=24, num_attention_heads=24, pos_embed_max_size=192, qk_norm=None,
                               dual_attention_layers=[]),
            "sd35_medium": dict(num_layers=24, num_attention_heads=24, pos_embed_max_size=384, qk_norm="rms_norm",
                                dual_attention_layers=list(range(13)))}
SD3_INPUTS = dict(latent_channels=16, latent_sizes=[(128, 128)], joint_dim=4096, pooled_dim=2048)


@pytest.mark.parametrize("name", ["sd3_medium", "sd3_medium_lora", "sd35_medium", "sd35_medium_lora"])
def test_config_is_the_released_architecture(name):
    cfg = load_config(CONFIGS / f"{name}.yaml", ["data.path=unused", "model.init_from=unused"])
    ours = mmdit_config(cfg, **SD3_INPUTS)
    released = {**RELEASED[name.removesuffix("_lora")], "attention_head_dim": 64, "patch_size": 2, "in_channels": 16,
                "out_channels": 16, "sample_size": 128, "joint_attention_dim": 4096, "pooled_projection_dim": 2048,
                "caption_projection_dim": 1536}
    assert dataclasses.asdict(ours) == released
    with torch.device("meta"):
        theirs = diffusers.SD3Transformer2DModel(**released)
        model = TextToImage(MMDiT(ours))
    expected = {k: v.shape for k, v in theirs.state_dict().items()}
    assert {k: v.shape for k, v in model.transformer.state_dict().items()} == expected
    apply_lora(model, cfg.lora)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trained == (sum(p.numel() for p in model.parameters()) if not cfg.lora.enabled else 9_388_032)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sd3_medium_lora", "sd35_medium"])
def test_config_runs_as_written_on_a_shrunken_model(name, tmp_path):
    """Every setting of the file (bf16, activation checkpointing, batch sizer, accumulation, buckets, LoRA)
    but the model's size, shrunk to the test data; compile off to keep the test short."""
    config = CONFIGS / f"{name}.yaml"
    data = write_latent_shards(tmp_path / "latents", sizes=[(8, 8), (8, 4)], per_shard=8)
    shrink = ["model.num_layers=2", "model.num_attention_heads=2", "model.attention_head_dim=8",
              "model.sample_size=8", "model.pos_embed_max_size=8", f"data.path={data}"]
    shrink += ["model.dual_attention_layers=[0]"] if "sd35" in name else []
    base = export_random_base([*shrink, "lora.enabled=false"], tmp_path / "base", config=config)
    run = ["--config", str(config), *shrink, f"model.init_from={base}", "training.train_batch_size=2",
           "training.gradient_accumulation_steps=2", "training.max_steps=3", "training.compile_model=false",
           "logging.log_every=1", f"logging.output_dir={tmp_path / 'run'}"]
    assert main(run) == 0
    assert len(losses(tmp_path / "run")) == 3
