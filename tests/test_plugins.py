"""The plugins that ship with the foundation: each trains like the plain loop, within a stated tolerance, and
each fails the way it says it does."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch._dynamo.utils import counters

import train_mmdit_stable
from configs.schema import load_config
from errors import ConfigError
from perf.checkpoint import checkpoints
from tests.conftest import assert_close, assert_differs, checkpoint_state, final_weights, losses, metric_rows
from tests.test_families import checkpointing_model
from train_mmdit_stable import main


@pytest.mark.parametrize("dtype,tolerance", [("bf16", 0.05), ("fp16", 0.01)])
def test_mixed_precision_trains_like_fp32(tiny, tmp_path, dtype, tolerance):
    """Autocast changes rounding only: the first losses agree within the dtype's tolerance (bf16 has an
    8-bit mantissa, fp16 10 bits)."""
    assert main(tiny("training.max_steps=3", run="fp32")) == 0
    assert main(tiny("training.max_steps=3", f"training.dtype={dtype}", run=dtype)) == 0
    assert losses(tmp_path / dtype) == pytest.approx(losses(tmp_path / "fp32"), rel=tolerance)


def test_compiled_training_matches_eager(tiny, tmp_path):
    """The blocks compiled in place train like eager ones: the weights after 3 steps within 1e-5 (a wrong graph
    would be off by whole learning-rate steps, 2e-3 here; Adam's eps is raised so that rounding in near-zero
    gradients is not blown up into whole steps). Dynamo's capture and AOTAutograd's forward and backward
    graphs are the ones inductor would get; the backend is aot_eager because inductor's CPU code generation
    takes 40 s per block on a cold cache, as in CI, and is not what GPU users run (Triton: `make selfcheck`'s
    compile row). Measured with inductor and one block: 2-4e-7."""
    steps = ["training.max_steps=3", "optimizer.eps=1e-3"]
    assert main(tiny(*steps, run="eager")) == 0
    counters.clear()
    assert main(tiny(*steps, "compile.enabled=true", "compile.backend=aot_eager", run="compiled")) == 0
    assert counters["stats"]["unique_graphs"] >= 2  # it really compiled: both kinds of block
    assert {r["compile/eager_fallbacks"] for r in metric_rows(tmp_path / "compiled") if "loss" in r} == {0}
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-4)
    assert_close(final_weights(tmp_path / "compiled"), final_weights(tmp_path / "eager"), atol=1e-5)


def test_deterministic_kernels_train_like_the_default_and_are_switched_per_run(tiny, tmp_path, monkeypatch):
    """training.deterministic: torch's deterministic mode (and cuBLAS's workspace setting) for the run; CPU
    kernels repeat anyway, so the weights are bitwise those of the default run, and the next run without it
    turns the mode off again."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    modes, real_train = [], train_mmdit_stable.train
    monkeypatch.setattr(train_mmdit_stable, "train", lambda *args: modes.append(
        torch.are_deterministic_algorithms_enabled()) or real_train(*args))
    assert main(tiny("training.max_steps=3", "training.deterministic=true", run="deterministic")) == 0
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert main(tiny("training.max_steps=3", run="default")) == 0
    assert modes == [True, False] and not torch.are_deterministic_algorithms_enabled()
    assert_close(final_weights(tmp_path / "deterministic"), final_weights(tmp_path / "default"))


def test_a_failed_compilation_falls_back_to_eager(tiny, tmp_path, monkeypatch, caplog):
    """The graphs the backend failed on run eagerly (the eager run's numbers, bit for bit), and the run says how
    many: a warning, and `compile/eager_fallbacks` in every metrics line of a compiled run (an eager run has no such
    key; test_compiled_training_matches_eager: 0 where every graph compiled)."""
    calls = []

    def broken_backend(graph, example_inputs, **kwargs):
        calls.append(graph)
        raise RuntimeError("injected compiler failure")

    monkeypatch.setattr("perf.compile.torch_backend", lambda name, mode: broken_backend)
    assert main(tiny("training.max_steps=3", run="eager")) == 0
    assert main(tiny("training.max_steps=3", "compile.enabled=true", run="broken")) == 0
    assert calls, "the compiler was asked and failed"
    assert "backend failed on a graph (RuntimeError: injected compiler failure); it runs eagerly" in caplog.text
    assert losses(tmp_path / "broken") == losses(tmp_path / "eager")  # then ran eagerly, bit for bit
    assert_close(final_weights(tmp_path / "broken"), final_weights(tmp_path / "eager"))
    fallbacks = {run: [r.get("compile/eager_fallbacks") for r in metric_rows(tmp_path / run) if "loss" in r]
                 for run in ("eager", "broken")}
    assert fallbacks == {"eager": [None] * 3, "broken": [len(calls)] * 3} and len(calls) >= 2  # both block kinds


def test_activation_checkpointing_names_a_mode_it_does_not_have():
    with pytest.raises(ValueError, match="activation checkpointing mode 'mlp', expected one of"):
        checkpointing_model("mlp", 1)


def test_the_old_integer_checkpointing_setting_is_named_with_what_it_meant(tmp_path):
    """Given by a user: refused with its translation; in a run's saved config from before: read as it meant."""
    with pytest.raises(ConfigError, match="training.activation_checkpointing=full, "
                                          "training.activation_checkpointing_every=2 is what 2 meant"):
        load_config(overrides=["training.activation_checkpointing=2"])
    saved = tmp_path / "config.yaml"
    saved.write_text("training:\n  activation_checkpointing: 2\n")
    training = load_config(saved, resolve=False).training
    assert (training.activation_checkpointing, training.activation_checkpointing_every) == ("full", 2)
    saved.write_text("training:\n  activation_checkpointing: 0\n")
    assert load_config(saved, resolve=False).training.activation_checkpointing == "none"


def test_the_removed_mlp_checkpointing_is_named_with_what_to_use(tmp_path):
    """Given by a user: refused, naming the replacements; in a run's saved config: full, which computes the same
    gradients in less memory, so the run resumes."""
    with pytest.raises(ConfigError, match="training.activation_checkpointing=mlp was removed .*use selective"):
        load_config(overrides=["training.activation_checkpointing=mlp"])
    saved = tmp_path / "config.yaml"
    saved.write_text("training:\n  activation_checkpointing: mlp\n  activation_checkpointing_every: 2\n")
    training = load_config(saved, resolve=False).training
    assert (training.activation_checkpointing, training.activation_checkpointing_every) == ("full", 2)


def test_compile_and_activation_checkpointing_compose(tiny, tmp_path):
    """With selective checkpointing on, the blocks still run compiled: dynamo captures graphs that contain the
    checkpointed region and its policy (wrapping a block's forward in functools.partial(checkpoint, ...) compiled
    nothing). aot_eager traces the graphs inductor would get and runs their (decomposed) ops: eager's weights within
    1e-7 (measured 9e-11 with full checkpointing, whose compiled blocks tests/test_distributed.py also trains)."""
    results = {}
    for name, overrides in {"eager": [], "compiled": ["compile.enabled=true", "compile.backend=aot_eager"]}.items():
        counters.clear()
        assert main(tiny("training.max_steps=2", "optimizer.eps=1e-3", "training.activation_checkpointing=selective",
                         *overrides, run=name)) == 0
        results[name] = {**counters["stats"], "graph breaks": sum(counters["graph_break"].values())}
    assert results["eager"] == {"graph breaks": 0}
    assert results["compiled"]["unique_graphs"] >= 1 and results["compiled"]["calls_captured"] >= 2
    assert results["compiled"]["graph breaks"] == 0  # each block one graph (compiled with fullgraph=True)
    assert_close(final_weights(tmp_path / "compiled"), final_weights(tmp_path / "eager"), atol=1e-7)


def inject_nan(monkeypatch, bad_steps, value=float("nan")):
    """Poison the gradients (and loss) of the given 0-based steps, as a diverging batch (NaN) or an fp16
    overflow (inf) would."""
    real = train_mmdit_stable.forward_backward

    def forward_backward(model, batch, *args):
        loss = real(model, batch, *args)
        if batch["step"] in bad_steps:
            next(model.parameters()).grad.fill_(value)
            return loss * value
        return loss

    monkeypatch.setattr(train_mmdit_stable, "forward_backward", forward_backward)


def test_a_nonfinite_step_is_skipped_on_the_device_and_counted(tiny, tmp_path, monkeypatch, caplog):
    inject_nan(monkeypatch, {1})
    assert main(tiny("training.max_steps=3", "checkpoint.every=1", "checkpoint.keep_last=5")) == 0
    assert "step 2 skipped: non-finite gradient norm" in caplog.text
    after_1, after_2, after_3 = (checkpoint_state(p) for p in checkpoints(tmp_path / "run"))
    assert_close(after_2, after_1)  # weights, EMA and AdamW state (its step count too): nothing applied
    assert_differs(after_3["model"], after_2["model"])
    assert all(torch.isfinite(v).all() for v in after_3["model"].values())
    rows = metric_rows(tmp_path / "run")
    assert [r["skipped_steps"] for r in rows if "loss" in r] == [0, 1, 1]


def test_nonfinite_steps_in_a_row_stop_the_run(tiny, tmp_path, monkeypatch, caplog):
    inject_nan(monkeypatch, set(range(2, 100)))
    assert main(tiny("training.max_steps=50", "training.max_nonfinite_steps=3", "checkpoint.every=2")) == 1
    assert "3 non-finite steps in a row up to step 5" in caplog.text and "step_00000002" in caplog.text


def test_an_fp16_overflow_is_skipped_and_lowers_the_loss_scale(tiny, tmp_path, monkeypatch):
    inject_nan(monkeypatch, {1}, value=float("inf"))
    assert main(tiny("training.max_steps=3", "training.dtype=fp16", "checkpoint.every=1",
                     "checkpoint.keep_last=5")) == 0
    first, second, _ = checkpoints(tmp_path / "run")
    assert_close(checkpoint_state(second, ("model",)), checkpoint_state(first, ("model",)))
    scales = []
    for path in (first, second):
        state = {"scaler": torch.amp.GradScaler("cpu").state_dict()}
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        scales.append(state["scaler"]["scale"])
    assert scales[1] == scales[0] / 2  # GradScaler backoff
    rows = metric_rows(tmp_path / "run")
    assert [r["skipped_steps"] for r in rows if "loss" in r] == [0, 1, 1]


def test_each_step_runs_one_forward_and_backward_per_micro_step(tiny, monkeypatch):
    """With every plugin off a step does `accumulation` forwards and backwards, and nothing else: the per-step
    difference between a 4-step and a 2-step run (host synchronisations: tests/test_host_syncs.py)."""
    import configs.build as build

    def count(steps: int) -> dict:
        counts = {"forward": 0, "backward": 0}
        real_build, real_backward = build.build_model, torch.Tensor.backward

        def build_model(*args):
            model = real_build(*args)
            model.transformer.register_forward_pre_hook(lambda *_: counts.__setitem__("forward", counts["forward"] + 1))
            return model

        def backward(*args, **kwargs):
            counts["backward"] += 1
            return real_backward(*args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(build, "build_model", build_model)  # the trained model (not the meta copy that counts FLOPs)
            m.setattr(torch.Tensor, "backward", backward)
            assert main(tiny(f"training.max_steps={steps}", "training.gradient_accumulation_steps=2",
                             "logging.log_every=1000", "sampling.steps=1", run=f"steps{steps}")) == 0
        return counts

    short, long = count(2), count(4)
    assert {k: (long[k] - short[k]) / 2 for k in long} == {"forward": 2, "backward": 2}
