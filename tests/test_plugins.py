"""The plugins that ship with the foundation: each trains like the plain loop, within a stated tolerance."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import train_mmdit_stable
from configs.schema import load_config
from data.shapes import ShapesDataset
from configs.build import build_model, build_tokenizer
from perf.activation_checkpointing import apply_activation_checkpointing
from perf.checkpoint import checkpoints, read_checkpoint
from tests.conftest import final_weights, losses, metric_rows
from train_mmdit_stable import main


@pytest.mark.parametrize("dtype,tolerance", [("bf16", 0.05), ("fp16", 0.01)])
def test_mixed_precision_trains_like_fp32(tiny, tmp_path, dtype, tolerance):
    """Autocast changes rounding only: the first losses agree within the dtype's tolerance (bf16 has an
    8-bit mantissa, fp16 10 bits)."""
    assert main(tiny("training.max_steps=3", run="fp32")) == 0
    assert main(tiny("training.max_steps=3", f"training.dtype={dtype}", run=dtype)) == 0
    assert losses(tmp_path / dtype) == pytest.approx(losses(tmp_path / "fp32"), rel=tolerance)


@pytest.mark.slow
def test_compiled_training_matches_eager(tiny, tmp_path):
    assert main(tiny("training.max_steps=3", run="eager")) == 0
    assert main(tiny("training.max_steps=3", "compile.enabled=true", run="compiled")) == 0
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-4)
    eager, compiled = (final_weights(tmp_path / r) for r in ("eager", "compiled"))
    assert eager.keys() == compiled.keys()


def test_failed_compilation_falls_back_to_eager(tiny, tmp_path, monkeypatch, caplog):
    calls = []

    def broken_backend(graph, example_inputs):
        calls.append(graph)
        raise RuntimeError("injected compiler failure")

    import perf.parallel as parallel
    real_apply = parallel.apply_compile
    monkeypatch.setattr(parallel, "apply_compile",
                        lambda model, enabled, mode, scope: real_apply(model, enabled, mode, scope, broken_backend))
    assert main(tiny("training.max_steps=3", run="eager")) == 0
    assert main(tiny("training.max_steps=3", "compile.enabled=true", run="broken")) == 0
    assert calls, "the compiler was asked and failed"
    assert losses(tmp_path / "broken") == losses(tmp_path / "eager")  # then ran eagerly, bit for bit


@pytest.mark.parametrize("every", [1, 2])
def test_activation_checkpointing_gives_the_same_gradients(every):
    cfg = load_config(overrides=["model.num_layers=3", "text_encoder.dim=32", "text_encoder.num_heads=2"])
    tokenizer = build_tokenizer()
    grads = []
    for checkpointing in (0, every):
        torch.manual_seed(0)
        model = build_model(cfg, ShapesDataset, tokenizer)
        for p in model.parameters():  # leave the adaLN-Zero init so every block does real work
            p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
        apply_activation_checkpointing(model, checkpointing)
        g = torch.Generator().manual_seed(1)
        x, sigma = torch.randn(4, 3, 32, 32, generator=g), torch.rand(4, generator=g)
        model(x, sigma, {"input_ids": tokenizer(["a red circle in the center"] * 4)}).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    wrapped = [i for i, b in enumerate(model.transformer.transformer_blocks) if getattr(b.forward, "func", None) is checkpoint]
    assert wrapped == list(range(0, 3, every))


def inject_nan(monkeypatch, bad_steps, value=float("nan")):
    """Poison the gradients (and loss) of the given 0-based steps, as a diverging batch (NaN) or an fp16
    overflow (inf) would."""
    real = train_mmdit_stable.forward_backward

    def forward_backward(model, batch, *args):
        loss = real(model, batch, *args)
        if int(batch["step"]) in bad_steps:
            next(model.parameters()).grad.fill_(value)
            return loss * value
        return loss

    monkeypatch.setattr(train_mmdit_stable, "forward_backward", forward_backward)


def test_nonfinite_step_is_skipped_and_counted(tiny, tmp_path, monkeypatch, caplog):
    inject_nan(monkeypatch, {1})
    assert main(tiny("training.max_steps=3", "checkpoint.every=1", "checkpoint.keep_last=5")) == 0
    assert "step 2 skipped" in caplog.text
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    (after_1, _), (after_2, meta_2), (after_3, _) = (read_checkpoint(p, ("model", "ema", "optimizer")) for p in ckpts)
    for stem in ("model", "ema"):  # nothing applied at the skipped step
        assert all(torch.equal(after_1[stem][k], after_2[stem][k]) for k in after_1[stem]), stem
    adam_1, adam_2 = after_1["optimizer"]["state"], after_2["optimizer"]["state"]
    assert all(torch.equal(adam_1[name][key], adam_2[name][key]) for name in adam_1 for key in adam_1[name])
    assert not all(torch.equal(after_2["model"][k], after_3["model"][k]) for k in after_2["model"])
    assert all(torch.isfinite(v).all() for v in after_3["model"].values())
    rows = metric_rows(tmp_path / "run")
    assert [r["skipped_steps"] for r in rows if "loss" in r] == [0, 1, 1]


def test_nonfinite_steps_in_a_row_stop_the_run(tiny, tmp_path, monkeypatch, caplog):
    inject_nan(monkeypatch, set(range(2, 100)))
    assert main(tiny("training.max_steps=50", "training.max_nonfinite_steps=3", "checkpoint.every=2")) == 1
    assert "3 non-finite steps in a row up to step 5" in caplog.text and "step_00000002" in caplog.text


def test_fp16_overflow_is_skipped_and_lowers_the_loss_scale(tiny, tmp_path, monkeypatch):
    inject_nan(monkeypatch, {1}, value=float("inf"))
    assert main(tiny("training.max_steps=3", "training.dtype=fp16", "checkpoint.every=1",
                     "checkpoint.keep_last=5")) == 0
    (after_1, meta_1), (after_2, meta_2), _ = (read_checkpoint(p) for p in checkpoints(tmp_path / "run"))
    assert all(torch.equal(after_1["model"][k], after_2["model"][k]) for k in after_1["model"])
    assert meta_2["scaler"]["scale"] == meta_1["scaler"]["scale"] / 2  # GradScaler backoff
    rows = metric_rows(tmp_path / "run")
    assert [r["skipped_steps"] for r in rows if "loss" in r] == [0, 1, 1]


def count_work(monkeypatch, tiny, run, *overrides):
    """Transformer forwards, backward calls and host syncs (.item(), bool(tensor)) of one training run."""
    counts = {"forward": 0, "backward": 0, "sync": 0}
    import configs.build as build
    import perf.validation as validation
    real_build, real_backward = build.build_model, torch.Tensor.backward
    real_item, real_bool = torch.Tensor.item, torch.Tensor.__bool__

    def build_model(*args):
        model = real_build(*args)
        model.transformer.register_forward_pre_hook(lambda *_: counts.__setitem__("forward", counts["forward"] + 1))
        return model

    def counted(key, fn):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    with monkeypatch.context() as m:
        m.setattr(build, "build_model", build_model)  # the trained model (not the meta copy that counts FLOPs)
        m.setattr(validation.Validation, "__call__", lambda *args: {})
        m.setattr(torch.Tensor, "backward", counted("backward", real_backward))
        m.setattr(torch.Tensor, "item", counted("sync", real_item))
        m.setattr(torch.Tensor, "__bool__", counted("sync", real_bool))
        assert main(tiny(*overrides, "logging.log_every=1000", "training.gradient_accumulation_steps=2", run=run)) == 0
    return counts


def test_plugins_off_add_no_work_to_a_step(tiny, monkeypatch):
    """With every plugin off, each optimizer step does exactly `accumulation` forwards and backwards and no
    host synchronisation: the per-step difference between a 4-step and a 2-step run."""
    off = ["training.max_nonfinite_steps=0", "checkpoint.async_save=false"]
    short = count_work(monkeypatch, tiny, "short", "training.max_steps=2", *off)
    long = count_work(monkeypatch, tiny, "long", "training.max_steps=4", *off)
    per_step = {k: (long[k] - short[k]) / 2 for k in long}
    assert per_step == {"forward": 2, "backward": 2, "sync": 0}
    # the test sees a sync when there is one: the non-finite guard's one per step
    guard = ["training.max_nonfinite_steps=5", "checkpoint.async_save=false"]
    guarded_short = count_work(monkeypatch, tiny, "guarded_short", "training.max_steps=2", *guard)
    guarded_long = count_work(monkeypatch, tiny, "guarded_long", "training.max_steps=4", *guard)
    assert (guarded_long["sync"] - guarded_short["sync"]) / 2 == 1
