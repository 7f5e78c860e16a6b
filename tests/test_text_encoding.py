"""data.text_encoding=on_the_fly: SD3's frozen text encoders run in the training step on the dataset's captions
instead of reading stored embeddings; training equals training on the precomputed embeddings of the same captions,
with caption dropout, validation and the held-out loss, and resumes exactly (under FSDP, for every family:
tests/test_families.py)."""

import pytest

from perf.checkpoint import checkpoints
from tests.conftest import LATENT_RUN, assert_close, final_weights, metric_rows, sigkill_after
from train_mmdit_stable import main

pytest.importorskip("diffusers")


@pytest.fixture
def run(sd3_data, tmp_path):
    def make(*extra: str, name: str = "run") -> list[str]:
        return [*LATENT_RUN, f"data.path={sd3_data}", "data.caption_dropout=0.3", "training.max_steps=4",
                "optimizer.eps=1e-3", f"logging.output_dir={tmp_path / name}", *extra]
    return make


def test_encoding_in_the_step_equals_precomputed_embeddings(run, tmp_path):
    """Four steps with caption dropout (the encoding of "" either way), validation images and held-out loss."""
    validation = ["data.holdout=2", "validation.every=2", "validation.loss_sigmas=2", "sampling.steps=2"]
    assert main(run(*validation, name="stored")) == 0
    assert main(run(*validation, "data.text_encoding=on_the_fly", name="fly")) == 0
    fly, stored = final_weights(tmp_path / "fly"), final_weights(tmp_path / "stored")
    assert not [k for k in fly if k.startswith("text_encoder.")]  # frozen, read from the pipeline: not saved
    assert_close(fly, stored, atol=1e-5)
    rows = lambda name: [r for r in metric_rows(tmp_path / name) if "val/loss" in r]
    assert [r["step"] for r in rows("fly")] == [2, 4]
    assert abs(rows("fly")[-1]["val/loss"] - rows("stored")[-1]["val/loss"]) < 1e-5
    assert sorted(p.name for p in (tmp_path / "fly" / "samples").glob("*.png")) == \
        ["step_00000002.png", "step_00000004.png"]


def test_a_run_killed_with_sigkill_resumes_bit_for_bit(run, tmp_path):
    common = ["data.text_encoding=on_the_fly", "training.max_steps=6", "checkpoint.every=2", "logging.log_every=2"]
    killed = run(*common, name="killed")
    sigkill_after(killed, "step_00000004 complete", tmp_path / "killed.log")  # right after its second checkpoint
    assert checkpoints(tmp_path / "killed")
    assert main(killed) == 0
    assert main(run(*common, name="straight")) == 0
    assert_close(final_weights(tmp_path / "killed"), final_weights(tmp_path / "straight"))
    assert_close(final_weights(tmp_path / "killed", "ema"), final_weights(tmp_path / "straight", "ema"))


def test_missing_text_encoders_are_named_before_the_run_directory(run, sd3_data, tmp_path, caplog):
    assert main(run("data.text_encoding=on_the_fly", f"data.text_encoders_from={tmp_path / 'nowhere'}")) == 2
    assert "data.text_encoders_from=" in caplog.text and "nowhere does not exist" in caplog.text
    (tmp_path / "empty").mkdir()
    assert main(run("data.text_encoding=on_the_fly", f"data.text_encoders_from={tmp_path / 'empty'}")) == 2
    assert "no text_encoder/ folder" in caplog.text
    assert not (tmp_path / "run").exists()
    assert main(run("data.text_encoders_from=/x")) == 2
    assert "names the text encoders of data.text_encoding=on_the_fly" in caplog.text
