"""optimizer.name and optimizer.schedule (optim/optimizers.py, optim/schedule.py): each optimizer trains with its own
state and the schedule's learning rates, resumes bit for bit after a SIGKILL, and composes with the OOM splitter;
under FSDP only adamw trains (tests/test_families.py), the others are refused with the reason; the memory plan counts
each one's state to the byte; a missing package or prodigy far from lr 1 is refused before anything is written."""

import importlib.util

import pytest
import torch

from configs.build import build_data, build_model
from configs.schema import load_config
from optim.optimizers import build_optimizer, state_bytes
from optim.schedule import learning_rate
from runtime.step_stats import local_bytes
from tests.conftest import TINY, assert_close, final_weights, metric_rows, randomize, sigkill_after
from train_mmdit_stable import main

LR = {"adamw": 2e-3, "adamw8bit": 2e-3, "prodigy": 1.0, "adafactor": 1e-2}
KEPT = {"adamw": "exp_avg_sq", "adamw8bit": "codes", "prodigy": "p0", "adafactor": "row_var"}  # each one's own state
PAIRS = [("adamw", "linear"), ("adamw8bit", "constant_with_warmup"), ("prodigy", "cosine"), ("adafactor", "constant")]


def run(name: str, schedule: str, *extra: str) -> list[str]:
    return [*TINY, f"optimizer.name={name}", f"optimizer.schedule={schedule}", f"optimizer.lr={LR[name]}",
            "training.max_steps=4", *extra]


def test_schedules():
    lr = lambda schedule, step: learning_rate(schedule, step, 1.0, 10, 110, 0.1)  # noqa: E731
    assert [lr("constant", s) for s in (0, 5, 200)] == [1.0, 1.0, 1.0]
    assert [lr("constant_with_warmup", s) for s in (0, 9, 60, 200)] == [0.1, 1.0, 1.0, 1.0]
    assert [lr("linear", s) for s in (0, 9, 10, 60, 110, 200)] == pytest.approx([0.1, 1.0, 1.0, 0.55, 0.1, 0.1])
    assert [lr("cosine", s) for s in (0, 9, 60, 110)] == pytest.approx([0.1, 1.0, 0.55, 0.1])
    assert lr("cosine", 35) > lr("linear", 35)  # the cosine's slow start


@pytest.mark.parametrize("name,schedule", PAIRS)
def test_a_run_killed_with_sigkill_resumes_bit_for_bit(name, schedule, tmp_path):
    """Model, EMA and optimizer state (8-bit codes and scales, prodigy's step-size estimate in its groups) after a
    SIGKILL and a resume equal the uninterrupted run's bit for bit; its learning rates are the schedule's."""
    assert main(run(name, schedule, f"logging.output_dir={tmp_path / 'straight'}")) == 0
    killed = run(name, schedule, "checkpoint.every=2", f"logging.output_dir={tmp_path / 'killed'}")
    sigkill_after(killed, "step_00000002 complete", tmp_path / "killed.log")
    assert main(killed) == 0
    for part in ("model", "ema", "optimizer"):
        assert_close(final_weights(tmp_path / "killed", part), final_weights(tmp_path / "straight", part))
    state = final_weights(tmp_path / "straight", "optimizer")
    assert any(key.endswith(f".{KEPT[name]}") for key in flatten_keys(state))
    lrs = [row["lr"] for row in metric_rows(tmp_path / "straight") if "lr" in row]
    assert lrs == pytest.approx([learning_rate(schedule, s, LR[name], 2, 4, 0.02) for s in range(4)], rel=1e-6)


def flatten_keys(tree, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict):
        return [prefix]
    return [k for key, value in tree.items() for k in flatten_keys(value, f"{prefix}.{key}")]


@pytest.mark.parametrize("name", ["adamw8bit", "prodigy", "adafactor"])
def test_the_oom_splitter_keeps_each_optimizers_step(name, tmp_path):
    """An out-of-memory error in the last block halves the micro-batch and redoes the step: the weights of the
    unsplit run, to fp32 summation order (adamw: tests/test_families.py)."""
    assert main(run(name, "cosine", "training.max_steps=3", f"logging.output_dir={tmp_path / 'plain'}")) == 0
    assert main(run(name, "cosine", "training.max_steps=3", "batch_sizer.enabled=true", "batch_sizer.debug_oom_above=4",
                    "batch_sizer.debug_oom_module=transformer.transformer_blocks.1",
                    f"logging.output_dir={tmp_path / 'split'}")) == 0
    assert [r["micro_batch"] for r in metric_rows(tmp_path / "split") if "micro_batch" in r] == [4, 4, 4]
    assert_close(final_weights(tmp_path / "split"), final_weights(tmp_path / "plain"), atol=2e-4, mean_atol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "prodigy", "adafactor"])
def test_the_memory_plan_counts_each_optimizers_state(name):
    """The bytes of state the plan counts for the trained parameters' shapes are those each optimizer holds after a
    step (its moments, factors, codes and scales; not the per-parameter step counters)."""
    cfg = load_config(overrides=run(name, "cosine"))
    model = build_model(cfg, *build_data(cfg))
    randomize(model, 0)  # prodigy keeps a scalar, not a copy, for a weight that starts at zero
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"), {}, warmup=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    held = local_bytes(t for state in optimizer.state.values() for t in state.values()
                       if isinstance(t, torch.Tensor) and t.dim())
    assert held == state_bytes(name, [tuple(p.shape) for p in model.parameters()])
    weight = [(128, 32)]
    assert state_bytes("adafactor", weight) < state_bytes("adamw8bit", weight) < state_bytes("adamw", weight) \
        < state_bytes("prodigy", weight)


@pytest.mark.parametrize("extra,said", [
    (["optimizer.name=prodigy", "optimizer.lr=1e-4"], "optimizer.lr=0.0001 with optimizer.name=prodigy: prodigy "
                                                      "estimates the step size itself"),
    (["optimizer.name=adamw8bit", "parallel.strategy=fsdp"], "optimizer.name=adamw8bit with parallel.strategy=fsdp: "
                                                             "torchao quantizes the moments in blocks"),
    (["optimizer.name=prodigy", "optimizer.lr=1", "parallel.strategy=hsdp"], "FSDP2's DTensor shards refuse"),
    (["optimizer.name=adafactor", "parallel.strategy=fsdp"], "torch's Adafactor fails on FSDP2's DTensor shards"),
    (["optimizer.name=prodigy", "optimizer.lr=1", "missing=prodigyopt"], "optimizer.name=prodigy needs the prodigyopt "
                                                                         "package: pip install prodigyopt"),
    (["optimizer.name=adamw8bit", "missing=torchao"], "needs the torchao package: pip install torchao"),
])
def test_bad_optimizer_settings_are_named_before_anything_is_written(extra, said, tmp_path, caplog, monkeypatch):
    missing = [e.removeprefix("missing=") for e in extra if e.startswith("missing=")]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else find_spec(name, *a))
    overrides = [e for e in extra if not e.startswith("missing=")]
    assert main([*TINY, *overrides, f"logging.output_dir={tmp_path / 'run'}"]) == 2
    assert said in caplog.text and not (tmp_path / "run").exists()


def test_a_resume_with_another_optimizer_is_refused(tmp_path, caplog):
    first = [*TINY, "training.max_steps=1", f"logging.output_dir={tmp_path / 'run'}"]
    assert main(first) == 0
    assert main([*first, "training.max_steps=2", "optimizer.name=adafactor", "optimizer.lr=1e-2"]) == 2
    assert "optimizer.name: adamw -> adafactor" in caplog.text
