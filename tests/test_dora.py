"""DoRA (lora.use_dora) and rsLoRA (lora.use_rslora): the adapted model starts as its base (quantized or not) when
each rank fills its part of the meta-device model, and the exported adapter loads into diffusers with equal outputs.
Resume after SIGKILL and FSDP are tested with the text encoders' adapters (tests/test_text_encoder_lora.py)."""

import pytest
import torch
from safetensors import safe_open

import export_mmdit
from configs.build import InitialValues, build_data, build_trained_model
from configs.schema import load_config
from models.diffusers_io import LORA_WEIGHTS, lora_scale
from perf.checkpoint import checkpoints, read_checkpoint
from perf.parallel import materialize
from tests.test_lora import check_exported_adapter, inputs
from train_mmdit_stable import main

pytest.importorskip("diffusers")
DORA = ["lora.use_dora=true", "lora.use_rslora=true"]


def started_model(overrides: list[str]):
    """The model as a training rank fills it: built on the meta device, then every tensor from InitialValues."""
    cfg = load_config(overrides=overrides)
    model = build_trained_model(cfg, *build_data(cfg))
    materialize(model, torch.device("cpu"), InitialValues(model, cfg.training.seed, cfg.model.init_from))
    with torch.no_grad():
        return model, model.transformer(*inputs())


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_dora_starts_as_the_base(lora_run, quantization):
    """The magnitudes are the row norms of the weights the layers compute with (dequantized nf4 codes), so the
    DoRA model's output is the plain LoRA model's (B = 0: the base's), bit for bit."""
    base = [f"lora.base_quantization={quantization}"]
    model, dora = started_model(lora_run(*base, *DORA))
    plain = started_model(lora_run(*base))[1]
    magnitudes = [n for n, _ in model.named_parameters() if "lora_magnitude_vector" in n]
    assert len(magnitudes) == 8 + 7  # one per adapted projection (the last block has no to_add_out)
    assert torch.equal(dora, plain)


def test_dora_rslora_export_loads_into_diffusers_with_the_same_outputs(lora_run, tmp_path):
    assert main(lora_run("training.max_steps=3", "optimizer.lr=5e-2", *DORA)) == 0
    tensors, meta = read_checkpoint(checkpoints(tmp_path / "run")[-1])
    assert meta["lora"]["use_dora"] and meta["lora"]["use_rslora"]
    assert lora_scale(meta["lora"]) == 8 / 2  # alpha / sqrt(rank)
    out = tmp_path / "dora"
    assert export_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    with safe_open(out / LORA_WEIGHTS, "pt") as f:
        magnitudes = [k for k in f.keys() if k.endswith(".lora_magnitude_vector.weight")]
    assert len(magnitudes) == 8 + 7
    check_exported_adapter(tmp_path / "run", out, use_ema=True)
