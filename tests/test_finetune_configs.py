"""The shipped fine-tuning configs of every family (SD3 / SD3.5, FLUX.1, Qwen-Image, FLUX.2; full and LoRA) describe the
released architectures (checked against diffusers' transformer classes on the meta device: no weights, no memory),
fit the GPUs their headers name (plan_memory.py's plan at 1024 px), and run as written."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from configs.build import transformer_config
from configs.schema import load_config
from models.families import FAMILIES
from models.lora import apply_lora
from models.text_encoder import TextToImage
from tests.conftest import export_random_base, losses, write_latent_shards
from train_mmdit_stable import main

diffusers = pytest.importorskip("diffusers")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def sd3(blocks: int, pos_embed_max_size: int, qk_norm: str | None, dual_attention_layers: list[int]) -> dict:
    """An SD3 / SD3.5 config.json (docs/sd3-architecture.md): `blocks` joint blocks of as many heads x 64."""
    return dict(sample_size=128, patch_size=2, in_channels=16, num_layers=blocks, attention_head_dim=64,
                num_attention_heads=blocks, joint_attention_dim=4096, caption_projection_dim=64 * blocks,
                pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=pos_embed_max_size,
                dual_attention_layers=dual_attention_layers, qk_norm=qk_norm)


def flux2(double: int, single: int, heads: int, text: int, guidance: bool) -> dict:
    """A FLUX.2 config.json (docs/flux2-architecture.md): heads x 128, the language model's 3 layers of text."""
    return dict(patch_size=1, in_channels=128, out_channels=None, num_layers=double, num_single_layers=single,
                attention_head_dim=128, num_attention_heads=heads, joint_attention_dim=text,
                timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=[32, 32, 32, 32], rope_theta=2000,
                eps=1e-6, guidance_embeds=guidance)


FLUX = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, axes_dims_rope=[16, 56, 56])
# released config.json values, by plan_memory.py's model names (docs/*-architecture.md)
RELEASED = {"sd3-medium": ("SD3Transformer2DModel", sd3(24, 192, None, [])),
            "sd35-medium": ("SD3Transformer2DModel", sd3(24, 384, "rms_norm", list(range(13)))),
            "sd35-large": ("SD3Transformer2DModel", sd3(38, 192, "rms_norm", [])),
            "flux-dev": ("FluxTransformer2DModel", {**FLUX, "guidance_embeds": True}),
            "flux-schnell": ("FluxTransformer2DModel", {**FLUX, "guidance_embeds": False}),
            "flux-kontext": ("FluxTransformer2DModel", {**FLUX, "guidance_embeds": True}),  # FLUX.1-dev's sizes
            "qwen-image": ("QwenImageTransformer2DModel", dict(
                patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=[16, 56, 56],
                zero_cond_t=False)),
            "flux2-klein-4b": ("Flux2Transformer2DModel", flux2(5, 20, 24, 3 * 2560, False)),
            "flux2-klein-9b": ("Flux2Transformer2DModel", flux2(8, 24, 32, 3 * 4096, False)),
            "flux2-dev": ("Flux2Transformer2DModel", flux2(8, 48, 48, 3 * 5120, True))}
# each shipped config: the released model it fine-tunes and the GPUs its header names (count, GB each)
SHIPPED = {"sd3_medium": ("sd3-medium", 1, 80), "sd3_medium_lora": ("sd3-medium", 1, 24),
           "sd35_medium": ("sd35-medium", 1, 80), "sd35_medium_lora": ("sd35-medium", 1, 24),
           "sd35_medium_lora_24gb": ("sd35-medium", 1, 24), "sd35_large": ("sd35-large", 8, 80),
           "sd35_large_lora": ("sd35-large", 1, 48), "sd35_large_lora_24gb": ("sd35-large", 1, 24),
           "flux_dev_lora": ("flux-dev", 1, 80), "flux_dev_lora_24gb": ("flux-dev", 1, 24),
           "flux_dev": ("flux-dev", 8, 80), "flux_schnell_lora": ("flux-schnell", 1, 80),
           "qwen_image_lora": ("qwen-image", 1, 80), "qwen_image_lora_24gb": ("qwen-image", 1, 24),
           "qwen_image": ("qwen-image", 8, 80), "flux2_klein_4b_lora": ("flux2-klein-4b", 1, 16),
           "flux2_klein_9b_lora": ("flux2-klein-9b", 1, 24), "flux2_dev_lora": ("flux2-dev", 1, 80),
           "flux2_dev_lora_24gb": ("flux2-dev", 1, 24), "flux_kontext_lora": ("flux-kontext", 1, 80),
           "flux_kontext_lora_24gb": ("flux-kontext", 1, 24), "qwen_image_edit_lora": ("qwen-image", 1, 80),
           "qwen_image_edit_lora_24gb": ("qwen-image", 1, 24),
           "flux2_dev": ("flux2-dev", 8, 80)}
NOT_PLANNED = {"flux_schnell_lora"}  # dev's LoRA plan but for the guidance embedding and T5's length: not counted again


def adapters(family: str, config: dict) -> int:
    """Parameters of rank-1 LoRA on the family's default targets (models/<family>/family.py), in units of the
    width D: a D x D linear takes 2 D, a feed-forward's D x 4D or 4D x D one 5 D."""
    blocks = config["num_layers"]
    if family == "sd3":  # 8 square attention projections per block; the last block (text pre-only) has no to_add_out
        return (8 * blocks - 1) * 2
    if family == "flux":  # double blocks: 8 projections and both feed-forwards; single blocks: to_q, to_k, to_v
        return blocks * (8 * 2 + 4 * 5) + config["num_single_layers"] * 3 * 2
    if family == "flux2":  # double blocks: the image stream's 4 projections; single blocks: the fused projection
        # (D in, 3 D of q, k, v and 2 x 3 D of the gated feed-forward out) and the output (D + 3 D in, D out)
        return blocks * 4 * 2 + config["num_single_layers"] * ((1 + 9) + (4 + 1))
    # qwen_image: both streams' 8 projections and feed-forwards; the last block's text stream (to_add_out and the
    # text feed-forward) reaches nothing and is left out
    return blocks * (8 * 2 + 4 * 5) - (2 + 2 * 5)


def test_every_shipped_config_is_checked():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} - {"shapes"} == set(SHIPPED)
    assert set(RELEASED) == {name for family in FAMILIES.values() for name in family.released}


def configs_of_make_test() -> list:
    """Every shipped config; `make test` leaves to `make test-all` the one-GPU LoRA configs that have a 24 GB sibling
    (the sibling, tighter, is checked) and the multi-GPU full fine-tunes but SD3's."""
    repeat = lambda name: f"{name}_24gb" in SHIPPED or (SHIPPED[name][1] > 1 and name != "sd35_large")  # noqa: E731
    return [pytest.param(name, marks=pytest.mark.full) if repeat(name) else name for name in SHIPPED]


@pytest.mark.parametrize("name", configs_of_make_test())
def test_config_with_the_released_transformer_is_the_released_architecture_and_fits_where_it_says(name, tmp_path):
    """The configs take the transformer's sizes from model.init_from's config.json; pointed at (the config of) the
    released transformer, each builds the family's diffusers class key for key and shape for shape (20B parameters
    on the meta device), trains what the family's LoRA targets say (or everything), and the memory plan of the
    config as written (plan_memory.py's first row) fits the GPUs its header names, at 1024 px."""
    import plan_memory
    from runtime.memory_plan import GIB, plan
    model_name, gpus, gib = SHIPPED[name]
    diffusers_class, released = RELEASED[model_name]
    with torch.device("meta"):
        theirs = getattr(diffusers, diffusers_class)(**released)
    theirs.save_config(tmp_path / "transformer")  # config.json only, as in the released folder
    path = CONFIGS / f"{name}.yaml"
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    assert re.search(rf"\b{gib} GB\b", header) and (gpus == 1 or f"{gpus} GPUs" in header), header
    cfg = load_config(path, ["data.path=unused", f"model.init_from={tmp_path / 'transformer'}"])
    family = FAMILIES[cfg.model.family]
    assert family.diffusers_class == diffusers_class and model_name in family.released
    text = family.text_of(cfg.model)
    ours = transformer_config(cfg, text.latent_channels, [(128, 128)], (text.joint, text.pooled))
    assert dataclasses.asdict(ours) == {**released, "out_channels": released["out_channels"] or released["in_channels"]}
    with torch.device("meta"):
        model = TextToImage(family.transformer(ours))
    assert {k: v.shape for k, v in model.transformer.state_dict().items()} == \
        {k: v.shape for k, v in theirs.state_dict().items()}
    apply_lora(model, cfg.lora)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    width = released["num_attention_heads"] * released["attention_head_dim"]
    if cfg.lora.enabled:
        assert trained == adapters(family.name, released) * cfg.lora.rank * width
    else:  # a full fine-tune trains all but what reaches nothing (Qwen-Image's last text stream)
        unused = [model.transformer.get_submodule(m) for m in getattr(model.transformer, "unused_modules", list)()]
        assert trained == sum(p.numel() for p in model.parameters()) - sum(p.numel() for m in unused
                                                                           for p in m.parameters())
    if name in NOT_PLANNED:
        return
    cfg, _ = plan_memory.planning_config(str(path), [f"model.init_from={tmp_path / 'transformer'}"], None)
    _, choice = plan_memory.choices(cfg, gpus)[0]
    counted = plan_memory.count(cfg, *plan_memory.data_like(cfg, 1024), choice["quantization"])
    result = plan(counted, checkpointing=choice["checkpointing"], every=choice["every"],
                  **plan_memory.settings(cfg, choice, gpus))
    assert result.peak / GIB <= gib, result


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS.glob("*.yaml") if p.stem != "shapes"))
def test_config_shows_sample_grids_a_few_times_per_run(name):
    """Validation images of the dataset's prompts every validation.every steps (and at the end): a few per run."""
    cfg = load_config(CONFIGS / f"{name}.yaml", ["data.path=unused", "model.init_from=null", "lora.enabled=false",
                                                  "lora.base_quantization=none", "offload.blocks_to_swap=0"],
                      resolve=False)
    assert cfg.validation.at_end and 3 <= cfg.training.max_steps // cfg.validation.every <= 8


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
