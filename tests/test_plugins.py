"""The plugins that ship with the foundation: each trains like the plain loop, within a stated tolerance."""

import json

import pytest

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
