"""Latent shards: reading, checks that name the file and field, bucketed deterministic order, training."""

import json
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from data.latents import DataFormatError, LatentDataset
from data.loader import StepBatchSampler, check_batches, step_batches
from perf.checkpoint import checkpoints
from tests.conftest import LATENT_DIMS, assert_close, final_weights, losses, write_latent_shards
from train_mmdit_stable import main


def test_items_are_the_written_rows(tmp_path):
    write_latent_shards(tmp_path / "d", sizes=[(8, 8), (8, 12)], per_shard=5)
    ds = LatentDataset(tmp_path / "d", aspect_buckets=True)
    shard = load_file(tmp_path / "d" / "shard-00001-8x12.safetensors")
    item = ds[7]  # row 2 of the second shard
    assert torch.equal(item["latents"], shard["latents"][2].float()) and item["latents"].dtype == torch.float32
    assert torch.equal(item["prompt_embeds"], shard["prompt_embeds"][2])
    assert item["caption"] == "item 1/2"
    assert len(ds) == 10 and ds.latent_sizes == [(8, 8), (8, 12)] and ds.bucket_of.tolist() == [0] * 5 + [1] * 5
    assert ds.text_dims == (LATENT_DIMS["joint"], LATENT_DIMS["pooled"]) and ds.empty_prompt["prompt_embeds"].shape[0] == 1
    captions_only = LatentDataset(tmp_path / "d", aspect_buckets=True, text_embeddings=False)
    assert set(captions_only[7]) == {"latents", "caption"}


def test_a_dataset_of_an_earlier_format_is_named(tmp_path):
    directory = write_latent_shards(tmp_path / "d")
    record = json.loads((directory / "dataset.json").read_text())
    (directory / "dataset.json").write_text(json.dumps({**record, "format": 1}))
    with pytest.raises(DataFormatError, match=r"earlier version of precompute_latents.py \(format 1; this "
                                              r"version reads 2\): rerun it into a new --out"):
        LatentDataset(directory)


def test_a_damaged_shard_is_named_when_the_dataset_opens(tmp_path):
    """Sizes are checked against dataset.json when the dataset opens (no shard is read); every damaged shard
    is named, with what to do."""
    directory = write_latent_shards(tmp_path / "d", sizes=[(8, 8), (8, 8)])
    first, second = directory / "shard-00000-8x8.safetensors", directory / "shard-00001-8x8.safetensors"
    first.write_bytes(first.read_bytes()[: first.stat().st_size * 2 // 3])  # truncated to 2/3
    second.unlink()
    with pytest.raises(DataFormatError, match="2 damaged shard") as error:
        LatentDataset(directory)
    message = str(error.value)
    assert f"{first.name} has {first.stat().st_size} bytes" in message and f"{second.name} is missing" in message
    assert "rerun the same precompute_latents.py command" in message


@pytest.mark.parametrize("change, message", [
    ({"pooled_prompt_embeds": None}, "'pooled_prompt_embeds': 'missing'"),
    ({"latents": torch.zeros(12, 4, 8)}, "'latents': [12, 4, 8]"),
    ({"prompt_embeds": torch.zeros(12, 6, 24, dtype=torch.int32)}, "not floating point: ['prompt_embeds']"),
    ({"latents": torch.zeros(12, 3, 8, 8)}, "'latents': [12, 3, 8, 8]"),
])
def test_a_shard_whose_fields_differ_from_the_index_is_named_when_read(tmp_path, change, message):
    """A shard of the published size whose header says something else (not written by precompute, or altered
    in place) is named with its field when a loader first opens it."""
    directory = write_latent_shards(tmp_path / "d")
    path = directory / "shard-00000-8x8.safetensors"
    tensors = {**load_file(path), **change}
    save_file({k: v for k, v in tensors.items() if v is not None}, path)
    index = json.loads((directory / "dataset.json").read_text())
    index["shards"][0]["bytes"] = path.stat().st_size
    (directory / "dataset.json").write_text(json.dumps(index))
    ds = LatentDataset(directory)
    with pytest.raises(DataFormatError, match=re.escape(message)) as error:
        ds[0]
    assert str(path) in str(error.value)


def test_a_damaged_dataset_stops_training_before_the_run_directory(latent_run, tmp_path, caplog):
    data = write_latent_shards(tmp_path / "d")
    shard = data / "shard-00000-8x8.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size * 2 // 3])
    assert main(latent_run("training.max_steps=2", data=data)) == 2
    assert "shard-00000-8x8.safetensors has" in caplog.text and "bytes" in caplog.text
    assert not (tmp_path / "run").exists()
    assert main(latent_run("training.max_steps=2", data=tmp_path / "nowhere")) == 2
    assert "nowhere is not a directory of latent shards" in caplog.text


def test_bucketed_batches_are_one_size_deterministic_and_rank_independent():
    buckets = {((8, 8), ()): list(range(0, 13)), ((8, 12), ()): list(range(13, 20)),
               ((12, 8), ()): list(range(20, 40))}
    size_of = {i: size for size, items in buckets.items() for i in items}
    items = list(range(40))
    one = list(StepBatchSampler(items, 4, seed=0, rank=0, world_size=1, start_step=0, end_step=24, buckets=buckets))
    for batch in one:
        assert len({size_of[i] for _, _, i, _ in batch}) == 1
    per_epoch = 13 // 4 + 7 // 4 + 20 // 4
    first_epoch = [i for batch in one[:per_epoch] for _, _, i, _ in batch]
    assert len(set(first_epoch)) == len(first_epoch) == per_epoch * 4  # no item twice within an epoch
    assert one[:per_epoch] != one[per_epoch : 2 * per_epoch]  # each epoch reshuffles
    two = [list(StepBatchSampler(items, 4, seed=0, rank=r, world_size=2, start_step=0, end_step=24, buckets=buckets))
           for r in range(2)]
    assert [a + b for a, b in zip(*two)] == one
    resumed = list(StepBatchSampler(items, 4, seed=0, rank=0, world_size=1, start_step=17, end_step=24,
                                    buckets=buckets))
    assert resumed == one[17:]
    with pytest.raises(ValueError, match="no latent size has enough items for one global batch of 16"):
        StepBatchSampler(items, 16, seed=0, rank=0, world_size=1, start_step=0, end_step=1,
                         buckets={((8, 8), ()): [0, 1], ((8, 12), ()): [2]})


def test_a_size_too_small_for_a_batch_is_skipped_with_a_warning(caplog):
    """A rare aspect ratio with fewer items than the global batch: its items are never drawn (a warning counts
    them); every step still gets a whole batch of one size."""
    buckets = {((8, 8), ()): list(range(38)), ((4, 16), ()): [38, 39]}
    batches = list(StepBatchSampler(list(range(40)), 4, seed=0, rank=0, world_size=1, start_step=0, end_step=30,
                                    buckets=buckets))
    assert all(len(b) == 4 for b in batches) and not {38, 39} & {i for b in batches for _, _, i, _ in b}
    assert "latent sizes with fewer items than one global batch (4) are never drawn: 4x16 (2 items)" in caplog.text


def test_a_global_batch_larger_than_the_data_is_said(caplog):
    """3 processes x 8 on 12 items: every step repeats items. The run goes on, and says so before it starts."""
    one_size = SimpleNamespace(latent_sizes=[(8, 8)])
    check_batches(one_size, np.arange(24), 24)  # fits
    assert "larger than" not in caplog.text
    check_batches(one_size, np.arange(12), 24)
    assert "the global batch (24) is larger than the 12 training items: every step holds some of them more than " \
           "once" in caplog.text


def test_loader_workers_read_the_same_batches(tmp_path):
    from configs.build import build_collate
    from configs.schema import load_config
    ds = LatentDataset(write_latent_shards(tmp_path / "d", sizes=[(8, 8), (8, 12)], per_shard=8), aspect_buckets=True)
    collate = build_collate(load_config(overrides=["data.caption_dropout=0.5"]), ds, None)
    runs = [list(step_batches(ds, collate, list(range(len(ds))), 4, 0, 0, 1, 0, 6, torch.device("cpu"),
                              num_workers=w)) for w in (0, 2)]
    assert len(runs[0]) == len(runs[1]) == 6
    for a, b in zip(*runs):
        assert_close({k: v for k, v in a.items() if isinstance(v, (torch.Tensor, dict))},
                     {k: v for k, v in b.items() if isinstance(v, (torch.Tensor, dict))})


def test_training_on_latents_resumes_bit_for_bit(latent_run, tmp_path):
    """Interrupted after step 3 of 6 (the last checkpoint removed) and resumed: the uninterrupted weights."""
    run = latent_run("training.max_steps=6", "checkpoint.every=3", "data.caption_dropout=0.5")
    assert main(run) == 0
    whole = final_weights(tmp_path / "run")
    shutil.rmtree(checkpoints(tmp_path / "run")[-1])
    assert main(run) == 0
    assert_close(final_weights(tmp_path / "run"), whole)
    assert not (tmp_path / "run" / "validation.json").exists()  # validation is off, and nothing scores latents


def test_aspect_buckets_train(latent_run, tmp_path, caplog):
    data = write_latent_shards(tmp_path / "d", sizes=[(8, 8), (4, 12)], per_shard=8)
    assert main(latent_run("training.max_steps=4", "data.aspect_buckets=true", data=data)) == 0
    assert len(losses(tmp_path / "run")) == 4
    assert main(latent_run("training.max_steps=4", "data.aspect_buckets=true", "training.train_batch_size=16",
                           data=data, run="too_big")) == 2
    assert "no latent size has enough items for one global batch of 16" in caplog.text
    assert not (tmp_path / "too_big").exists()


def test_caption_dropout_uses_the_empty_prompt_encoding(tmp_path):
    from data.loader import Collate
    from models.rectified_flow import draw_sample_noise
    items = [{"step": 0, "position": p, "latents": torch.zeros(4, 8, 8), "prompt_embeds": torch.ones(2, 4),
              "pooled_prompt_embeds": torch.ones(5), "caption": "c"} for p in range(8)]
    dropped = draw_sample_noise(0, 0, torch.arange(8), (4, 8, 8)).dropout_uniform < 0.5
    assert 0 < dropped.sum() < 8
    empty = {"prompt_embeds": torch.full((1, 2, 4), 7.0), "pooled_prompt_embeds": torch.full((1, 5), 7.0)}
    text = Collate(0, lambda draws, size: draws.sigma_uniform, 0.5, empty_prompt=empty)(items)["text"]
    assert text["prompt_embeds"][dropped].eq(7).all() and text["prompt_embeds"][~dropped].eq(1).all()
    assert text["pooled_prompt_embeds"][dropped].eq(7).all()
    zeros = Collate(0, lambda draws, size: draws.sigma_uniform, 0.5)(items)["text"]  # a dataset without "" encoded
    assert zeros["prompt_embeds"][dropped].eq(0).all() and zeros["prompt_embeds"][~dropped].eq(1).all()
