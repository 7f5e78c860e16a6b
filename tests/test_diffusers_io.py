"""Diffusers SD3Transformer2DModel directories <-> this project's MMDiT, compared on outputs."""

import json
import os

import pytest
import torch

from models.diffusers_io import CheckpointFormatError, export_diffusers_transformer
from models.families import load_diffusers_transformer
from models.sd3.model import MMDiT, MMDiTConfig
from tests.conftest import randomize

diffusers = pytest.importorskip("diffusers")

CONFIGS = {
    "sd3-like": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2),
    "qk-norm": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, qk_norm="rms_norm"),
    "sd3.5-dual-attention": dict(num_layers=3, attention_head_dim=8, num_attention_heads=4, qk_norm="rms_norm",
                                 dual_attention_layers=[0, 1]),
    "odd-sizes": dict(num_layers=1, attention_head_dim=12, num_attention_heads=3, patch_size=1, in_channels=3,
                      out_channels=5, sample_size=12, pos_embed_max_size=16),
}
BASE = dict(sample_size=16, patch_size=2, in_channels=4, out_channels=4, joint_attention_dim=24,
            pooled_projection_dim=20, pos_embed_max_size=12)


def make_config(name: str) -> dict:
    config = {**BASE, **CONFIGS[name]}
    config["caption_projection_dim"] = config["num_attention_heads"] * config["attention_head_dim"]
    return config


def inputs(config: dict, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    side = config["sample_size"] - 2 * config["patch_size"]  # not the nominal size: the crop path runs too
    return (torch.randn(2, config["in_channels"], side, side, generator=gen),
            torch.randn(2, 7, config["joint_attention_dim"], generator=gen),
            torch.randn(2, config["pooled_projection_dim"], generator=gen), torch.tensor([250.0, 900.0]))


def diffusers_output(model, x, c, p, t):
    return model(hidden_states=x, encoder_hidden_states=c, pooled_projections=p, timestep=t, return_dict=False)[0]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("sharded", [False, True])
def test_import_from_diffusers(name, sharded, tmp_path):
    config = make_config(name)
    reference = diffusers.SD3Transformer2DModel(**config).eval()
    randomize(reference, 1)
    reference.save_pretrained(tmp_path / "transformer", max_shard_size="20KB" if sharded else "10GB")
    assert any(tmp_path.glob("transformer/*.index.json")) == sharded
    ours = load_diffusers_transformer(tmp_path / "transformer").eval()
    with torch.no_grad():
        expected, got = diffusers_output(reference, *inputs(config)), ours(*inputs(config))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_export_to_diffusers(name, tmp_path):
    config = make_config(name)
    ours = MMDiT(MMDiTConfig(**config)).eval()
    randomize(ours, 2)
    export_diffusers_transformer(ours, tmp_path / "exported")
    loaded = diffusers.SD3Transformer2DModel.from_pretrained(tmp_path / "exported").eval()
    with torch.no_grad():
        expected, got = ours(*inputs(config)), diffusers_output(loaded, *inputs(config))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_written_files_follow_the_umask(tmp_path):
    """safetensors itself creates files readable by their owner only (0600); an export shared with colleagues
    must be readable as any other file would be."""
    import os
    old = os.umask(0o022)
    try:
        export_diffusers_transformer(MMDiT(MMDiTConfig(**make_config("sd3-like"))), tmp_path / "exported")
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "exported").iterdir()}
    assert modes == {"config.json": "0o644", "diffusion_pytorch_model.safetensors": "0o644"}


def test_export_never_overwrites(tmp_path):
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="nothing was overwritten"):
        export_diffusers_transformer(MMDiT(MMDiTConfig(**make_config("sd3-like"))), tmp_path / "exported")
    assert (tmp_path / "exported" / "keep.txt").read_text() == "mine"


def test_mismatches_are_named(tmp_path):
    config = make_config("sd3-like")
    diffusers.SD3Transformer2DModel(**config).save_pretrained(tmp_path / "t")
    raw = json.loads((tmp_path / "t" / "config.json").read_text())
    (tmp_path / "t" / "config.json").write_text(json.dumps({**raw, "num_layers": 3}))
    missing_block = r"does not fit the model: missing \[.*'transformer_blocks.2.attn.to_q.weight'"
    with pytest.raises(CheckpointFormatError, match=missing_block):
        load_diffusers_transformer(tmp_path / "t")
    (tmp_path / "t" / "config.json").write_text(json.dumps({**raw, "_class_name": "AutoencoderKL"}))
    with pytest.raises(CheckpointFormatError, match="AutoencoderKL"):
        load_diffusers_transformer(tmp_path / "t")
    with pytest.raises(CheckpointFormatError, match="config.json does not exist"):
        load_diffusers_transformer(tmp_path / "nowhere")


def test_training_starts_from_a_diffusers_directory(tiny, tmp_path, caplog):
    from configs.build import build_model, build_tokenizer
    from configs.schema import load_config
    from data.shapes import ShapesDataset
    from perf.checkpoint import checkpoints, read_checkpoint
    from train_mmdit_stable import main
    cfg = load_config(overrides=tiny())
    source = build_model(cfg, ShapesDataset, build_tokenizer()).transformer
    randomize(source, 3)
    export_diffusers_transformer(source, tmp_path / "init")
    # lr 1e-30: one step leaves the weights where they started, so the checkpoint shows the initialisation
    assert main(tiny("training.max_steps=1", "optimizer.lr=1e-30", f"model.init_from={tmp_path / 'init'}")) == 0
    tensors, _ = read_checkpoint(checkpoints(tmp_path / "run")[-1])
    for name, value in source.state_dict().items():
        torch.testing.assert_close(tensors["model"][f"transformer.{name}"], value, rtol=0, atol=1e-20)
    assert main(tiny("training.max_steps=1", "model.num_layers=3", f"model.init_from={tmp_path / 'init'}",
                     run="other")) == 2
    assert "model.init_from" in caplog.text and "num_layers" in caplog.text
    weights = tmp_path / "init" / "diffusion_pytorch_model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # a download cut short
    assert main(tiny("training.max_steps=1", f"model.init_from={tmp_path / 'init'}", run="cut")) == 2
    assert f"{weights} is not a whole safetensors file (Error while deserializing header: incomplete metadata" \
           in caplog.text and "did not finish leaves one like it: download it again" in caplog.text
