"""benchmarks/train_step.py (`make bench`). At --size tiny on this CPU every row of the table runs to its end, the
compiled ones included (one test per row, one step each, with dynamo's capture as the compile backend: each block
is one graph, as inductor would get it. AOTAutograd's trace of each block kind and checkpointing mode is the
compile tests' (tests/test_plugins.py, tests/test_flux_plugins.py, tests/test_host_syncs.py); the whole table with
aot_eager is `make bench ARGS="--size tiny"`), and every measured column is filled; rows this machine cannot run
are listed with the reason. A row's failure is
recorded and the table goes on; the table is saved row by row and resumed, also after its command was killed
mid-row; a row starts only if its estimated time fits before --stop-after; a compiled row that ran eagerly says
so; diffusers' anchor runs the row's attention kernel."""

import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.nn.attention import SDPBackend
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import train_step
from models.rectified_flow import interpolate
from tests.conftest import ROOT

pytest.importorskip("diffusers")

GPU_ONLY = ("it needs a CUDA GPU, not cpu", "needs a GPU with float8 tensor cores")  # why a row cannot run here


def rows_of_make_test() -> list:
    """Every row; `make test` leaves to `make test-all` the 24 GB configs of a model whose other config has its row
    (the same code on an nf4 base) and the diffusers anchors of the models after the first."""
    first = train_step.all_rows()[0].model
    repeat = lambda row: row.model.endswith("-24gb") and row.model[:-5] in train_step.MODELS or \
        (row.variant.anchor and row.model != first)  # noqa: E731
    return [pytest.param(row, marks=pytest.mark.full) if repeat(row) else row for row in train_step.all_rows()]


@pytest.mark.parametrize("row", rows_of_make_test(), ids=lambda row: row.name)
def test_every_row_of_the_tiny_table_runs(row, tmp_path):
    out = tmp_path / "table.json"
    assert train_step.main(["--size", "tiny", "--steps", "1", "--warmup", "0", "--models", row.model,
                            "--variants", row.variant.name, "--overrides", "compile.backend=eager",
                            "--out", str(out)]) == 0
    [result] = json.loads(out.read_text())["rows"]
    if result["status"] == "not runnable":
        assert any(reason in result["reason"] for reason in GPU_ONLY), result
        return
    assert result["status"] == "passed", result
    assert result["step_s"] > 0 and len(result["step_s_all"]) == 1 and result["model_tflop_per_step"] > 0
    assert result["tokens_per_s"] == pytest.approx(result["images_per_s"] * (64 + 8))  # 8x8 patches + 8 text tokens
    assert result["host_syncs_per_step"] == 0 and result["graph_breaks"] == 0
    # no notes, but an anchor's of a config that checkpoints every k-th block: diffusers checkpoints every block
    assert all(row.variant.anchor and note.startswith("activation checkpointing: ours full every")
               for note in result["notes"]), result["notes"]
    assert result["eager_fallbacks"] == (0 if result["compile"] else None)  # compiled rows really compiled
    assert result["mfu"] is None and result["peak_memory_gib"] is None  # no known peak, no device allocator on a CPU


def fake_measure(failing: set[str], out, seen: list):
    """measure() without compute: records which rows ran and what the saved table held when each began."""
    def measure(row, size, steps, warmup, device, resolution, overrides):
        seen.append((row.variant.name, {r["variant"]: r["status"] for r in json.loads(out.read_text())["rows"]}))
        if row.variant.name in failing:
            return {"model": row.model, "variant": row.variant.name, "status": "failed", "error": "RuntimeError: x"}
        return {"model": row.model, "variant": row.variant.name, "status": "passed", "step_s": 1.0}
    return measure


def test_the_table_is_saved_row_by_row_and_resumed(tmp_path, monkeypatch):
    out, seen = tmp_path / "table.json", []
    monkeypatch.setattr(train_step, "measure", fake_measure({"fp32+TF32 eager"}, out, seen))
    rows = ["--models", "sd3-medium", "--variants", "bf16 eager", "fp32+TF32 eager", "diffusers eager"]
    common = ["--size", "tiny", "--steps", "1", "--warmup", "0", *rows]

    def statuses() -> dict:
        return {r["variant"]: r["status"] for r in json.loads(out.read_text())["rows"]}

    assert train_step.main([*common, "--out", str(out)]) == 1  # a row failed; the others were measured after it
    assert seen == [("diffusers eager", {"diffusers eager": "running"}),  # the headline's anchor first
                    ("bf16 eager", {"diffusers eager": "passed", "bf16 eager": "running"}),
                    ("fp32+TF32 eager", {"diffusers eager": "passed", "bf16 eager": "passed",
                                         "fp32+TF32 eager": "running"})]
    assert statuses() == {"diffusers eager": "passed", "bf16 eager": "passed", "fp32+TF32 eager": "failed"}
    seen.clear()
    assert train_step.main([*common, "--resume", str(out)]) == 1 and seen == []  # nothing left to measure
    assert train_step.main([*common, "--resume", str(out), "--redo-failed"]) == 1
    assert [name for name, _ in seen] == ["fp32+TF32 eager"]

    # a process killed during a row: measured once more, then failed without another try
    table = json.loads(out.read_text())
    killed = next(r for r in table["rows"] if r["variant"] == "bf16 eager")
    for attempts, measured in ((1, ["bf16 eager"]), (2, [])):
        killed.clear()
        killed.update(model="sd3-medium", variant="bf16 eager", status="running", attempts=attempts)
        out.write_text(json.dumps(table))
        seen.clear()
        train_step.main([*common, "--resume", str(out)])
        assert [name for name, _ in seen] == measured
    assert "stopped twice" in next(r for r in json.loads(out.read_text())["rows"]
                                   if r["variant"] == "bf16 eager")["error"]

    # --stop-after: no row starts after it; the rest is left for --resume
    seen.clear()
    assert train_step.main([*common, "--out", str(tmp_path / "later.json"), "--stop-after", "0"]) == 0
    assert seen == [] and json.loads((tmp_path / "later.json").read_text())["rows"] == []


def test_a_row_starts_only_if_its_estimate_fits_what_is_left(tmp_path, monkeypatch, capsys):
    """--stop-after: a compiled row estimated beyond it is left for --resume while a cheap row after it runs; once
    the table holds a row that took longer than estimated, later estimates grow by that ratio."""
    out, seen = tmp_path / "table.json", []
    monkeypatch.setattr(train_step, "measure", fake_measure(set(), out, seen))
    monkeypatch.setitem(train_step.COSTS, "tiny", train_step.Costs(build=10, compile=1000, step=0))
    common = ["--size", "tiny", "--steps", "1", "--warmup", "0", "--models", "sd3-medium", "--stop-after", "100",
              "--variants", "as configured", "bf16 eager"]
    assert train_step.main([*common, "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == ["sd3-medium: as configured (tier 0, ~2010 s, ~2010 s in all)",
                                                    "sd3-medium: bf16 eager (tier 1, ~10 s, ~2020 s in all)"]
    assert train_step.main([*common, "--resume", str(out)]) == 0
    assert [name for name, _ in seen] == ["bf16 eager"]
    printed = capsys.readouterr().out
    assert "sd3-medium: as configured: not started (~2010 s, " in printed and "1 rows left: continue" in printed
    [row] = json.loads(out.read_text())["rows"]
    assert row["estimated_s"] == 10 and row["seconds"] < 10

    table = json.loads(out.read_text())  # as if the row had taken 3 times its estimate
    table["rows"][0]["seconds"] = 30.0
    out.write_text(json.dumps(table))
    seen.clear()
    assert train_step.main([*common[:-2], "fp32+TF32 eager", "--stop-after", "20", "--resume", str(out)]) == 0
    assert seen == [] and "sd3-medium: fp32+TF32 eager: not started (~30 s, " in capsys.readouterr().out


def test_a_command_killed_mid_row_leaves_a_whole_table_that_resumes(tmp_path, monkeypatch):
    """The recipe's `timeout` stops a command with SIGTERM: the rows finished before stay, the one it was measuring
    is marked running, and the next command measures it again."""
    out = tmp_path / "table.json"
    args = ["--size", "tiny", "--steps", "1", "--warmup", "0", "--models", "sd3-medium", "--variants", "bf16 eager",
            "fp32+TF32 eager", "--resume", str(out)]
    command = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from benchmarks import train_step

        def measure(row, *args):
            if row.variant.name == "fp32+TF32 eager":
                time.sleep(600)
            return {{"model": row.model, "variant": row.variant.name, "status": "passed", "step_s": 1.0}}
        train_step.measure = measure
        train_step.main({args!r})""")], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and len(json.loads(out.read_text())["rows"]) == 2):  # the second row began
            assert command.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        command.terminate()
        command.wait()
    statuses = {r["variant"]: (r["status"], r["attempts"]) for r in json.loads(out.read_text())["rows"]}
    assert statuses == {"bf16 eager": ("passed", 1), "fp32+TF32 eager": ("running", 1)}
    seen = []
    monkeypatch.setattr(train_step, "measure", fake_measure(set(), out, seen))
    assert train_step.main(args) == 0 and [name for name, _ in seen] == ["fp32+TF32 eager"]
    statuses = {r["variant"]: (r["status"], r["attempts"]) for r in json.loads(out.read_text())["rows"]}
    assert statuses == {"bf16 eager": ("passed", 1), "fp32+TF32 eager": ("passed", 2)}


def test_a_table_is_resumed_only_with_its_own_settings(tmp_path, monkeypatch, capsys):
    out = tmp_path / "table.json"
    monkeypatch.setattr(train_step, "measure", fake_measure(set(), out, []))
    common = ["--size", "tiny", "--models", "sd3-medium", "--variants", "bf16 eager"]
    assert train_step.main([*common, "--steps", "1", "--out", str(out)]) == 0
    with pytest.raises(SystemExit) as exit_:
        train_step.main([*common, "--steps", "2", "--resume", str(out)])
    assert exit_.value.code == 2 and "was measured with steps 1 (this run: 2)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # a real table is never overwritten
        train_step.main(["--models", "sd3-medium", "--variants", "bf16 eager", "--out", str(out)])
    assert exit_.value.code == 2 and f"{out} exists: continue its table with --resume" in capsys.readouterr().err


def test_a_rows_failure_is_recorded_and_a_compiled_row_that_ran_eagerly_says_so(monkeypatch):
    def broken(*args):
        raise RuntimeError("injected failure\nsecond line")

    monkeypatch.setattr(train_step, "ours", broken)
    row = train_step.Row("sd3-medium", train_step.Variant("bf16 eager", ("compile.enabled=false",)))
    result = train_step.measure(row, "tiny", 1, 0, torch.device("cpu"))
    assert result["status"] == "failed" and result["error"] == "RuntimeError: injected failure"
    monkeypatch.undo()

    def broken_backend(graph, example_inputs, **kwargs):
        raise RuntimeError("injected compiler failure")

    monkeypatch.setattr("perf.compile.torch_backend", lambda name, mode: broken_backend)
    result = train_step.measure(train_step.Row("sd3-medium", train_step.Variant("as configured")), "tiny", 1, 0,
                                torch.device("cpu"))
    assert result["status"] == "passed" and result["compile"] and result["eager_fallbacks"] == 2  # both block kinds
    assert result["fallback_errors"] == ["RuntimeError: injected compiler failure"] * 2
    assert "| sd3-medium | as configured | bf16, compiled, checkpointing none | sdpa | passed |" in \
        train_step.table([result]) and train_step.table([result]).splitlines()[2].endswith("| 0 | 0 | 2 |")


class AttentionOps(TorchDispatchMode):
    """The SDPA kernels that run."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func):
            self.ops.add(str(func).split(".")[1])
        return func(*args, **(kwargs or {}))


def test_the_anchor_runs_the_rows_attention_kernel_and_says_where_it_differs(monkeypatch):
    """SD3 in diffusers calls SDPA itself: the row's SDPA kernel is forced around its whole step (forward, and its
    recompute by activation checkpointing in the backward); what diffusers cannot match is in the row's notes."""
    device, data = torch.device("cpu"), train_step.data_shapes("sd3-medium", "tiny")

    def kernels(*overrides: str) -> tuple[set, list]:
        cfg = train_step.benchmark_config("sd3-medium", ["compile.enabled=false", *overrides], "tiny")
        _, step, facts = train_step.diffusers_anchor(cfg, data, device, train_step.sd3_anchor)
        with AttentionOps() as recorded:
            step(train_step.device_batch(cfg, data, device), 0)
        return recorded.ops, facts["notes"]

    assert kernels("training.attention_backend=sdpa") == ({"_scaled_dot_product_flash_attention_for_cpu",
                                                           "_scaled_dot_product_flash_attention_for_cpu_backward"}, [])
    # a kernel SDPA would not pick on this CPU by itself: the math one (its ops decompose into matmuls)
    monkeypatch.setitem(train_step.SDPA_KERNELS, "sdpa_flash", SDPBackend.MATH)
    assert kernels("training.attention_backend=sdpa_flash") == (set(), [])
    ops, notes = kernels("training.attention_backend=flash_attn_2", "training.activation_checkpointing=full",
                         "training.activation_checkpointing_every=2")
    assert notes == ["attention: ours flash_attn_2, diffusers SDPA's own choice (its SD3 attention calls SDPA itself)",
                     "activation checkpointing: ours full every 2, diffusers every block (its only choice)"]


@pytest.mark.parametrize("name", [name for name, model in train_step.MODELS.items() if model.anchor])
def test_the_anchor_computes_our_models_velocity(name):
    """diffusers' model, driven as the anchor drives it, with our model's weights (the same keys: ours are
    diffusers'), predicts our model's velocity on the row's batch (fp32): the anchor rows time the same function."""
    cfg = train_step.benchmark_config(name, ["lora.enabled=false", "lora.base_quantization=none",
                                             "offload.blocks_to_swap=0"], "tiny")
    data = train_step.data_shapes(name, "tiny")
    ours = train_step.build_model(cfg, data).eval()
    train_step.randomize(ours)
    theirs, _, forward = train_step.MODELS[name].anchor(cfg, data, torch.device("cpu"))
    theirs.load_state_dict(ours.transformer.state_dict())
    batch = train_step.device_batch(cfg, data, torch.device("cpu"))
    x_t = interpolate(batch["latents"], batch["noise"], batch["sigma"])
    with torch.no_grad():
        expected = ours(x_t, batch["sigma"], batch["text"])
        torch.testing.assert_close(forward(x_t, batch["sigma"], batch["text"]), expected, rtol=1e-5, atol=1e-5)
    assert expected.abs().mean() > 1e-3  # not two zeros


def test_a_row_steps_the_optimizer_training_builds():
    """optimizer.name reaches the row (train_mmdit_stable.training_optimizer), and the table says which it is."""
    cpu, data, seen = torch.device("cpu"), train_step.data_shapes("sd3-medium", "tiny"), []
    cfg = train_step.benchmark_config("sd3-medium", ["compile.enabled=false", "optimizer.name=adafactor"], "tiny")
    _, step, _ = train_step.ours(cfg, data, cpu)
    handle = register_optimizer_step_post_hook(lambda o, *_: seen.append(type(o).__name__))
    try:
        step(train_step.device_batch(cfg, data, cpu), 0)
    finally:
        handle.remove()
    assert seen == ["Adafactor"] and train_step.settings(cfg).endswith(", adafactor")
