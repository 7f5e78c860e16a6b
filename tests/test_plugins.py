"""The plugins that ship with the foundation: each trains like the plain loop, within a stated tolerance."""

import json

import pytest
import torch

import train_mmdit_stable
from perf.checkpoint import read_checkpoint
from train_mmdit_stable import main


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_profiler_writes_a_trace_after_its_scheduled_steps(tiny, tmp_path):
    assert main(tiny("training.max_steps=5", "training.enable_profiling=true", "training.profile_steps=2")) == 0
    traces = list((tmp_path / "run" / "tensorboard").glob("rank0*.pt.trace.json"))
    assert len(traces) == 1 and json.loads(traces[0].read_text())["traceEvents"]


def test_profiler_off_creates_nothing(tiny, tmp_path):
    assert main(tiny("training.max_steps=2")) == 0
    assert not (tmp_path / "run" / "tensorboard").exists()


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
    assert main(tiny("training.max_steps=3", "training.compile_model=true", run="compiled")) == 0
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-4)


def inject_nan(monkeypatch, bad_steps):
    """Poison the gradients (and loss) of the given 0-based steps, as a diverging batch would."""
    real = train_mmdit_stable.forward_backward

    def forward_backward(model, batch, *args):
        loss = real(model, batch, *args)
        if int(batch["step"]) in bad_steps:
            next(model.parameters()).grad.fill_(float("nan"))
            return loss * float("nan")
        return loss

    monkeypatch.setattr(train_mmdit_stable, "forward_backward", forward_backward)


def test_nonfinite_step_is_skipped_and_counted(tiny, tmp_path, monkeypatch, caplog):
    inject_nan(monkeypatch, {1})
    assert main(tiny("training.max_steps=3", "logging.save_freq=1", "checkpoint.keep_last=5")) == 0
    assert "step 2 skipped" in caplog.text
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    (after_1, _), (after_2, meta_2), (after_3, _) = (read_checkpoint(p) for p in ckpts)
    for stem in ("model", "ema", "optimizer"):  # nothing applied at the skipped step
        assert all(torch.equal(after_1[stem][k], after_2[stem][k]) for k in after_1[stem]), stem
    assert not all(torch.equal(after_2["model"][k], after_3["model"][k]) for k in after_2["model"])
    assert all(torch.isfinite(v).all() for v in after_3["model"].values())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows if "loss" in r] == [0, 1, 1]


def test_nonfinite_steps_in_a_row_stop_the_run(tiny, tmp_path, monkeypatch, caplog):
    inject_nan(monkeypatch, set(range(2, 100)))
    assert main(tiny("training.max_steps=50", "training.max_nonfinite_steps=3", "logging.save_freq=2")) == 1
    assert "3 non-finite steps in a row up to step 5" in caplog.text and "step_00000002" in caplog.text
