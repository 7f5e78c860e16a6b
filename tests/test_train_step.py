"""benchmarks/train_step.py at --size tiny on a CPU: the real step runs for our model (bf16 and fp32, a LoRA run
on a quantized base) and for diffusers' anchor, every measured column is filled, and rows this machine cannot
run are listed with the reason, not dropped. (The whole tiny table, every variant, is `make bench ARGS="--size
tiny"`: minutes on a loaded 2-core machine, too long for the suite.)"""

import json

import pytest

from benchmarks import train_step

pytest.importorskip("diffusers")


def test_the_tiny_benchmark_measures_rows_and_names_what_it_cannot_run(tmp_path):
    # eager rows only: compiling costs more than the test's budget (the compiled rows are `make bench ARGS="--size
    # tiny"`; compile itself is tested in tests/test_plugins.py)
    variants = ["bf16 eager", "fp32+TF32 eager", "bf16 compiled, attention sdpa_cudnn", "float8", "diffusers eager"]
    common = ["--size", "tiny", "--steps", "2", "--warmup", "1"]
    assert train_step.main([*common, "--models", "sd3-medium", "--variants", *variants,
                            "--out", str(tmp_path / "a.json")]) == 0
    # the LoRA run on an int8 base
    assert train_step.main([*common, "--models", "sd3.5-large-lora-24gb", "--overrides", "compile.enabled=false",
                            "--out", str(tmp_path / "b.json")]) == 0
    rows = {(r["model"], r["variant"]): r for name in ("a", "b")
            for r in json.loads((tmp_path / f"{name}.json").read_text())["rows"]}
    measured = [("sd3-medium", "bf16 eager"), ("sd3-medium", "fp32+TF32 eager"),
                ("sd3-medium", "diffusers eager"), ("sd3.5-large-lora-24gb", "as configured")]
    for key in measured:
        row = rows[key]
        assert row["status"] == "passed", row
        assert row["step_s"] > 0 and len(row["step_s_all"]) == 2 and row["images_per_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(row["images_per_s"] * (64 + 8))  # 8x8 patches + 8 text tokens
        assert row["model_tflop_per_step"] > 0 and row["host_syncs_per_step"] == 0 and row["graph_breaks"] == 0
        assert row["mfu"] is None and row["peak_memory_gib"] is None  # no known peak, no device allocator on a CPU
    # model FLOPs are the architecture's: the same in any precision, and for diffusers' model (counted on ours)
    flops = [rows[key]["model_tflop_per_step"] for key in measured[:3]]
    assert flops[0] == flops[1] == pytest.approx(flops[2], rel=1e-3)
    cudnn = rows[("sd3-medium", "bf16 compiled, attention sdpa_cudnn")]
    assert cudnn["status"] == "not runnable" and cudnn["reason"] == ("training.attention_backend=sdpa_cudnn cannot "
                                                                     "run here: it needs a CUDA GPU, not cpu")
    float8 = rows[("sd3-medium", "float8")]
    assert float8["status"] == "not runnable" and ("float8" in float8["reason"])
