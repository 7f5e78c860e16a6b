"""`make selfcheck` on a CPU machine: rows that run are measured, rows that cannot run here are named with the
reason, and a failing row is reported as failed with the command exiting non-zero."""

import json

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
