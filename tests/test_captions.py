"""Captions (data/captions.py): a trigger word or prefix, tags shuffled past the first k and dropped; precomputed as
K encodings per caption (precompute --caption-variants) of which training draws one by (seed, step, position), the
same on any world size and after a resume, or made in the step for text encoded there; a dataset's share by
repeats; what cannot be trained is refused, naming the key, before anything is written."""

import json
import shutil

import numpy as np
import pytest
import torch

from configs.build import build_data
from configs.schema import load_config
from data.captions import CaptionStyle, caption_key
from data.latents import LatentDataset
from data.loader import Collate, StepBatchSampler, StepDataset
from perf.checkpoint import checkpoints
from tests.conftest import LATENT_RUN, T5_TOKENS, assert_close, final_weights, image_folder, write_latent_shards
from tests.test_precompute import pipeline, run_precompute
from train_mmdit_stable import main

STYLE = CaptionStyle(prefix="photo", shuffle_tags=True, keep_tags=1, tag_dropout=0.25)
CAPTIONS = ["a cat, red, on the grass, in snow, blue", "a dog, green, snow", "a square, blue, red, in the grass"]
FLAGS = ["--caption-prefix", "photo", "--shuffle-caption-tags", "--keep-tags", "1", "--tag-dropout", "0.25"]
KEYS = ["data.caption_prefix=photo", "data.shuffle_caption_tags=true", "data.keep_tags=1", "data.tag_dropout=0.25"]


def generator(key: int) -> torch.Generator:
    return torch.Generator().manual_seed(key)


def test_a_caption_gets_its_prefix_and_its_tags_past_the_kept_ones_shuffled_and_dropped():
    caption = CAPTIONS[0]
    made = [STYLE.apply(caption, generator(k)) for k in range(40)]
    for text in made:
        tags = text.removeprefix("photo ").split(", ")
        assert text.startswith("photo a cat, ") and tags[0] == "a cat"
        assert set(tags[1:]) <= {"red", "on the grass", "in snow", "blue"} and len(set(tags)) == len(tags)
    assert len(set(made)) > 10 and any(len(t.split(", ")) < 5 for t in made)  # orders vary, tags are dropped
    assert STYLE.apply(caption, generator(3)) == STYLE.apply(caption, generator(3))
    assert CaptionStyle().apply(" a,b  ,c ", generator(0)) == " a,b  ,c "  # left as written
    assert CaptionStyle(prefix="sks,").apply("1girl, smile", generator(0)) == "sks, 1girl, smile"


@pytest.fixture
def variants(sd3_dir, tmp_path):
    """A dataset of the tiny SD3 pipeline with 3 encodings per caption of tag captions."""
    images = image_folder(tmp_path / "images", [(16, 16)] * 3)
    for i, caption in enumerate(CAPTIONS):
        (images / f"img{i:02d}.txt").write_text(caption)
    assert run_precompute(sd3_dir, images, tmp_path / "data", "--caption-variants", "3", *FLAGS) == 0
    return tmp_path / "data"


def test_precompute_stores_each_captions_variants_as_the_pipeline_encodes_them(variants, sd3_dir):
    """Variant v of an item is the pipeline's encoding of the caption's v-th draw; the index keeps the caption as
    written, dataset.json how it was made."""
    dataset = LatentDataset(variants)
    assert dataset.caption_variants == 3
    assert json.loads((variants / "dataset.json").read_text())["captions"] == STYLE.record(3)
    pipe = pipeline(sd3_dir, None)
    for i in range(len(dataset)):
        caption = dataset.caption(i)
        assert caption in CAPTIONS
        with torch.no_grad():
            embeds, _, pooled, _ = pipe.encode_prompt(STYLE.variants(caption, 3), None, None,
                                                      do_classifier_free_guidance=False, max_sequence_length=T5_TOKENS)
        for v in range(3):
            torch.testing.assert_close(dataset.item(i, v)["prompt_embeds"], embeds[v], rtol=0, atol=1e-6)
            torch.testing.assert_close(dataset.item(i, v)["pooled_prompt_embeds"], pooled[v], rtol=0, atol=1e-6)
    assert not torch.equal(dataset.item(0, 0)["prompt_embeds"], dataset.item(0, 1)["prompt_embeds"])


def test_each_step_draws_the_variant_of_seed_step_and_position_on_any_world_size(variants):
    """The variant each sample of each step gets is (key of seed, step, position) mod K: one process and two ranks
    draw the same, a resume at step 3 too, and every variant is drawn."""
    dataset = LatentDataset(variants)

    def drawn(world: int, start: int = 0) -> dict:
        """(step, position) -> (item, its text embedding) over every rank's batches."""
        out = {}
        for rank in range(world):
            for batch in StepBatchSampler(np.arange(3), 4, 7, rank, world, start, 6):
                out.update({key[:2]: (key[2], StepDataset(dataset, 7)[key]["prompt_embeds"]) for key in batch})
        return out
    one, two, resumed = drawn(1), drawn(2), drawn(1, start=3)
    same = lambda a, b: a.keys() == b.keys() and all(  # noqa: E731
        a[k][0] == b[k][0] and torch.equal(a[k][1], b[k][1]) for k in a)
    assert same(two, one) and same(resumed, {k: v for k, v in one.items() if k[0] >= 3})
    chosen = {}
    for (step, position), (item, embeds) in one.items():
        chosen[step, position] = caption_key(7, step, position) % 3
        assert torch.equal(embeds, dataset.item(item, chosen[step, position])["prompt_embeds"])
    assert set(chosen.values()) == {0, 1, 2}


@pytest.mark.parametrize("text", ["precomputed", "on_the_fly"])
def test_training_with_shuffled_tags_resumes_bit_for_bit(text, variants, tmp_path):
    """On the precomputed variants, and with the captions made and encoded in the step (the pipeline's encoders):
    step 2's checkpoint resumed gives the run's weights bit for bit."""
    run = [*LATENT_RUN, f"data.path={variants}", f"data.text_encoding={text}", "training.train_batch_size=2",
           "training.max_steps=3", "checkpoint.every=2", f"logging.output_dir={tmp_path / 'run'}", *KEYS]
    assert main(run) == 0
    trained = final_weights(tmp_path / "run")
    shutil.rmtree(checkpoints(tmp_path / "run")[-1])
    assert main(run) == 0
    assert_close(final_weights(tmp_path / "run"), trained)


def test_precomputed_text_of_other_caption_settings_is_refused(variants, tmp_path, caplog):
    other = [*LATENT_RUN, f"data.path={variants}", f"logging.output_dir={tmp_path / 'other'}", *KEYS[:3],
             "data.tag_dropout=0.5"]
    assert main(other) == 2
    assert "data.tag_dropout=0.5, its precompute 0.25" in caplog.text and "--tag-dropout 0.5" in caplog.text
    assert "data.text_encoding=on_the_fly" in caplog.text and not (tmp_path / "other").exists()


def test_text_encoded_in_the_step_gets_each_samples_own_draw():
    """The tokenizer of a text encoder in the model sees each sample's caption made with the draw of (seed, step,
    its position); a dropped caption stays empty (no prefix)."""
    seen = []
    tokenizer = lambda captions: seen.append(captions) or {"count": torch.tensor(len(captions))}  # noqa: E731
    collate = Collate(5, lambda draws, size: draws.sigma_uniform, [0.0, 0.999], tokenizer, loss_weights=[1.0, 1.0],
                      captions=STYLE)
    items = [{"latents": torch.zeros(4, 8, 8), "caption": CAPTIONS[p % 3], "step": 7, "position": p, "source": p % 2}
             for p in (2, 3)]
    collate(items)
    assert seen == [[STYLE.apply(CAPTIONS[2], generator(caption_key(5, 7, 2))), ""]]


def test_repeats_set_each_datasets_share_to_its_items_times_repeats(tmp_path, caplog):
    a, b = write_latent_shards(tmp_path / "a", per_shard=12), write_latent_shards(tmp_path / "b", per_shard=6, seed=1)
    cfg = load_config(overrides=[*LATENT_RUN, f"data.datasets=[{{path: {a}, repeats: 1}}, {{path: {b}, repeats: 4}}]"])
    dataset, _ = build_data(cfg)
    assert dataset.weights == [12, 24]
    sampler = StepBatchSampler([np.arange(12), np.arange(12, 18)], 6, 0, 0, 1, 0, 10, [None, None], dataset.weights)
    sources = [int(dataset.sources(key[2])) for batch in sampler for key in batch]
    assert sources.count(0) == 20 and sources.count(1) == 40  # a third and two thirds
    assert main([*LATENT_RUN, f"data.datasets=[{{path: {a}, weight: 2, repeats: 3}}]",
                 f"logging.output_dir={tmp_path / 'run'}"]) == 2
    assert "data.datasets[0].repeats must be >= 1, with weight left at 1" in caplog.text
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags,said", [
    (["--shuffle-caption-tags"], "need --caption-variants K >= 2"),
    (["--caption-variants", "2"], "every variant is the same caption"),
    (["--caption-prefix", "sks", "--text-embeddings", "none"], "with --text-embeddings none nothing is encoded"),
])
def test_caption_flags_that_cannot_work_are_refused_before_anything_is_written(flags, said, sd3_dir, tmp_path,
                                                                               capsys):
    with pytest.raises(SystemExit) as exit_:
        run_precompute(sd3_dir, tmp_path / "images", tmp_path / "out", *flags)
    assert exit_.value.code == 2 and said in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_caption_settings_are_refused_on_the_shapes_data(tmp_path, caplog):
    assert main(["data.caption_prefix=sks", f"logging.output_dir={tmp_path / 'run'}"]) == 2
    assert "data.caption_prefix changes the captions of a latent dataset" in caplog.text
    assert not (tmp_path / "run").exists()
