"""Instruction editing beyond the family matrix (tests/test_families.py has each edit family's transformer, pairs,
LoRA runs and pipelines): the built-in edit shapes and their fidelity, bad pairs named before anything is written,
what is refused, and sampling edits from the command line."""

import json

import pytest
import torch
from PIL import Image

import precompute_latents
import sample_mmdit
from data.images import save_png, to_unit
from data.latents import LatentDataset
from data.shapes import ShapesEditDataset, analyze
from tests.conftest import TINY, image_folder, write_shard
from train_mmdit_stable import main


def test_an_edit_of_the_shapes_changes_one_attribute_of_its_reference():
    """Each item: the reference is the shapes dataset's item, the target the same shape with the colour or the
    position the instruction names (analyzed as the shapes demo's fidelity analyzes samples)."""
    data = ShapesEditDataset(64, seed=3)
    for i in range(64):
        item = data[i]
        reference, target = analyze(to_unit(item["references"][0])), analyze(to_unit(item["latents"]))
        change, value = data.edit(i)
        kept = "position" if change == "color" else "color"
        assert target[change] == value != reference[change] and target[kept] == reference[kept], (i, item["caption"])
        assert target["shape"] == reference["shape"] or None in (target["shape"], reference["shape"])


def test_edit_fidelity_scores_the_targets_perfect_and_a_copy_of_the_reference_at_half():
    """The 90 validation edits: their targets score 1 on colour and position; returning the reference unchanged
    scores 0.5 on each (half the edits change the other attribute): what the demo's numbers are measured against."""
    edits = ShapesEditDataset.validation_edits()
    from data.shapes import edited, render_at
    targets = torch.stack([render_at(*(lambda c, p: (c, shape, p))(*edited(color, position, change, value)), (0, 0), 5)
                           for color, shape, position, change, value in edits])
    captions = ShapesEditDataset.validation_captions()
    perfect = ShapesEditDataset.score_images(targets, captions)
    assert perfect["fidelity/color"] == perfect["fidelity/position"] == 1.0
    copies = ShapesEditDataset.score_images(to_unit(ShapesEditDataset.validation_references()[0]), captions)
    assert copies["fidelity/color"] == copies["fidelity/position"] == 0.5


def test_a_shapes_edit_run_samples_edits_from_the_command_line(tmp_path, caplog):
    """A tiny data.name=shapes_edit run, then sample_mmdit.py --references: one result per instruction, each of
    the reference of its line; a line without its reference is named; a text-to-image run takes none."""
    run = [*TINY, "model.family=flux", "model.num_single_layers=1", "data.name=shapes_edit", "training.max_steps=2",
           f"logging.output_dir={tmp_path / 'run'}"]
    assert main(run) == 0
    (tmp_path / "prompts.txt").write_text("make it red\nmove it to the top left\n")
    references = tmp_path / "references"
    save_png(to_unit(ShapesEditDataset(4, 0)[0]["references"][0]), references / "0000.png")
    sample = ["--checkpoint", str(tmp_path / "run"), "--prompts", str(tmp_path / "prompts.txt"), "--steps", "2"]
    assert sample_mmdit.main([*sample, "--references", str(references), "--out", str(tmp_path / "out")]) == 2
    assert f"no reference image for 1 prompt line(s): line 2: {references / '0001.png'}" in caplog.text
    assert not (tmp_path / "out").exists()
    save_png(to_unit(ShapesEditDataset(4, 0)[1]["references"][0]), references / "0001.png")
    assert sample_mmdit.main([*sample, "--out", str(tmp_path / "out")]) == 2
    assert "edits images: --references DIR must name a folder" in caplog.text
    assert sample_mmdit.main([*sample, "--references", str(references), "--out", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["0000.png", "0001.png"]
    assert Image.open(tmp_path / "out" / "0000.png").size == (32, 32)


def test_edits_a_family_cannot_make_are_refused_before_training(tmp_path, caplog):
    """SD3 has no edit model; a config made for pairs refuses data without references."""
    assert main([*TINY, "data.name=shapes_edit", f"logging.output_dir={tmp_path / 'sd3'}"]) == 2
    assert ("data.name=shapes_edit pairs each target with 1 reference image(s), and model.family=sd3: SD3 / SD3.5 has "
            "no edit model (the edit families: flux, qwen_image, flux2)") in caplog.text
    assert main([*TINY, "model.family=flux", "data.name=shapes", "data.references=1",
                 f"logging.output_dir={tmp_path / 'refs'}"]) == 2
    assert "data.references=1: the config is made for pairs with that many reference images, and data.name=shapes " \
           "has none" in caplog.text
    assert not (tmp_path / "sd3").exists() and not (tmp_path / "refs").exists()


def pairs(tmp_path):
    images = image_folder(tmp_path / "images", [(16, 16)] * 4)
    references = image_folder(tmp_path / "references", [(16, 16)] * 4, seed=1)
    for caption in references.glob("*.txt"):
        caption.unlink()
    return images, references


def precompute(model, images, references, out, *extra):
    return precompute_latents.main(["--model", str(model), "--images", str(images), "--references", str(references),
                                    "--out", str(out), "--resolution", "16", "--dtype", "fp32", *extra])


def test_bad_pairs_are_named_at_once_before_anything_is_written(kontext_dir, tmp_path, caplog):
    """A target without its reference, a reference without its target, an unreadable reference, a target with two
    references among targets of one: one report, exit 2, nothing written; a manifest's missing reference too."""
    images, references = pairs(tmp_path)
    (references / "img00.png").unlink()
    (references / "img09.png").write_bytes((references / "img01.png").read_bytes())
    (references / "img02.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    for i in (0, 1):
        (references / f"img03_{i}.png").write_bytes((references / "img03.png").read_bytes())
    (references / "img03.png").unlink()
    out = tmp_path / "sub" / "out"
    assert precompute(kontext_dir, images, references, out) == 2
    assert f"--images {images}: 4 bad input(s)" in caplog.text
    assert f"{images / 'img00.png'}: reference missing: expected {references / 'img00'}.png" in caplog.text
    assert f"{references / 'img09.png'}: reference without a target: no image {images / 'img09'}.* in --images" \
        in caplog.text
    assert f"{images / 'img02.png'}: reference {references / 'img02.png'}: not a readable image" in caplog.text
    assert f"{images / 'img03.png'}: 2 reference(s), the other images 1" in caplog.text
    assert not (tmp_path / "sub").exists()
    manifest = tmp_path / "pairs.jsonl"
    manifest.write_text(json.dumps({"image": "images/img01.png", "caption": "make it red",
                                    "references": ["references/none.png"]}) + "\n")
    assert precompute_latents.main(["--model", str(kontext_dir), "--manifest", str(manifest), "--out", str(out)]) == 2
    assert f"{images / 'img01.png'}: reference missing: {references / 'none.png'} (--manifest line 1)" in caplog.text
    assert not (tmp_path / "sub").exists()


def pair_shard(path, samples: dict[str, dict[str, bytes]]):
    """A webdataset shard: each sample's files, `KEY.SUFFIX`."""
    return write_shard(path, {f"{key}.{suffix}": data for key, files in samples.items()
                              for suffix, data in files.items()})


def pairs_as_shard(images, references, path):
    """The pairs of `pairs`: `imgNN.png`, `imgNN.txt` (the instruction), `imgNN.reference.png`."""
    return pair_shard(path, {f"img{i:02d}": {"png": (images / f"img{i:02d}.png").read_bytes(),
                                             "txt": (images / f"img{i:02d}.txt").read_bytes(),
                                             "reference.png": (references / f"img{i:02d}.png").read_bytes()}
                             for i in range(4)})


def precompute_shards(model, out, *shards, extra=()):
    return precompute_latents.main(["--model", str(model), "--shards", *map(str, shards), "--out", str(out),
                                    "--resolution", "16", "--dtype", "fp32", *extra])


def test_shards_of_pairs_precompute_to_the_dataset_of_the_same_pairs_as_folders(kontext_dir, tmp_path):
    images, references = pairs(tmp_path)
    shard = pairs_as_shard(images, references, tmp_path / "00000.tar")
    assert precompute(kontext_dir, images, references, tmp_path / "folders") == 0
    assert precompute_shards(kontext_dir, tmp_path / "shards", shard) == 0
    folders, shards = LatentDataset(tmp_path / "folders"), LatentDataset(tmp_path / "shards")
    assert folders.references == shards.references == 1 and len(folders) == len(shards) == 4
    assert json.loads((tmp_path / "shards" / "dataset.json").read_text())["references"] == 1
    for i in range(4):
        ours, theirs = shards[i], folders[i]
        assert ours.keys() == theirs.keys() and ours["caption"] == theirs["caption"]
        assert all(torch.equal(a, b) for a, b in zip(ours["references"], theirs["references"], strict=True))
        assert all(torch.equal(ours[k], theirs[k]) for k in ours if k not in ("caption", "references"))


def test_bad_pairs_of_a_shard_are_skipped_and_named_per_sample(kontext_dir, tmp_path, caplog):
    """The first samples' most common number of references (1) is the dataset's; a sample without its reference,
    with two, an unreadable one, a numbered one after a gap, both kinds, or a reference and no target (never the
    target) is bad: past --max-bad-fraction the job fails (exit 1, no dataset: a rerun with a higher limit
    keeps the finished units), within it the good pairs make the dataset."""
    images, references = pairs(tmp_path)
    target, caption = (images / "img00.png").read_bytes(), b"make it red"
    reference = (references / "img00.png").read_bytes()
    bad = {"none": {"png": target, "txt": caption},
           "two": {"png": target, "txt": caption, "reference_0.png": reference, "reference_1.png": reference},
           "broken": {"png": target, "txt": caption, "reference.png": reference[:40]},
           "gap": {"png": target, "txt": caption, "reference_1.png": reference},
           "both": {"png": target, "txt": caption, "reference.png": reference, "reference_0.png": reference},
           "alone": {"txt": caption, "reference.png": reference},
           "gif": {"png": target, "txt": caption, "reference.gif": reference}}
    good = pairs_as_shard(images, references, tmp_path / "00000.tar")
    shards = [good, pair_shard(tmp_path / "00001.tar", bad)]
    out = tmp_path / "out"
    assert precompute_shards(kontext_dir, out, *shards) == 1
    assert "7 of 11 samples (63.6 %) were bad, more than --max-bad-fraction 0.01" in caplog.text
    assert not (out / "dataset.json").exists()
    skipped = {s["key"]: s["why"] for s in json.loads((out / "reports" / "00001.json").read_text())["skipped"]}
    assert skipped == {
        "00001.tar:none": "reference missing: none, the dataset's samples have 1",
        "00001.tar:two": "reference count: 2, the dataset's samples have 1",
        "00001.tar:broken": skipped["00001.tar:broken"],
        "00001.tar:gap": "reference missing: .reference_1.png without .reference_0.*",
        "00001.tar:both": "reference missing: both .reference.* and .reference_0.* (one, or numbered ones)",
        "00001.tar:alone": "no image: only .reference.png, .txt",
        "00001.tar:gif": "unsupported format: .reference.gif (read: jpg, jpeg, png, webp, bmp)"}
    assert skipped["00001.tar:broken"].startswith("corrupt reference: ")
    assert precompute_shards(kontext_dir, out, *shards, extra=["--max-bad-fraction", "0.7"]) == 0
    dataset = LatentDataset(out)
    assert len(dataset) == 4 and dataset.references == 1


def test_pairs_a_pipeline_cannot_edit_are_refused(sd3_dir, kontext_dir, tmp_path, caplog, capsys):
    """An SD3 pipeline has no edit model (pairs in a folder or a shard); a shard's references are its own (not
    --references); Kontext takes one reference; a mirrored target would contradict its instruction."""
    images, references = pairs(tmp_path)
    assert precompute(sd3_dir, images, references, tmp_path / "out") == 2
    assert "is a SD3 / SD3.5 pipeline, and each target has 1 reference image(s): SD3 / SD3.5 has no edit model" \
        in caplog.text
    caplog.clear()
    shard = pairs_as_shard(images, references, tmp_path / "00000.tar")
    assert precompute_shards(sd3_dir, tmp_path / "out", shard) == 2
    assert "each target has 1 reference image(s): SD3 / SD3.5 has no edit model" in caplog.text
    with pytest.raises(SystemExit) as refused:
        precompute_shards(kontext_dir, tmp_path / "out", shard, extra=["--references", str(references)])
    assert refused.value.code == 2 and "a shard holds each sample's (KEY.reference.png" in capsys.readouterr().err
    assert precompute(kontext_dir, images, references, tmp_path / "out", "--random-flip") == 2
    assert "--random-flip mirrors the target alone" in caplog.text
    for i in range(4):
        (references / f"img{i:02d}.png").rename(references / f"img{i:02d}_0.png")
        (references / f"img{i:02d}_1.png").write_bytes((references / f"img{i:02d}_0.png").read_bytes())
    assert precompute(kontext_dir, images, references, tmp_path / "out") == 2
    assert "each target has 2 reference image(s): FluxKontextPipeline takes 1" in caplog.text
    assert not (tmp_path / "out").exists()
