"""LoRA through peft: only adapters train and are checkpointed, resume is exact, the plugins compose, and the
exported adapter loads into diffusers' SD3 transformer with the same outputs."""

import shutil

import pytest
import torch
from safetensors import safe_open

import export_mmdit
from configs.build import build_data, build_model
from configs.schema import load_config
from models.diffusers_io import LORA_WEIGHTS
from models.lora import apply_lora
from perf.checkpoint import checkpoints, read_checkpoint
from sample_mmdit import load_trained
from tests.conftest import LATENT_DIMS, LORA, assert_close, final_weights, losses, randomize, spawn, train
from train_mmdit_stable import main

diffusers = pytest.importorskip("diffusers")


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    d = LATENT_DIMS
    return (torch.randn(2, d["channels"], 8, 8, generator=gen), torch.randn(2, d["tokens"], d["joint"], generator=gen),
            torch.randn(2, d["pooled"], generator=gen), torch.tensor([250.0, 900.0]))


def test_adapters_alone_train_and_start_as_the_base(latent_run):
    cfg = load_config(overrides=latent_run(*LORA, "lora.enabled=false"))
    model = build_model(cfg, build_data(cfg)[0])
    randomize(model, 1)
    with torch.no_grad():
        before = model.transformer(*inputs())
    cfg.lora.enabled = True
    apply_lora(model, cfg.lora)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    # 8 projections in each joint block; the last block (context_pre_only) has no to_add_out
    assert len(trained) == 2 * (8 + 7) and all(".lora_" in n for n in trained)
    with torch.no_grad():
        assert torch.equal(model.transformer(*inputs()), before)  # B starts at zero


def test_lora_run_keeps_the_base_checkpoints_adapters_and_resumes_exactly(lora_run, tmp_path):
    """With adapter dropout too: the global RNG it draws from is re-seeded from (seed, step, rank) each step."""
    run = lora_run("training.max_steps=6", "checkpoint.every=3", "lora.dropout=0.3")
    assert main(run) == 0
    tensors, meta = read_checkpoint(checkpoints(tmp_path / "run")[-1])
    assert tensors["model"] and all(".lora_" in k for k in tensors["model"])
    assert tensors["model"].keys() == tensors["ema"].keys()
    assert meta["lora"]["r"] == 4 and meta["lora"]["lora_alpha"] == 8
    assert any(v.abs().sum() > 0 for k, v in tensors["model"].items() if "lora_B" in k)  # the adapters moved
    whole = tensors["model"]
    shutil.rmtree(checkpoints(tmp_path / "run")[-1])
    assert main(run) == 0
    assert_close(final_weights(tmp_path / "run"), whole)


def reference_output(run_dir, use_ema: bool):
    """This project's adapted model, rebuilt from the run's config and checkpoint, on `inputs()`."""
    model, _ = load_trained(checkpoints(run_dir)[-1], use_ema)
    with torch.no_grad():
        return model.transformer(*inputs())


def check_exported_adapter(run_dir, adapter_dir, use_ema: bool) -> None:
    """diffusers' SD3 transformer (the run's base) with the exported adapter gives this project's outputs."""
    with safe_open(adapter_dir / LORA_WEIGHTS, "pt") as f:
        assert all(k.startswith("transformer.transformer_blocks.") and ".default." not in k for k in f.keys())
    base_dir = load_trained(checkpoints(run_dir)[-1])[1].model.init_from
    transformer = diffusers.SD3Transformer2DModel.from_pretrained(base_dir).eval()
    x, c, pooled, t = inputs()
    with torch.no_grad():
        base = transformer(hidden_states=x, encoder_hidden_states=c, pooled_projections=pooled, timestep=t,
                           return_dict=False)[0]
        transformer.load_lora_adapter(adapter_dir, prefix="transformer", weight_name=LORA_WEIGHTS)
        theirs = transformer(hidden_states=x, encoder_hidden_states=c, pooled_projections=pooled, timestep=t,
                             return_dict=False)[0]
    ours = reference_output(run_dir, use_ema)
    assert (theirs - base).abs().max() > 1e-3  # the adapter changes the output
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_exported_adapter_loads_into_diffusers_with_the_same_outputs(lora_run, tmp_path):
    assert main(lora_run("training.max_steps=3", "optimizer.lr=5e-2")) == 0
    for weights in ("ema", "trained"):
        out = tmp_path / f"lora-{weights}"
        assert export_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--out", str(out), "--weights", weights]) == 0
        check_exported_adapter(tmp_path / "run", out, weights == "ema")
    assert export_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 2  # never overwrites


@pytest.mark.parametrize("plugin,weights_atol", [
    (["compile.enabled=true", "compile.backend=aot_eager"], 1e-7),  # decomposed ops: fp32 rounding only
    (["training.activation_checkpointing=full", "checkpoint.async_save=false"], 0.0),  # the same math, bitwise
    (["training.dtype=bf16"], None)])  # bf16 rounds activations: losses within 3 %
def test_lora_with_a_plugin_trains_like_lora_without(lora_run, tmp_path, plugin, weights_atol):
    assert main(lora_run("training.max_steps=4", "optimizer.eps=1e-3", run="plain")) == 0
    assert main(lora_run("training.max_steps=4", "optimizer.eps=1e-3", *plugin, run="plugin")) == 0
    plain, other = losses(tmp_path / "plain"), losses(tmp_path / "plugin")
    assert other == pytest.approx(plain, rel=1e-5 if weights_atol is not None else 3e-2)
    if weights_atol is not None:
        assert_close(final_weights(tmp_path / "plugin"), final_weights(tmp_path / "plain"), atol=weights_atol)


def test_lora_mistakes_are_named_before_compute(lora_run, latent_run, tmp_path, caplog):
    assert main(lora_run("training.max_steps=1", "lora.target_modules=[attn.to_qq]")) == 2
    assert "lora.target_modules ['attn.to_qq'] match no module" in caplog.text
    assert main(latent_run(*LORA, "training.max_steps=1")) == 2
    assert "lora.enabled=true needs model.init_from" in caplog.text
    # the run's checkpoints hold only adapters: resuming with another rank or base is refused
    assert main(lora_run("training.max_steps=2")) == 0
    assert main(lora_run("training.max_steps=3", "lora.rank=8")) == 2
    assert "lora.rank: 4 -> 8" in caplog.text  # each changed key, with its old and new value
    assert not (tmp_path / "run" / "checkpoints" / "step_00000003").exists()


def test_lora_under_ddp_equals_one_process(lora_run, tmp_path):
    """2 gloo ranks x accumulation 1 equal 1 rank x accumulation 2: only the adapters' gradients are reduced."""
    common = ["training.max_steps=3", "training.train_batch_size=2"]
    two = lora_run(*common, run="two")
    assert [r["status"] for r in spawn(2, train, two, tmp_path=tmp_path)] == [0, 0]
    assert main(lora_run(*common, "training.gradient_accumulation_steps=2", run="one")) == 0
    one, ddp = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    assert all(".lora_" in k for k in one)
    assert_close(ddp, one, atol=2e-4, mean_atol=1e-6)
