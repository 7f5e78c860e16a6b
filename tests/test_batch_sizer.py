"""The OOM-aware batch sizer: injected out-of-memory errors split the step, keep the math, and never hang DDP."""

import hashlib
import sys

import pytest
import torch.distributed.checkpoint as dcp

import train_mmdit_stable
from perf.batch_sizer import OutOfMemoryAtMicroBatchOne
from perf.checkpoint import Checkpointer, checkpoints
from tests.conftest import TINY, assert_close, final_weights, metric_rows, spawn
from train_mmdit_stable import main

SIZER = ["batch_sizer.enabled=true", "training.max_steps=3"]


def logged(run_dir, key):
    return [r[key] for r in metric_rows(run_dir) if key in r]


def assert_same_math(run_dir, reference_dir):
    """Equal up to fp32 summation order (the tolerance of the micro-batch split test)."""
    assert_close(final_weights(run_dir), final_weights(reference_dir), atol=2e-4, mean_atol=1e-7)


def saved_sizer_state(run_dir) -> dict:
    state = {"batch_sizer": {"micro_batch": 0, "clean_steps": 0, "oom_events": 0, "failed_at": {}}}
    dcp.load(state, storage_reader=dcp.FileSystemReader(checkpoints(run_dir)[-1]), no_dist=True)
    return state["batch_sizer"]


@pytest.fixture
def reference(tiny, tmp_path):
    assert main(tiny("training.max_steps=3", run="reference")) == 0
    return tmp_path / "reference"


def test_sizer_without_oom_is_bitwise_the_plain_loop(tiny, tmp_path, reference):
    assert main(tiny(*SIZER)) == 0
    assert_close(final_weights(tmp_path / "run"), final_weights(reference))


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
    saved = saved_sizer_state(tmp_path / "run")
    assert saved["micro_batch"] == 2 and saved["oom_events"] == 2


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


@pytest.mark.parametrize("message", ["CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
                                     "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
                                     "NCCL error: unhandled cuda error, Last error: Cuda failure 'out of memory'"])
def test_out_of_memory_outside_the_caching_allocator_reaches_the_sizer(tiny, tmp_path, reference, monkeypatch,
                                                                       message):
    """cuBLAS/cuDNN workspaces and NCCL buffers fail with a RuntimeError, not torch.OutOfMemoryError: the sizer
    splits the step all the same."""
    real, attempts = train_mmdit_stable.forward_backward, []

    def workspace_fails_at_8(model, batch, cfg, scaler, sigma_losses, micro_batch, reduce=True):
        attempts.append(micro_batch)
        if micro_batch == 8 and batch["step"] == 0:
            raise RuntimeError(message)
        return real(model, batch, cfg, scaler, sigma_losses, micro_batch, reduce)

    monkeypatch.setattr(train_mmdit_stable, "forward_backward", workspace_fails_at_8)
    assert main(tiny(*SIZER, "batch_sizer.retry_after=100")) == 0
    assert attempts[:2] == [8, 4] and logged(tmp_path / "run", "oom_events") == [1, 1, 1]
    assert_same_math(tmp_path / "run", reference)


def train_and_fingerprint(overrides: list[str]) -> dict:
    """main() on this rank, with a hash of the model weights this rank holds at every checkpoint, and the
    all-reduces of the sizer's own gradient reduction."""
    import torch.distributed as dist
    fingerprints, real_save, real_all_reduce, reductions = {}, Checkpointer.save, dist.all_reduce, []

    def save(self, step, last=False):
        digest = hashlib.sha256()
        for tensor in self.states["model"].state_dict().values():
            digest.update(tensor.detach().numpy().tobytes())
        fingerprints[step] = digest.hexdigest()
        return real_save(self, step, last)

    def all_reduce(tensor, *args, **kwargs):
        if sys._getframe(1).f_code.co_name == "all_reduce_gradients":  # the sizer's gradient reduction
            reductions.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    Checkpointer.save = save
    dist.all_reduce = all_reduce
    return {"status": main(overrides), "fingerprints": fingerprints, "reductions": reductions}


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
    # the sizer reduces gradients itself, in buckets: 90 gradient tensors, 25 MB buckets, one all-reduce a step
    params = sum(p.numel() for p in train_mmdit_stable.build_trained_model(
        train_mmdit_stable.load_config(overrides=oom), *train_mmdit_stable.build_data(
            train_mmdit_stable.load_config(overrides=oom))).parameters())
    assert ranks[0]["reductions"] == [params] * 3
    assert logged(tmp_path / "oom", "micro_batch") == [4, 2, 2]  # rank 0 shrank although it did not fail
    clean = spawn(2, train_and_fingerprint, [*common, f"logging.output_dir={tmp_path / 'clean'}"], tmp_path=tmp_path)
    assert [r["status"] for r in clean] == [0, 0]
    assert_same_math(tmp_path / "oom", tmp_path / "clean")
