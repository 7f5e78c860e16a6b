"""Diffusers transformer directories written and read safely: the files' permissions, never overwriting, mismatches
named, training started from one (every family's outputs against diffusers': tests/test_families.py)."""

import json
import os

import pytest
import torch

from models.diffusers_io import CheckpointFormatError, export_diffusers_transformer
from models.families import load_diffusers_transformer
from models.sd3.model import MMDiT, MMDiTConfig
from tests.conftest import randomize
from tests.families import sd3_config

diffusers = pytest.importorskip("diffusers")
SD3_LIKE = sd3_config(num_layers=2, attention_head_dim=16, num_attention_heads=2)


def test_written_files_follow_the_umask(tmp_path):
    """safetensors itself creates files readable by their owner only (0600); an export shared with colleagues
    must be readable as any other file would be."""
    import os
    old = os.umask(0o022)
    try:
        export_diffusers_transformer(MMDiT(MMDiTConfig(**SD3_LIKE)), tmp_path / "exported")
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "exported").iterdir()}
    assert modes == {"config.json": "0o644", "diffusion_pytorch_model.safetensors": "0o644"}


def test_export_never_overwrites(tmp_path):
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="nothing was overwritten"):
        export_diffusers_transformer(MMDiT(MMDiTConfig(**SD3_LIKE)), tmp_path / "exported")
    assert (tmp_path / "exported" / "keep.txt").read_text() == "mine"


def test_mismatches_are_named(tmp_path):
    config = SD3_LIKE
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
