"""Validation: held-out items never train, the held-out loss is a deterministic curve, flips follow (seed,
epoch, item), a missing VAE is named before training, and validation off loads and runs nothing."""

import json
import logging
import re

import numpy as np
import pytest
import torch

import configs.build as build
import runtime.validation as validation
from data.images import caption_lines, save_grid
from data.latents import LatentDataset
from data.loader import StepBatchSampler, StepDataset, split_holdout
from runtime.distributed import World
from tests.conftest import metric_rows, write_latent_shards
from train_mmdit_stable import main


def test_held_out_items_are_never_drawn_for_training():
    train, held = split_holdout(100, 10, seed=0)
    assert len(held) == 10 and not set(train) & set(held) and sorted([*train.tolist(), *held]) == list(range(100))
    again = split_holdout(100, 10, seed=0)
    assert again[0].tolist() == train.tolist() and again[1] == held and split_holdout(100, 10, seed=1)[1] != held
    drawn = {i for batch in StepBatchSampler(train, 9, 0, 0, 1, 0, 40) for _, _, i, _ in batch}
    assert drawn == set(train.tolist())
    with pytest.raises(ValueError, match="data.holdout=100 leaves nothing to train on"):
        split_holdout(100, 100, seed=0)


def test_flipped_latents_are_picked_per_seed_epoch_and_item(tmp_path):
    ds = LatentDataset(write_latent_shards(tmp_path / "d", flipped=True))
    picks = {}
    for epoch in range(8):
        for seed in (0, 1):
            item = StepDataset(ds, seed)[(0, 0, 3, epoch)]
            flipped = torch.equal(item["latents"], ds[3]["latents_flipped"])
            assert flipped or torch.equal(item["latents"], ds[3]["latents"])
            assert "latents_flipped" not in item
            picks[seed, epoch] = flipped
    assert picks == {k: torch.equal(StepDataset(ds, k[0])[(5, 1, 3, k[1])]["latents"], ds[3]["latents_flipped"])
                     for k in picks}  # the step and position do not matter
    assert len(set(picks.values())) == 2  # both orientations occur


def test_held_out_loss_is_a_deterministic_curve(tiny, tmp_path, caplog):
    run = ["training.max_steps=4", "data.holdout=6", "validation.every=2", "validation.loss_sigmas=3",
           "sampling.steps=1", "validation.at_end=true"]
    caplog.set_level(logging.INFO, logger="mmdit")
    assert main(tiny(*run, run="a")) == 0
    assert re.search(r"final validation: sampling \d+ caption\(s\) from the EMA weights, 1 Euler steps each "
                     r"\(cfg [\d.]+\), then scoring their prompt fidelity", caplog.text)  # why the end takes long
    assert main(tiny(*run, run="b")) == 0
    a, b = ([r for r in metric_rows(tmp_path / r) if "val/loss" in r] for r in ("a", "b"))
    assert [r["step"] for r in a] == [2, 4] and [sorted(k for k in r if k.startswith("val/")) for r in a][0] == [
        "val/loss", "val/loss_by_sigma/0.167", "val/loss_by_sigma/0.500", "val/loss_by_sigma/0.833"]
    assert [{k: v for k, v in r.items() if k.startswith("val/")} for r in a] == \
        [{k: v for k, v in r.items() if k.startswith("val/")} for r in b]
    assert a[0]["val/loss"] != a[1]["val/loss"]  # it follows training


def test_a_missing_vae_is_named_before_training(latent_run, tmp_path, caplog):
    data = write_latent_shards(tmp_path / "data", validation_prompts=2)
    assert main(latent_run("training.max_steps=2", "validation.every=1", data=data)) == 2
    assert "records no VAE; set validation.vae_from" in caplog.text and not (tmp_path / "run").exists()
    assert main(latent_run("training.max_steps=2", "validation.every=1", f"validation.vae_from={tmp_path}",
                           data=data)) == 2
    assert f"validation.vae_from: {tmp_path} is not a diffusers VAE folder (no config.json); set validation.vae_from " \
           f"to the pipeline (or its vae/ folder) that encoded the data" in caplog.text  # of any family


def test_validation_off_builds_and_runs_nothing(latent_run, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("validation ran while off")
    for name in ("load_vae", "vae_folder"):
        monkeypatch.setattr(build, name, refuse)
    monkeypatch.setattr(validation.Validation, "__call__", refuse)
    data = write_latent_shards(tmp_path / "data", validation_prompts=2)
    assert main(latent_run("training.max_steps=2", "data.holdout=2", "validation.at_end=false", data=data)) == 0
    assert not (tmp_path / "run" / "samples").exists()


def test_at_end_alone_makes_the_final_grid_and_held_out_loss(latent_run, tmp_path, monkeypatch):
    """validation.every=0 (no periodic validation) with validation.at_end: the validation prompts' grid and the
    held-out loss of the last step, and validation.json."""
    monkeypatch.setattr(build, "latent_decoder", lambda *args: lambda latents: torch.zeros(len(latents), 3, 8, 8))
    data = write_latent_shards(tmp_path / "data", validation_prompts=2)
    assert main(latent_run("training.max_steps=2", "data.holdout=2", "validation.every=0", "validation.at_end=true",
                           "validation.loss_sigmas=2", "sampling.steps=1", data=data)) == 0
    run = tmp_path / "run"
    assert [p.name for p in (run / "samples").glob("*.png")] == ["step_00000002.png"]
    assert [r["step"] for r in metric_rows(run) if "val/loss" in r] == [2]
    assert json.loads((run / "validation.json").read_text())["step"] == 2


def test_a_grid_of_two_prompts_has_two_columns_and_whole_captions(tmp_path):
    from PIL import Image
    save_grid(torch.zeros(2, 3, 32, 32), ["a red circle", "a dog on the grass"], tmp_path / "grid.png")
    grid = Image.open(tmp_path / "grid.png")
    assert grid.width == 2 * (256 + 8)  # no empty columns
    assert caption_lines(["a red circle"], 256) == [["a red circle"]]  # not "red circle"
    # the words as drawn under each cell: a space is 5 or more blank columns, about a letter's width (the letters
    # of a word are 1-2 apart); PIL's scalable default font drew spaces 3-4 wide, and the words ran together
    label = np.array(grid.convert("L").crop((0, 256, grid.width, grid.height))) < 128
    for cell, words in ((0, 3), (1, 5)):
        inked = np.flatnonzero(label[:, cell * 264 : (cell + 1) * 264].any(0))
        assert 1 + int((np.diff(inked) > 5).sum()) == words


def test_a_run_stopped_during_its_final_validation_does_it_when_rerun(tmp_path):
    """A run at its last step is finished once validation.json records the final validation of that step (a rerun
    then does nothing: tests/test_training.py); without it (stopped during it), or with an earlier step's (a run
    continued with a higher training.max_steps), the rerun does it. Without a final validation, nothing is owed."""
    final = validation.Validation(2, True, 4, None, [], World(), torch.device("cpu"))
    assert not final.finished(tmp_path, 4)
    (tmp_path / "validation.json").write_text(json.dumps({"step": 2, "val/loss": 0.5}))
    assert not final.finished(tmp_path, 4)
    (tmp_path / "validation.json").write_text(json.dumps({"step": 4, "val/loss": 0.4}))
    assert final.finished(tmp_path, 4)
    (tmp_path / "validation.json").write_text("[4")  # not JSON (edited by hand): done again, not a traceback
    assert not final.finished(tmp_path, 4)
    assert validation.Validation(2, False, 4, None, [], World(), torch.device("cpu")).finished(tmp_path / "new", 4)


def test_at_end_false_ends_a_run_at_its_last_checkpoint(tiny, tmp_path):
    """validation.at_end=false (as in the tests' tiny runs): periodic validation only, no final samples, scores
    or validation.json."""
    assert main(tiny("training.max_steps=4", "validation.every=2", "validation.at_end=false")) == 0
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "samples").glob("*.png")) == ["step_00000002.png"]
    assert not (run / "validation.json").exists()
    assert [r["step"] for r in metric_rows(run) if "fidelity/color" in r] == [2]
