"""`make selfcheck` on a CPU machine: rows that run are measured, rows that cannot run here are named with the
reason, and a failing row is reported as failed with the command exiting non-zero."""

import json

import torch

from benchmarks import selfcheck


def test_selfcheck_measures_rows_and_names_what_it_cannot_run(tmp_path):
    rows = ["fp32, sdpa", "DDP", "bf16, flash-attn", "FSDP, CPU offload", "OOM sizer, real allocation failure"]
    assert selfcheck.main(["--rows", *rows, "--steps", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "selfcheck.json").read_text())["rows"]
    for name in ("fp32, sdpa", "DDP"):
        row = report[name]
        assert row["status"] == "passed" and row["host_syncs_per_step"] == 0, row
        assert row["step_s"] > 0 and row["images_per_s"] > 0 and row["peak_memory_gib"] > 0
    assert report["DDP"]["processes"] == 2  # two gloo processes where there is no GPU
    for name in rows[2:]:
        assert report[name] == {"status": "not runnable", "reason": "needs a CUDA GPU"}, report[name]
    table = (tmp_path / "selfcheck.md").read_text()
    assert "| fp32, sdpa | passed |" in table and "| bf16, flash-attn | not runnable here: needs a CUDA GPU |" in table
    assert next(line for line in table.splitlines() if line.startswith("| fp32, sdpa |")).endswith("| its own run |")


def test_a_failing_row_is_reported_and_fails_the_command(tmp_path):
    assert selfcheck.main(["--rows", "fp32, sdpa", "--steps", "2", "--out", str(tmp_path),
                           "--overrides", "model.num_layers=0"]) == 1
    row = json.loads((tmp_path / "selfcheck.json").read_text())["rows"]["fp32, sdpa"]
    assert row["status"] == "failed" and "model.num_layers must be > 0, got 0" in row["error"], row
    assert "| fp32, sdpa | FAILED: " in (tmp_path / "selfcheck.md").read_text()
    assert (tmp_path / "fp32__sdpa" / "log.txt").is_file()


def test_on_a_gpu_speed_rows_are_measured_on_device_batches_at_a_real_size(monkeypatch):
    """The plumbing only (no GPU here): a speed row asks benchmarks/train_step.py for SD3-medium at 512 px with the
    row's precision/attention/compile/checkpointing settings over the eager fp32 base; other rows keep their run's."""
    from benchmarks import train_step
    asked = []

    def measure(row, size, steps, warmup, device, resolution):
        asked.append((row.model, list(row.variant.overrides), size, resolution))
        return {"status": "passed", "step_s": 0.5, "images_per_s": 8.0, "mfu": 0.4, "peak_memory_gib": 30.0,
                "host_syncs_per_step": 0, "micro_batch": 4}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(train_step, "measure", measure)
    rows = {row.name: row for row in selfcheck.ROWS}
    row = rows["compile + activation checkpointing"]
    speed = selfcheck.device_batch_speed(row, [*selfcheck.SIZES["medium"], *row.overrides])
    assert asked == [("sd3-medium", ["training.dtype=fp32", "compile.enabled=false",
                                     "training.activation_checkpointing=none", "training.attention_backend=sdpa",
                                     "compile.enabled=true", "training.activation_checkpointing=full"], "real", 512)]
    assert speed["step_s"] == 0.5 and speed["speed_from"] == "sd3-medium 512 px, micro-batch 4, device batches"
    assert selfcheck.device_batch_speed(rows["DDP"], rows["DDP"].overrides) == {}
    monkeypatch.setattr(train_step, "measure", lambda *a: {"status": "failed", "error": "out of memory"})
    assert selfcheck.device_batch_speed(rows["fp32, sdpa"], []) == {
        "speed_from": "its own run (the device-batch benchmark: out of memory)"}
