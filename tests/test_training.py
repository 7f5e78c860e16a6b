"""The training loop end to end in one process: determinism, the micro-batch split, the run directory
(resume, refusal, fall-back), checkpoint failures and a disk that fills up mid-run (that one in a process of
its own), and the sampler and export around it."""

import errno
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import sample_mmdit
from configs.build import build_model, build_tokenizer
from configs.run_dir import save_run_config
from configs.schema import load_config
from data.shapes import ShapesDataset
from errors import ConfigError
from models.rectified_flow import draw_sample_noise, interpolate, per_sample_loss
from perf.checkpoint import checkpoints, read_checkpoint, verify
from tests.conftest import (ROOT, SYSFS_NEW, TIMEOUT_S, assert_close, checkpoint_disk_full, final_weights, losses,
                            metric_rows)
from train_mmdit_stable import main


def test_loss_falls_when_overfitting_one_batch():
    cfg = load_config(overrides=["model.patch_size=4", "model.num_layers=2", "model.num_attention_heads=2",
                                 "model.attention_head_dim=16", "text_encoder.dim=32", "text_encoder.num_heads=2"])
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = build_model(cfg, ShapesDataset, tokenizer)
    ds = ShapesDataset(100, seed=0)
    items = [ds[i] for i in range(8)]
    x0 = torch.stack([it["latents"] for it in items])
    text = tokenizer([it["caption"] for it in items])
    draws = draw_sample_noise(0, 0, torch.arange(8), (3, 32, 32))  # one fixed batch: same noise every step
    sigma = torch.full((8,), 0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    history = []
    for _ in range(100):
        loss = per_sample_loss(model(interpolate(x0, draws.noise, sigma), sigma, text), x0, draws.noise).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
    assert history[-1] < 0.4 * history[0], history[::10]


def test_same_seed_same_steps_bit_for_bit(tiny, tmp_path):
    assert main(tiny("training.max_steps=3", run="a")) == 0
    assert main(tiny("training.max_steps=3", run="b")) == 0
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert_close(final_weights(tmp_path / "a"), final_weights(tmp_path / "b"))
    assert main(tiny("training.max_steps=3", "training.seed=1", run="c")) == 0
    assert losses(tmp_path / "c") != losses(tmp_path / "a")


def test_micro_batch_split_does_not_change_the_math(tiny, tmp_path):
    """Global batch 16 as 1x16, 2x8 and 4x4 micro-batches: per-sample noise is keyed by position in the
    global batch, so only fp32 summation order differs."""
    runs = {"1x16": ["training.train_batch_size=16"],
            "2x8": ["training.train_batch_size=8", "training.gradient_accumulation_steps=2"],
            "4x4": ["training.train_batch_size=4", "training.gradient_accumulation_steps=4"]}
    for name, overrides in runs.items():
        assert main(tiny("training.max_steps=3", *overrides, run=name)) == 0
    ref = final_weights(tmp_path / "1x16")
    for name in ("2x8", "4x4"):
        # Adam normalises updates, so a summation-order difference in a near-zero gradient can move a weight
        # by up to one step (lr 2e-3); a real change of the math would move every weight by that much.
        assert_close(final_weights(tmp_path / name), ref, atol=2e-4, mean_atol=1e-7)
        assert losses(tmp_path / name) == pytest.approx(losses(tmp_path / "1x16"), rel=1e-5)


def test_run_directory_resume_and_sampling(tiny, tmp_path, caplog):
    run_dir = tmp_path / "run"
    command = tiny("training.max_steps=4", "checkpoint.every=2", "validation.every=2", "validation.at_end=true")
    assert main(command) == 0
    assert [p.name for p in checkpoints(run_dir)] == ["step_00000002", "step_00000004"]
    assert (run_dir / "config.yaml").is_file() and (run_dir / "validation.json").is_file()
    assert (run_dir / "samples" / "step_00000002.png").is_file() and (run_dir / "samples" / "step_00000004.png").is_file()
    assert set(json.loads((run_dir / "validation.json").read_text())) == {"step", "fidelity/color", "fidelity/shape",
                                                                         "fidelity/position"}
    # The same command again: finished, final validation included; nothing is redone or written.
    caplog.set_level(logging.INFO, logger="mmdit")
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    assert main(command) == 0
    assert f"{run_dir} is already finished at step 4: nothing to do (raise training.max_steps" in caplog.text
    assert before == {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}

    # Interrupted after step 4 of 6 and resumed: the same weights as the uninterrupted run, bit for bit.
    assert main(tiny("training.max_steps=6", "checkpoint.every=2", run="straight")) == 0
    straight = final_weights(tmp_path / "straight")
    shutil.rmtree(checkpoints(tmp_path / "straight")[-1])
    assert checkpoints(tmp_path / "straight")[-1].name == "step_00000004"
    assert main(tiny("training.max_steps=6", "checkpoint.every=2", run="straight")) == 0
    assert_close(final_weights(tmp_path / "straight"), straight)
    # the redone steps' rows replaced the first attempt's: each step once, in order
    assert [r["step"] for r in metric_rows(tmp_path / "straight") if "loss" in r] == [1, 2, 3, 4, 5, 6]

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle in the top left\na blue square in the center\n")
    assert sample_mmdit.main(["--checkpoint", str(run_dir), "--prompts", str(prompts), "--out", str(tmp_path / "out"),
                              "--steps", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["0000.png", "0001.png"]
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    assert sample_mmdit.main(["--checkpoint", str(run_dir), "--prompts", str(prompts), "--out", str(tmp_path / "out"),
                              "--steps", "2"]) == 2  # as export: an existing folder is never written into
    assert f"sample: {tmp_path / 'out'} exists; write into a new directory (nothing was overwritten)" in caplog.text
    assert before == {p: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}


def test_run_directory_of_another_model_is_refused_untouched(tiny, tmp_path, caplog):
    run_dir = tmp_path / "run"
    assert main(tiny("training.max_steps=1")) == 0
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    assert main(tiny("training.max_steps=1", "model.num_layers=3", "training.seed=5")) == 2
    assert "model.num_layers: 2 -> 3" in caplog.text and "training.seed: 0 -> 5" in caplog.text  # each, old -> new
    assert "output_dir" in caplog.text
    assert before == {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}


def test_a_run_config_the_disk_refuses_leaves_the_last_one_whole(tmp_path, monkeypatch):
    """config.yaml records what the directory's checkpoints mean: a full disk that takes only part of the new one
    must leave the last one as it was, and the start stops in one line naming the directory and the reason."""
    save_run_config(tmp_path, load_config(), world_size=1)
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}
    real_write_text = Path.write_text

    def disk_full(path: Path, text: str, *args, **kwargs):
        real_write_text(path, text[:100], *args, **kwargs)  # what fitted
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(ConfigError) as info:
        save_run_config(tmp_path, load_config(overrides=["optimizer.lr=1e-3"]), world_size=1)
    assert str(info.value) == (f"logging.output_dir={tmp_path}: cannot create or write into {tmp_path}: No space left "
                               f"on device")
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before


def test_sampler_rejects_unknown_words_and_missing_checkpoints(tiny, tmp_path, caplog):
    assert main(tiny("training.max_steps=1")) == 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a purple circle in the center\n")  # the user's input: one line, exit 2
    assert sample_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--prompts", str(prompts), "--out",
                              str(tmp_path / "o")]) == 2
    assert "purple" in caplog.text
    assert sample_mmdit.main(["--checkpoint", str(tmp_path), "--prompts", str(prompts), "--out", str(tmp_path / "o")]) == 2
    assert "complete checkpoint" in caplog.text
    if Path("/sys/kernel").is_dir():  # an output folder no one can write (sysfs): refused before sampling
        prompts.write_text("a red circle in the center\n")
        assert sample_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--prompts", str(prompts), "--out",
                                  str(SYSFS_NEW / "o")]) == 2
        assert f"--out {SYSFS_NEW / 'o'}: cannot create or write into {SYSFS_NEW}: " in caplog.text  # its new parent


def test_failed_checkpoint_write_leaves_training_running(tiny, tmp_path, monkeypatch, caplog):
    checkpoint_disk_full(monkeypatch, "step_00000004")
    assert main(tiny("training.max_steps=6", "checkpoint.every=2", "checkpoint.keep_last=5")) == 0
    assert "checkpoint of step 4" in caplog.text and "No space left on device" in caplog.text
    assert [p.name for p in checkpoints(tmp_path / "run")] == ["step_00000002", "step_00000006"]


def test_failed_final_checkpoint_is_an_error_exit(tiny, tmp_path, monkeypatch):
    checkpoint_disk_full(monkeypatch, "step_00000003")
    assert main(tiny("training.max_steps=3")) == 1
    assert checkpoints(tmp_path / "run") == []


def test_a_disk_that_fills_up_mid_run_costs_outputs_not_the_run(tiny, tmp_path):
    """A real full disk: a 4 MiB tmpfs, in a mount namespace of its own, that another writer fills as soon as the
    checkpoint of step 2 is complete and frees at step 9. Every output that fails says so with the path and the
    reason, training goes on, metrics.jsonl is written again once there is space, and the run ends with exit 1
    because its final checkpoint (which needs more than the disk has) was not written; the checkpoint of step 2
    stays intact and no temporary checkpoint directory is left."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare here to mount a tmpfs in a namespace of the test's own")
    refusals = []
    for unshare in [["unshare", "-m"]] * (os.geteuid() == 0) + [["unshare", "-rm"]]:  # -r: root in a user namespace
        probe = subprocess.run([*unshare, "mount", "-t", "tmpfs", "tmpfs", str(tmp_path)], capture_output=True,
                               text=True)
        if probe.returncode == 0:
            break
        refusals.append(f"{shlex.join(unshare)}: {probe.stderr.strip()}")
    else:
        pytest.skip(f"mounting a tmpfs is not permitted here ({'; '.join(refusals)})")
    disk, copy = tmp_path / "disk", tmp_path / "copy"
    disk.mkdir()
    run = subprocess.run([*unshare, sys.executable, "-c", "import sys; from tests.test_training import "
                          "run_on_a_disk_that_fills; run_on_a_disk_that_fills(*sys.argv[1:])", str(disk), str(copy),
                          *tiny("training.max_steps=10", "checkpoint.every=2", "validation.every=5",
                                "profiler.enabled=true", "profiler.skip_first=4", "profiler.active_steps=1",
                                run="disk/run")],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    said, run_dir = run.stdout, disk / "run"
    assert run.returncode == 1, said
    full = "(OSError: [Errno 28] No space left on device)"
    assert said.count(f"TensorBoard: could not write {run_dir / 'tensorboard'} {full}") == 1, said  # then off
    assert said.count(f"sample grid: could not write {run_dir / 'samples' / 'step_00000005.png'} {full}") == 1
    assert f"profiler trace: could not write {run_dir / 'tensorboard' / 'rank0.'}" in said  # the trace of step 7
    # a shorter row (the validation's) may fit where a longer one did not: metrics.jsonl may recover before step 10
    assert f"metrics.jsonl: could not write {run_dir / 'metrics.jsonl'} {full}" in said
    assert "metrics.jsonl: written again" in said
    for step in (4, 6, 8, 10):
        assert (f"checkpoint of step {step} into {run_dir / 'checkpoints'} failed: rank 0: OSError: [Errno 28] No "
                f"space left on device") in said
    assert said.rstrip().endswith("the final checkpoint was not written; exiting with an error") and \
        "Traceback" not in said
    assert [p.name for p in (copy / "checkpoints").iterdir()] == ["step_00000002"]
    assert verify(copy / "checkpoints" / "step_00000002") is None
    steps = [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text().splitlines()]  # every line
    assert steps[:2] == [1, 2] and steps[-1] == 10 and len(steps) < 10 and steps == sorted(steps)
    assert not (copy / "samples").exists() or not list((copy / "samples").iterdir())  # no cut picture


def run_on_a_disk_that_fills(disk: str, copy_to: str, *overrides: str) -> None:
    """main(overrides) on a 4 MiB tmpfs mounted at `disk` (in this process's own mount namespace), which another
    writer fills once the checkpoint of step 2 is complete and frees at step 9; then the run directory is copied
    to `copy_to` (the tmpfs goes with the namespace), and the process exits with the run's status."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", disk], check=True)
    ballast = Path(disk) / "ballast"

    class OtherWriter(logging.Handler):  # runs in the thread that logs, before that thread goes on
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().endswith("step_00000002 complete"):
                fill(ballast)
            elif " 9/10 " in record.getMessage():
                ballast.unlink()

    logging.getLogger("mmdit").addHandler(OtherWriter())
    status = main(list(overrides))
    shutil.copytree(Path(disk) / "run", copy_to)
    sys.exit(status)


def fill(path: Path) -> None:
    """Zeros into `path` until the disk takes no more."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while os.write(fd, bytes(1 << 20)):
            pass
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)


def test_resume_applies_todays_optimizer_settings_and_guards_the_run(tiny, tmp_path, caplog):
    assert main(tiny("training.max_steps=2")) == 0
    # a different global batch would change which items and noise every later step sees
    assert main(tiny("training.max_steps=4", "training.train_batch_size=4")) == 2
    assert "global batch" in caplog.text
    # fewer steps than already trained
    assert main(tiny("training.max_steps=1")) == 2
    assert "training.max_steps" in caplog.text
    # same global batch, other split, new weight decay, fp16: resumes, and the new settings apply
    assert main(tiny("training.max_steps=3", "training.train_batch_size=4", "training.gradient_accumulation_steps=2",
                     "optimizer.weight_decay=0.05", "training.dtype=fp16")) == 0
    assert "holds no scaler state: it starts fresh" in caplog.text
    last = checkpoints(tmp_path / "run")[-1]
    decay = {"optimizer": {"param_groups": [{"weight_decay": None}, {"weight_decay": None}]}}
    dcp.load(decay, storage_reader=dcp.FileSystemReader(last), no_dist=True)
    assert [g["weight_decay"] for g in decay["optimizer"]["param_groups"]] == [0.05, 0.0]
    scaler = {"scaler": torch.amp.GradScaler("cpu").state_dict()}
    dcp.load(scaler, storage_reader=dcp.FileSystemReader(last), no_dist=True)  # fp16 from here on: saved
    assert read_checkpoint(last, ())[1]["step"] == 3 and scaler["scaler"]["scale"] > 0


def test_sampler_validates_steps(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle in the center\n")
    with pytest.raises(SystemExit, match="2"):
        sample_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--prompts", str(prompts), "--out",
                           str(tmp_path / "o"), "--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err


def test_export_into_a_path_under_a_file_is_a_clear_error(tiny, tmp_path, caplog):
    import export_mmdit
    assert main(tiny("training.max_steps=1")) == 0
    (tmp_path / "notes.txt").write_text("keep me")
    assert export_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "notes.txt" / "x")]) == 2
    assert f"--out {tmp_path / 'notes.txt' / 'x'}: {tmp_path / 'notes.txt'} is a file, not a directory" in caplog.text
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    if Path("/sys/kernel").is_dir():  # a folder no one can write into (sysfs), named with its flag and the reason
        assert export_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--out", "/sys/kernel/x"]) == 2
        assert "--out /sys/kernel/x: cannot create or write into /sys/kernel: Permission denied" in caplog.text



def test_a_run_directory_of_an_earlier_version_is_refused_untouched(tiny, tmp_path, caplog):
    """Before run.json (format 1) the run directory held world.json and other checkpoints; it is refused with
    one message that says what to do, and nothing in it changes."""
    run_dir = tmp_path / "run"
    assert main(tiny("training.max_steps=1")) == 0
    (run_dir / "run.json").rename(run_dir / "world.json")
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    assert main(tiny("training.max_steps=2")) == 2
    assert "was written by an earlier version of this trainer (format 1" in caplog.text
    assert "Train into a new logging.output_dir" in caplog.text
    assert before == {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}


def test_the_other_entry_points_say_an_input_error_in_one_line(tmp_path, caplog, capsys):
    """sample, export and plan_memory: the user's input is one line and exit 2 (not a traceback, not exit 1)."""
    import export_mmdit
    import plan_memory
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    assert sample_mmdit.main(["--checkpoint", str(tmp_path), "--prompts", str(tmp_path / "none.txt"), "--out",
                              str(tmp_path / "o")]) == 2
    assert export_mmdit.main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "is neither a checkpoint directory nor a run directory" in caplog.text
    assert plan_memory.main(["--config", str(tmp_path / "none.yaml")]) == 2
    assert plan_memory.main(["--config", "configs/shapes.yaml", "training.max_stepz=3"]) == 2
    said = capsys.readouterr().err
    assert "none.yaml does not exist" in said and "max_stepz" in said and "Traceback" not in said
