"""No host-device synchronisation in the default training step: counted (runtime/host_syncs.py) as the
difference between a 4-step and a 2-step run, in one process on the shapes data and on latents, and on two
DDP and two FSDP ranks. The counter sees a synchronisation when there is one."""

import pytest

import optim.adamw
import train_mmdit_stable
from runtime.host_syncs import HostSyncCounter
from tests.conftest import TINY, spawn


def count_syncs(overrides: list[str]) -> dict:
    """Every read of a device value and every blocking copy to the device in a whole run of main()."""
    counter = HostSyncCounter()
    real_build = optim.adamw.build_adamw

    def build_adamw(model, *args, **kwargs):  # the model's parameters are the first device values
        counter.mark(list(model.parameters()))
        return real_build(model, *args, **kwargs)

    train_mmdit_stable.build_adamw = build_adamw
    try:
        with counter.counting():
            status = train_mmdit_stable.main(overrides)
    finally:
        train_mmdit_stable.build_adamw = real_build
    return {"status": status, "counts": counter.counts}


def per_step(run, world_size: int, tmp_path, overrides: list[str]) -> dict:
    """Syncs per step of the training loop, from runs of 2 and 4 steps (setup and the end cancel out)."""
    quiet = ["logging.log_every=1000", "checkpoint.every=0", "validation.every=0", "sampling.steps=1"]
    counts = []
    for steps in (2, 4):
        args = [*overrides, *quiet, f"training.max_steps={steps}", f"logging.output_dir={tmp_path / str(steps)}"]
        results = spawn(world_size, count_syncs, args, tmp_path=tmp_path) if world_size > 1 else [count_syncs(args)]
        assert all(isinstance(r, dict) and r["status"] == 0 for r in results), results
        counts.append(results[0]["counts"])
    short, long = counts
    return {kind: (long.get(kind, 0) - short.get(kind, 0)) / 2 for kind in long.keys() | short.keys()
            if long.get(kind, 0) != short.get(kind, 0)}


@pytest.mark.parametrize("name", ["shapes", "latents", "latents, accumulation 2"])
def test_one_process_steps_make_no_host_sync(name, tiny, latent_run, tmp_path):
    overrides = {"shapes": tiny(), "latents": latent_run(),
                 "latents, accumulation 2": latent_run("training.gradient_accumulation_steps=2")}[name]
    assert per_step(None, 1, tmp_path, overrides) == {}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_rank_steps_make_no_host_sync(strategy, tmp_path):
    overrides = [*TINY, "training.train_batch_size=4", f"parallel.strategy={strategy}",
                 "training.gradient_accumulation_steps=2"]
    assert per_step(None, 2, tmp_path, overrides) == {}


def test_the_counter_sees_a_sync_where_there_is_one(tiny, tmp_path):
    """Without a fused AdamW the non-finite guard cannot skip a step on the device: it reads the flag."""
    assert per_step(None, 1, tmp_path, tiny("optimizer.fused=false")) == {"__bool__": 1}
