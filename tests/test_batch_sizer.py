"""The OOM-aware batch sizer: injected out-of-memory errors split the step, keep the math, and never hang DDP."""

import hashlib

import pytest
import torch

import train_mmdit_stable
from perf.batch_sizer import OutOfMemoryAtMicroBatchOne
from perf.checkpoint import checkpoints, read_checkpoint
from tests.conftest import TINY, final_weights, metric_rows
from tests.test_distributed import spawn
from train_mmdit_stable import main

SIZER = ["batch_sizer.enabled=true", "training.max_steps=3"]


def logged(run_dir, key):
    return [r[key] for r in metric_rows(run_dir) if key in r]


def assert_same_math(run_dir, reference_dir):
    """Equal up to fp32 summation order (the tolerance of the micro-batch split test)."""
    ref, other = final_weights(reference_dir), final_weights(run_dir)
    diffs = torch.cat([(other[k] - ref[k]).abs().flatten() for k in ref])
    assert diffs.max() < 2e-4 and diffs.mean() < 1e-7, (diffs.max(), diffs.mean())


@pytest.fixture
def reference(tiny, tmp_path):
    assert main(tiny("training.max_steps=3", run="reference")) == 0
    return tmp_path / "reference"


def test_sizer_without_oom_is_bitwise_the_plain_loop(tiny, tmp_path, reference):
    assert main(tiny(*SIZER)) == 0
    ref, run = final_weights(reference), final_weights(tmp_path / "run")
    assert all(torch.equal(ref[k], run[k]) for k in ref)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_oom_halves_the_micro_batch_and_keeps_the_math(tiny, tmp_path, reference, phase, caplog):
    """Every micro-batch above 2 fails: 8 -> 4 -> 2 in the first step, and sizes that failed are not retried
    within batch_sizer.retry_after."""
    assert main(tiny(*SIZER, "batch_sizer.debug_oom_above=2", f"batch_sizer.debug_oom_phase={phase}",
                     "batch_sizer.grow_after=1", "batch_sizer.retry_after=100")) == 0
    assert "retrying the same samples as micro-batches of 4" in caplog.text
    assert logged(tmp_path / "run", "micro_batch") == [2, 2, 2]
    assert logged(tmp_path / "run", "oom_events") == [2, 2, 2]
    assert_same_math(tmp_path / "run", reference)
    _, meta = read_checkpoint(checkpoints(tmp_path / "run")[-1])
    assert meta["batch_sizer"]["micro_batch"] == 2 and meta["batch_sizer"]["oom_events"] == 2


def test_growth_returns_to_the_configured_micro_batch(tiny, tmp_path, reference):
    """An OOM in step 0 only: micro-batch 4 for two clean steps, then 8 again (the failed size's cool-down
    of 2 steps has passed)."""
    assert main(tiny(*SIZER, "batch_sizer.debug_oom_above=4", "batch_sizer.debug_oom_steps=[0]",
                     "batch_sizer.grow_after=2", "batch_sizer.retry_after=2")) == 0
    assert logged(tmp_path / "run", "micro_batch") == [4, 4, 8]
    assert_same_math(tmp_path / "run", reference)


def test_oom_at_micro_batch_one_is_a_clear_error(tiny):
    with pytest.raises(OutOfMemoryAtMicroBatchOne, match="even with micro-batch 1.*process memory"):
        main(tiny(*SIZER, "batch_sizer.debug_oom_above=0"))


def test_other_errors_are_not_swallowed(tiny, monkeypatch):
    calls = []

    def broken(*args):
        calls.append(args[-2])  # the micro-batch of the attempt
        raise RuntimeError("not a memory problem")

    monkeypatch.setattr(train_mmdit_stable, "forward_backward", broken)
    with pytest.raises(RuntimeError, match="not a memory problem"):
        main(tiny(*SIZER))
    assert calls == [8]  # no retry with a smaller micro-batch


def train_and_fingerprint(overrides: list[str]) -> dict:
    """main() on this rank, with a hash of the model weights this rank holds at every checkpoint."""
    from perf.parallel import unwrap
    fingerprints, real_save = {}, train_mmdit_stable.save

    def save(checkpointer, step, model, *rest):
        digest = hashlib.sha256()
        for tensor in unwrap(model).state_dict().values():
            digest.update(tensor.detach().cpu().numpy().tobytes())
        fingerprints[step] = digest.hexdigest()
        return real_save(checkpointer, step, model, *rest)

    train_mmdit_stable.save = save
    return {"status": main(overrides), "fingerprints": fingerprints}


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_oom_on_one_rank_shrinks_both_without_a_hang(tmp_path, phase):
    """Only rank 1 runs out of memory, in step 1: both ranks shrink at the same point, finish, and hold
    the same weights; the result matches the same 2-rank run without any OOM. (spawn() fails on a hang.)"""
    common = [*TINY, *SIZER, "training.train_batch_size=4", "checkpoint.every=1", "checkpoint.keep_last=5"]
    oom = [*common, "batch_sizer.debug_oom_above=2", "batch_sizer.debug_oom_ranks=[1]",
           "batch_sizer.debug_oom_steps=[1]", f"batch_sizer.debug_oom_phase={phase}",
           f"logging.output_dir={tmp_path / 'oom'}"]
    ranks = spawn(2, train_and_fingerprint, oom, tmp_path=tmp_path)
    assert [r["status"] for r in ranks] == [0, 0], ranks
    assert ranks[0]["fingerprints"] == ranks[1]["fingerprints"] and len(ranks[0]["fingerprints"]) == 3
    assert logged(tmp_path / "oom", "micro_batch") == [4, 2, 2]  # rank 0 shrank although it did not fail
    clean = spawn(2, train_and_fingerprint, [*common, f"logging.output_dir={tmp_path / 'clean'}"], tmp_path=tmp_path)
    assert [r["status"] for r in clean] == [0, 0]
    assert_same_math(tmp_path / "oom", tmp_path / "clean")
