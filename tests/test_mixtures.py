"""data.datasets: several latent datasets drawn by weight. The deal keeps every dataset's share within
(D - 1) / 2 units of its weight at every point of a run; batches depend on (seed, step, global batch) only,
across world sizes and resumes; per-dataset caption dropout, loss weight, held-out loss and loss metrics; a
mixture of a masked and a plain dataset of different latent sizes trains and resumes bit for bit after
SIGKILL, and trains on two FSDP ranks as on one process."""

import numpy as np
import pytest
import torch

from configs.schema import load_config
from data.latents import LatentDataset
from data.loader import Collate, StepBatchSampler
from data.mixture import MixedDataset, Mixture
from errors import ConfigError
from perf.checkpoint import checkpoints
from tests.conftest import (ROOT, assert_close, final_weights, metric_rows, sigkill_after, trains,
                            write_latent_shards)
from tests.test_masks import add_masks
from train_mmdit_stable import main


@pytest.mark.parametrize("weights", [[1.0], [0.5, 0.5], [0.7, 0.2, 0.1], [3.0, 1.0, 0.05, 2.5]])
def test_every_prefix_of_the_deal_holds_each_share_within_the_bound(weights):
    mixture = Mixture(weights)
    shares = np.array(weights) / sum(weights)
    dealt = mixture.deal(0, 3000)
    seen = np.zeros(len(weights), dtype=int)
    for n, (source, j) in enumerate(dealt, 1):
        assert j == seen[source]  # the unit's index within its dataset's stream
        seen[source] += 1
        assert list(seen) == mixture.counts(n)
        assert np.abs(seen - n * shares).max() <= (len(weights) - 1) / 2 + 1e-9, (n, seen, n * shares)
    assert mixture.deal(1234, 1300) == dealt[1234:1300]  # from any start: nothing but the unit's number


def test_mixed_batches_depend_on_seed_step_and_global_batch_only():
    parts = [np.arange(0, 10), np.arange(10, 13), np.arange(13, 40)]  # of different sizes, each reshuffled per epoch
    weights = [0.5, 0.25, 0.25]
    run = lambda rank, world, start: list(StepBatchSampler(parts, 8, 0, rank, world, start, 40, [None] * 3, weights))
    one = run(0, 1, 0)
    two = [run(r, 2, 0) for r in range(2)]
    assert [a + b for a, b in zip(*two)] == one
    assert run(0, 1, 17) == one[17:]
    drawn = np.array([i for batch in one for _, _, i, _ in batch])
    realised = np.array([np.isin(drawn, p).mean() for p in parts])
    assert np.abs(realised - weights).max() <= 1 / len(drawn)  # (D - 1) / 2 units of 320
    first_epoch_of_small = [i for i in drawn if i in parts[1]][:3]
    assert sorted(first_epoch_of_small) == [10, 11, 12]  # a small dataset repeats in epochs, not at random
    # aspect buckets: each global batch is one dataset's and one size's
    buckets = [{((8, 8), ()): np.arange(0, 10)}, {((8, 12), ()): np.arange(10, 22), ((12, 8), ()): np.arange(22, 30)}]
    bucketed = list(StepBatchSampler([np.arange(0, 10), np.arange(10, 30)], 4, 0, 0, 1, 0, 40, buckets, [1, 1]))
    size_of = {int(i): size for b in buckets for size, items in b.items() for i in items}
    assert all(len({size_of[i] for _, _, i, _ in batch}) == 1 for batch in bucketed)
    assert sum(batch[0][2] < 10 for batch in bucketed) == 20


def test_collate_takes_caption_dropout_and_loss_weight_from_each_samples_dataset():
    items = [{"step": 0, "position": p, "latents": torch.zeros(4, 2, 2), "prompt_embeds": torch.ones(2, 3),
              "pooled_prompt_embeds": torch.ones(3), "caption": "c", "source": p % 2} for p in range(16)]
    batch = Collate(0, lambda draws, size: draws.sigma_uniform, [0.0, 0.99], loss_weights=[1.0, 0.25])(items)
    dropped = (batch["text"]["pooled_prompt_embeds"] == 0).all(1)
    assert not dropped[0::2].any() and dropped[1::2].all()
    assert batch["loss_weight"].tolist() == [1.0, 0.25] * 8 and batch["source"].tolist() == [0, 1] * 8


def test_datasets_replace_data_path_and_both_is_an_error(tmp_path):
    entries = "data.datasets=[{path: subject, weight: 1}, {path: class, weight: 1, loss_weight: 0.5}]"
    cfg = load_config(ROOT / "configs/sd3_medium_lora.yaml", [entries, "model.init_from=x"], resolve=False)
    assert cfg.data.path is None and cfg.data.datasets[1].loss_weight == 0.5  # data.path: ??? is not asked for
    with pytest.raises(ConfigError, match="give one of the two"):
        load_config(ROOT / "configs/sd3_medium_lora.yaml", [entries, "model.init_from=x", "data.path=d"], resolve=False)


def test_a_masked_and_a_plain_dataset_of_other_sizes_train_and_resume_bit_for_bit_after_sigkill(latent_run, sd3_dir,
                                                                                               tmp_path):
    subject, regular = tmp_path / "subject", tmp_path / "class"
    write_latent_shards(subject, flipped=True, validation_prompts=2)
    add_masks(subject, lambda latents: (torch.arange(8) >= 3).float().expand(len(latents), 1, 8, 8))
    write_latent_shards(regular, sizes=[(8, 12)], seed=1, validation_prompts=1)
    mixture = LatentDataset(subject, masks=True), LatentDataset(regular, aspect_buckets=True)
    mixed = MixedDataset(list(mixture), ["subject", "class"], [1, 1])
    assert mixed.validation_captions == ["prompt 0", "prompt 1", "prompt 0"]
    assert len(mixed.validation_prompts["pooled_prompt_embeds"]) == 3
    assert torch.equal(mixed[12]["loss_mask"], torch.ones(1, 8, 12)) and mixed[12]["source"] == 1
    common = ["data.name=latents", "data.path=null", "data.aspect_buckets=true", "data.holdout=2",
              f"data.datasets=[{{path: {subject}, weight: 3}}, {{path: {regular}, weight: 1, loss_weight: 0.5, "
              f"caption_dropout: 0.0}}]", "training.max_steps=4", "checkpoint.every=2", "logging.log_every=1",
              "validation.every=2", "validation.loss_sigmas=2", f"validation.vae_from={sd3_dir}", "sampling.steps=2"]
    killed = latent_run(*common, run="killed")
    sigkill_after(killed, "step_00000002 complete", tmp_path / "killed.log")
    assert checkpoints(tmp_path / "killed")
    assert main(killed) == 0
    assert main(latent_run(*common, run="straight")) == 0
    assert_close(final_weights(tmp_path / "killed"), final_weights(tmp_path / "straight"))
    # sharded: the same global batch of 4 over two FSDP ranks (each rank's masks and loss weights, one mean)
    trains(2, latent_run(*common, "parallel.strategy=fsdp", "training.train_batch_size=2", run="fsdp"), tmp_path)
    assert_close(final_weights(tmp_path / "fsdp"), final_weights(tmp_path / "straight"), atol=1e-6)  # measured 3e-8
    rows = metric_rows(tmp_path / "straight")
    train_rows = [r for r in rows if "loss" in r]  # a row per step; under aspect buckets a step is one dataset's
    assert all(("loss_by_dataset/subject" in r) != ("loss_by_dataset/class" in r) for r in train_rows)
    assert sum("loss_by_dataset/subject" in r for r in train_rows) == 3  # weights 3:1 over 4 steps
    assert [r["step"] for r in rows if "val/subject/loss" in r and "val/class/loss" in r] == [2, 4]
    assert (tmp_path / "straight" / "samples" / "step_00000004.txt").read_text().split("\n")[:3] == \
        ["prompt 0", "prompt 1", "prompt 0"]  # every dataset's validation prompts
