"""The precompute tool on a tiny, randomly initialised SD3 pipeline saved locally (nothing is downloaded), and
the whole fine-tuning path: image folder -> precompute -> full and LoRA fine-tunes -> export -> diffusers."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import data.precompute.job
import export_mmdit
import precompute_latents
import train_mmdit_stable
from data.latents import LatentDataset
from data.precompute.images import open_image, resize_crop, to_unit_range
from data.precompute.inputs import EXIF_ORIENTATION, PrecomputeError, image_size
from data.precompute.ranks import Progress, Ranks
from data.precompute.units import PROGRESS, encode_unit
from errors import InputError
from models.diffusers_io import LORA_WEIGHTS
from models.vae import VAE, load_vae
from tests.conftest import T5_TOKENS, export_random_base, image_folder, metric_rows
from train_mmdit_stable import main

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def load_image(path: Path, size: tuple[int, int]) -> torch.Tensor:
    """[3, H, W] in [-1, 1], as precompute feeds it to the VAE."""
    return to_unit_range(resize_crop(open_image(path), size))


def run_precompute(sd3_dir, images, out, *extra):
    return precompute_latents.main(["--model", str(sd3_dir), "--images", str(images), "--out", str(out), "--resolution", "16",
                            "--bucket-step", "8", "--batch-size", "3", "--shard-size", "4", "--dtype", "fp32",
                            "--max-sequence-length", str(T5_TOKENS), *extra])


def pipeline(sd3_dir, transformer):
    """diffusers' own SD3 pipeline over the saved components."""
    load = lambda cls, folder: cls.from_pretrained(sd3_dir / folder)
    clip, auto = transformers.CLIPTextModelWithProjection, transformers.AutoTokenizer
    return diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=load(diffusers.AutoencoderKL, "vae"), text_encoder=load(clip, "text_encoder"),
        tokenizer=load(auto, "tokenizer"), text_encoder_2=load(clip, "text_encoder_2"), tokenizer_2=load(auto, "tokenizer_2"),
        text_encoder_3=load(transformers.T5EncoderModel, "text_encoder_3"), tokenizer_3=load(auto, "tokenizer_3"))


def test_the_vae_encodes_and_decodes_as_the_sd3_pipeline_does(sd3_dir, tmp_path):
    """Latents are the posterior mean shifted and scaled by the VAE config's factors; decoding undoes the
    factors given (a dataset's recorded ones), as StableDiffusion3Pipeline undoes its config's before
    vae.decode."""
    autoencoder = diffusers.AutoencoderKL.from_pretrained(sd3_dir / "vae")
    vae = load_vae(sd3_dir / "vae", torch.device("cpu"), torch.float32)
    pixels = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        latents = vae.encode(pixels)
        assert torch.equal(latents, (autoencoder.encode(pixels).latent_dist.mean - 0.0609) * 1.5305)
        recorded = VAE(autoencoder, scaling_factor=2.0, shift_factor=0.5)
        assert torch.equal(recorded.decode(latents), autoencoder.decode(latents / 2.0 + 0.5).sample)
    assert vae.record() == {"scaling_factor": 1.5305, "shift_factor": 0.0609}  # the config's, when none are given
    with pytest.raises(InputError, match=f"the VAE in {re.escape(str(tmp_path))} does not load"):
        load_vae(tmp_path, torch.device("cpu"), torch.float32)


def test_aspect_buckets_and_resume(sd3_dir, tmp_path):
    sizes = [(32, 32), (64, 32), (32, 64), (32, 32), (48, 32), (64, 32), (32, 32), (30, 62), (32, 32)]
    images = image_folder(tmp_path / "images", sizes)
    buckets = ["--aspect-buckets", "--resolution", "32"]  # 32x32, 40x24, 24x40, 48x24, 24x48 pixels
    assert run_precompute(sd3_dir, images, tmp_path / "whole", *buckets) == 0
    whole = LatentDataset(tmp_path / "whole", aspect_buckets=True)
    assert whole.latent_sizes == [(12, 20), (12, 24), (16, 16), (24, 12)]  # the VAE halves each side
    first_unit = [whole.latent_sizes[b] for b in whole.bucket_of[:4]]
    assert first_unit == [(12, 24), (16, 16), (16, 16), (24, 12)]  # unit 0, by size
    # Interrupted after the first unit: the rerun skips it and finishes with the same shards.
    assert run_precompute(sd3_dir, images, tmp_path / "part", *buckets) == 0
    for path in [tmp_path / "part" / "dataset.json", *(tmp_path / "part" / "reports").glob("0000[12].json")]:
        path.unlink()
    with pytest.raises(ValueError, match="its precompute has not finished"):
        LatentDataset(tmp_path / "part", aspect_buckets=True)
    kept = sorted((tmp_path / "part").glob("shard-00000-*"))
    mtimes = [p.stat().st_mtime_ns for p in kept]
    assert run_precompute(sd3_dir, images, tmp_path / "part", *buckets) == 0
    assert [p.stat().st_mtime_ns for p in kept] == mtimes  # unit 0 was not redone
    assert same_files(tmp_path / "part", tmp_path / "whole")


def same_files(a: Path, b: Path) -> bool:
    """Two dataset directories hold the same files, byte for byte."""
    names = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    assert names(a) == names(b)
    different = [n for n in names(a) if (a / n).read_bytes() != (b / n).read_bytes()]
    assert not different, different
    return True


def test_bad_inputs_are_named_before_compute(sd3_dir, tmp_path, caplog):
    images = image_folder(tmp_path / "images", [(16, 16), (16, 16)])
    (images / "img01.txt").unlink()
    assert run_precompute(sd3_dir, images, tmp_path / "out") == 2
    assert f"{images / 'img01.png'}: no same-named .txt caption" in caplog.text
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"image": "images/img00.png", "caption": "a cat"}\n{"img": "x"}\n')
    assert precompute_latents.main(["--model", str(sd3_dir), "--manifest", str(manifest), "--out", str(tmp_path / "o")]) == 2
    assert f'{manifest} line 2: not an {{"image": ..., "caption": ...}} line' in caplog.text
    assert precompute_latents.main(["--model", str(sd3_dir), "--manifest", str(tmp_path / "none.jsonl"), "--out", "x"]) == 2
    assert "none.jsonl does not exist" in caplog.text
    (images / "img01.txt").write_text("a dog")
    assert run_precompute(sd3_dir, images, tmp_path / "out") == 0
    # a model too small for the images: the error names the resolution the user chose, and both ways out
    assert main([*FINETUNE, f"data.path={tmp_path / 'out'}", "model.pos_embed_max_size=2",
                 f"logging.output_dir={tmp_path / 'run'}"]) == 2
    assert (f"data.path={tmp_path / 'out'} was precomputed at --resolution 16: its latents, up to 8 a side, make a "
            f"patch grid of 4 a side (model.patch_size=2), and the model's position table covers 2 "
            f"(model.pos_embed_max_size=2). Precompute the images again at --resolution 8 or less, or set "
            f"model.pos_embed_max_size=4 or more") in caplog.text
    assert run_precompute(sd3_dir, images, tmp_path / "out", "--aspect-buckets") == 2  # not the settings it began with
    assert "was started with other settings: aspect_buckets: False -> True" in caplog.text
    assert run_precompute(sd3_dir, images, tmp_path / "out", "--text-encoder-quantization", "int8") == 2  # nor text
    assert "other settings: text_encoders: unset -> {'dtype': 'float32', 'linears': 'int8'}" in caplog.text
    for suffix in (".png", ".txt"):  # one image replaced by another: named, not a fingerprint's hashes
        (images / f"img00{suffix}").rename(images / f"img05{suffix}")
    assert run_precompute(sd3_dir, images, tmp_path / "out") == 2
    assert f"inputs added 1: {images / 'img05.png'}; removed 1: {images / 'img00.png'}" in caplog.text
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert run_precompute(sd3_dir, images, tmp_path / "mine") == 2
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert run_precompute(tmp_path, images, tmp_path / "new") == 2
    assert "no vae/ folder" in caplog.text
    assert run_precompute(tmp_path / "nowhere", images, tmp_path / "new") == 2
    assert f"--model {tmp_path / 'nowhere'} does not exist" in caplog.text
    assert run_precompute(sd3_dir, images, tmp_path / "odd", "--aspect-buckets", "--bucket-step", "6") == 2
    assert "--bucket-step 6 must be a multiple of 4 (VAE downsampling 2 x patch 2)" in caplog.text


def test_auto_quantizes_the_text_encoders_only_where_they_do_not_fit_the_gpu(tmp_path):
    """--text-encoder-quantization auto: unquantized on the CPU and where they fit beside a batch's encoding, else
    int8, else nf4; refused, with the ways out, where even nf4 does not fit; a scheme asked for is kept; resuming,
    auto is what the directory was started with (not what the memory free today would give)."""
    from data.precompute.encoders import GIB, text_quantization
    sizes, room = {"none": 16 * GIB, "int8": 8 * GIB, "nf4": 4 * GIB}, 2 * GIB
    assert text_quantization("auto", sizes, None, room) == "none"
    assert [text_quantization("auto", sizes, free, room) for free in (18 * GIB, 16 * GIB, 6 * GIB)] == \
        ["none", "int8", "nf4"]
    assert text_quantization("nf4", sizes, 80 * GIB, room) == "nf4"
    assert text_quantization("none", sizes, GIB, room) == "none"
    with pytest.raises(PrecomputeError, match=r"need 4.0 GiB even in nf4, beside 2.0 GiB to encode a batch, and "
                       r"5.0 GiB is free on the fullest GPU: precompute on a larger GPU, with a smaller --batch-size"):
        text_quantization("auto", sizes, 5 * GIB, room)
    args = precompute_latents.parse_args(["--model", "m", "--images", "i", "--out", str(tmp_path)])
    assert precompute_latents.text_quantization_asked(args) == "auto"  # a new directory
    (tmp_path / "precompute.json").write_text('{"text_embeddings": "precomputed", '
                                              '"text_encoders": {"dtype": "bfloat16", "linears": "int8"}}')
    assert precompute_latents.text_quantization_asked(args) == "int8"
    (tmp_path / "precompute.json").write_text('{"text_embeddings": "precomputed"}')
    assert precompute_latents.text_quantization_asked(args) == "none"


def test_every_bad_input_is_named_at_once_before_anything_is_written_and_fixing_them_lets_the_same_command_run(
        sd3_dir, tmp_path, caplog):
    """A corrupt image, a latin-1 caption (an error: the encoding is not guessed) and a missing one: one report."""
    images = image_folder(tmp_path / "images", [(16, 16), (16, 16), (20, 16), (16, 16), (16, 16)])
    (images / "img01.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)  # a PNG signature, then garbage
    (images / "img02.txt").write_text("")
    (images / "img03.txt").write_bytes("a caf\u00e9 on the grass".encode("latin-1"))
    (images / "img04.txt").unlink()
    out = tmp_path / "sub" / "out"
    assert run_precompute(sd3_dir, images, out) == 2
    assert (f"--images {images}: 3 bad input(s) (not UTF-8 text: 1, no same-named .txt caption: 1, not a readable "
            f"image: 1)") in caplog.text and "iconv -f latin1 -t utf-8" in caplog.text
    assert f"{images / 'img03.txt'}: not UTF-8 text (byte 0xe9 at offset 5)" in caplog.text
    assert f"{images / 'img04.png'}: no same-named .txt caption" in caplog.text
    assert f"{images / 'img01.png'}: not a readable image" in caplog.text
    assert not (tmp_path / "sub").exists()  # checked before the output directory or any encoder
    (images / "img01.png").unlink()
    (images / "img01.txt").unlink()
    (images / "img03.txt").write_text("a caf\u00e9 on the grass")
    (images / "img04.png").unlink()
    assert run_precompute(sd3_dir, images, out) == 0
    assert f"1 of 3 images have an empty caption (trained as unconditional): {images / 'img02.txt'}" in caplog.text
    assert len(LatentDataset(out)) == 3


def test_an_interrupted_precompute_says_the_rerun_resumes(sd3_dir, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="mmdit")
    images = image_folder(tmp_path / "images", [(16, 16)] * 6)
    real = encode_unit

    def interrupt_second_unit(number, *args):
        if number == 1:  # a scheduler's SIGTERM (the launcher passes it on), taken as Ctrl-C is
            os.kill(os.getpid(), signal.SIGTERM)
        return real(number, *args)

    monkeypatch.setattr(data.precompute.job, "encode_unit", interrupt_second_unit)
    assert run_precompute(sd3_dir, images, tmp_path / "out") == 130
    assert "interrupted with 1 unit(s) finished; the same command resumes from there" in caplog.text
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # as it was before
    monkeypatch.undo()
    assert run_precompute(sd3_dir, images, tmp_path / "out") == 0
    assert "resuming: 1 of 2 units already finished" in caplog.text


def test_the_progress_bar_has_a_rate_from_its_first_line_and_draws_its_last_line_once(tmp_path, capsys):
    """A large model on a CPU, 40 s for its first image: 40.0 s/img, not "0.0 img/s"; the full bar is drawn once
    (it was drawn four times: a log shows every line), and a resume with nothing left draws no bar."""
    (tmp_path / PROGRESS).mkdir()
    progress = Progress(tmp_path, Ranks(), 2, 0)
    progress.start -= 40
    for _ in range(2):
        progress(images=1)
        progress(units=1)
    assert progress.finish([]) == []
    lines = capsys.readouterr().out.replace("\r", "\n").splitlines()
    assert [line.endswith("40.0 s/img]") for line in lines if "0/2" in line] == [False, True], lines
    assert len([line for line in lines if "2/2" in line]) == 1 and not any("0.0 img/s" in line for line in lines)
    assert Progress(tmp_path, Ranks(), 2, 2).finish([]) == [] and capsys.readouterr().out == ""


def test_values_fp16_cannot_hold_stop_precompute_instead_of_being_stored_as_inf():
    from data.precompute.encoders import stored
    rows = {"prompt_embeds": torch.tensor([[1.0, -70000.0]]), "latents": torch.ones(1, 2)}
    assert stored(rows, torch.bfloat16)["prompt_embeds"].dtype == torch.bfloat16
    with pytest.raises(FloatingPointError, match=r"prompt_embeds: values beyond the range of torch.float16 .*"
                       r"precompute again with --dtype bf16"):
        stored(rows, torch.float16)


def test_flipped_copies_and_validation_prompts_are_stored(sd3_dir, tmp_path):
    images = image_folder(tmp_path / "images", [(16, 16), (16, 16)])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n\na dog on the grass\n")
    assert run_precompute(sd3_dir, images, tmp_path / "data", "--random-flip", "--validation-prompts", str(prompts)) == 0
    ds = LatentDataset(tmp_path / "data")
    pipe = pipeline(sd3_dir, None)
    pixels = load_image(images / "img00.png", (16, 16))
    with torch.no_grad():
        flipped = (pipe.vae.encode(pixels.flip(-1)[None]).latent_dist.mean - 0.0609) * 1.5305
        embeds, _, pooled, _ = pipe.encode_prompt(["a red cat", "a dog on the grass"], None, None,
                                                  do_classifier_free_guidance=False, max_sequence_length=T5_TOKENS)
    torch.testing.assert_close(ds[0]["latents_flipped"], flipped[0], rtol=1e-5, atol=1e-5)
    assert ds.validation_captions == ["a red cat", "a dog on the grass"]
    torch.testing.assert_close(ds.validation_prompts["prompt_embeds"], embeds, rtol=0, atol=1e-6)
    torch.testing.assert_close(ds.validation_prompts["pooled_prompt_embeds"], pooled, rtol=0, atol=1e-6)
    assert json.loads((tmp_path / "data" / "dataset.json").read_text())["vae"]["folder"] == str(sd3_dir / "vae")
    prompts.write_text("a green circle\n")  # prompts can change on a finished dataset: only they are re-encoded
    assert run_precompute(sd3_dir, images, tmp_path / "data", "--random-flip", "--validation-prompts", str(prompts)) == 0
    assert LatentDataset(tmp_path / "data").validation_captions == ["a green circle"]


def test_exif_rotation_is_applied(tmp_path):
    """A phone photo stored sideways with an EXIF orientation is bucketed and encoded as it is displayed."""
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6  # rotate 90 degrees to display
    pixels = torch.zeros(20, 40, 3, dtype=torch.uint8)
    pixels[:, :20] = 255  # the stored left half is white: displayed, the top half
    Image.fromarray(pixels.numpy()).save(tmp_path / "phone.png", exif=exif)
    assert image_size(tmp_path / "phone.png") == (20, 40)
    image = load_image(tmp_path / "phone.png", (40, 20))
    assert image[:, :20].mean() > 0.9 and image[:, 20:].mean() < -0.9


FINETUNE = ["data.name=latents", "model.patch_size=2", "model.num_layers=2", "model.num_attention_heads=2",
            "model.attention_head_dim=8", "model.sample_size=8", "model.pos_embed_max_size=8",
            "model.dual_attention_layers=[0]", "training.train_batch_size=4", "training.max_steps=3",
            "optimizer.lr=5e-2", "optimizer.warmup_steps=1", "logging.log_every=1", "checkpoint.every=0"]


def test_image_folder_to_diffusers_full_and_lora(sd3_dir, tmp_path):
    """docs/fine-tuning.md's worked example on tiny local models: the exported transformer, and the exported adapter
    loaded by the SD3 pipeline, give the outputs of this project's fine-tuned model."""
    images = image_folder(tmp_path / "images", [(16, 16), (20, 18), (16, 16), (24, 24)] * 2)
    assert run_precompute(sd3_dir, images, tmp_path / "data") == 0
    run = [*FINETUNE, f"data.path={tmp_path / 'data'}"]
    base = export_random_base(run, tmp_path / "base")

    assert main([*run, f"model.init_from={base}", f"logging.output_dir={tmp_path / 'full'}"]) == 0
    assert main([*run, f"model.init_from={base}", "lora.enabled=true", "lora.rank=2", "lora.alpha=4",
                 f"logging.output_dir={tmp_path / 'lora'}"]) == 0
    for name in ("full", "lora"):
        assert export_mmdit.main(["--checkpoint", str(tmp_path / name), "--out", str(tmp_path / f"{name}-out")]) == 0
    assert (tmp_path / "lora-out" / LORA_WEIGHTS).is_file()

    from perf.checkpoint import find_checkpoint
    from sample_mmdit import load_trained
    ds = LatentDataset(tmp_path / "data")
    x, c, p = ds[0]["latents"][None], ds[0]["prompt_embeds"][None], ds[0]["pooled_prompt_embeds"][None]
    t = torch.tensor([700.0])
    full = diffusers.SD3Transformer2DModel.from_pretrained(tmp_path / "full-out").eval()
    lora = pipeline(sd3_dir, diffusers.SD3Transformer2DModel.from_pretrained(base).eval())
    call = lambda transformer: transformer(hidden_states=x, encoder_hidden_states=c, pooled_projections=p, timestep=t,
                                           return_dict=False)[0]
    with torch.no_grad():
        before = call(lora.transformer)
        lora.load_lora_weights(tmp_path / "lora-out")
        assert (call(lora.transformer) - before).abs().max() > 1e-3  # the adapter is applied
        for name, transformer in (("full", full), ("lora", lora.transformer)):
            ours = load_trained(find_checkpoint(tmp_path / name))[0].transformer
            torch.testing.assert_close(call(transformer), ours(x, c, p, t), rtol=0, atol=1e-5)


def test_lora_walkthrough_from_another_directory_validates_and_resumes(sd3_dir, tmp_path, monkeypatch, caplog):
    """docs/fine-tuning.md's path as a user runs it: precompute with validation prompts, then a LoRA fine-tune started
    from another working directory with relative paths, the architecture taken from model.init_from (no model.*
    keys), held-out items and periodic validation; then the same command again (in this process, from that
    directory) resumes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    work = tmp_path / "work"
    work.mkdir()
    images = image_folder(work / "images", [(16, 16), (20, 18), (16, 16), (24, 24)] * 3)
    (work / "prompts.txt").write_text("a red cat\na dog on the grass\na blue square\n")
    assert precompute_latents.main(["--model", str(sd3_dir), "--images", str(images), "--out", str(work / "data"),
                            "--resolution", "16", "--dtype", "fp32", "--max-sequence-length", str(T5_TOKENS),
                            "--validation-prompts", str(work / "prompts.txt")]) == 0
    small = ["model.patch_size=2", "model.num_layers=2", "model.num_attention_heads=2", "model.attention_head_dim=8",
             "model.sample_size=8", "model.pos_embed_max_size=8"]
    export_random_base(["data.name=latents", f"data.path={work / 'data'}", *small], work / "base")
    (work / "lora.yaml").write_text("data:\n  name: latents\nlora:\n  enabled: true\n  rank: 2\n")
    command = [str(ROOT / "train_mmdit_stable.sh"), "--config", "lora.yaml", "data.path=data", "model.init_from=base",
               "logging.output_dir=runs/lora", "data.holdout=2", "validation.every=2", "validation.loss_sigmas=4",
               "training.max_steps=4", "training.train_batch_size=2", "optimizer.warmup_steps=1",
               "sampling.steps=2", "logging.log_every=1", "checkpoint.every=2"]
    env = {**os.environ, "PYTHON": sys.executable}
    first = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run = work / "runs" / "lora"  # relative to where the command ran, not to the checkout
    assert sorted(p.name for p in (run / "samples").glob("*.png")) == ["step_00000002.png", "step_00000004.png"]
    assert Image.open(run / "samples" / "step_00000004.png").size[0] > 0
    assert (run / "samples" / "step_00000004.txt").read_text().splitlines()[1] == "a dog on the grass"
    val = [r for r in metric_rows(run) if "val/loss" in r]
    assert [r["step"] for r in val] == [2, 4] and len([k for k in val[0] if k.startswith("val/loss_by_sigma/")]) == 4
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Images("samples")] == [2, 4]
    assert [e.step for e in events.Scalars("val/loss")] == [2, 4]
    config = (run / "config.yaml").read_text()
    assert f"init_from: {work / 'base'}" in config and "num_layers: 2" in config  # resolved, and from the base
    monkeypatch.chdir(work)
    caplog.set_level(logging.INFO, logger="mmdit")
    assert train_mmdit_stable.main(command[1:]) == 0
    assert "resumed from" in caplog.text and "step_00000004" in caplog.text


def test_sampling_a_run_whose_pipeline_moved_names_it_and_the_flag_that_points_at_a_copy(sd3_dir, tmp_path, caplog):
    """sample_mmdit.py decodes with the VAE (and encodes new prompts with the text encoders) of the pipeline the
    run's precompute recorded; moved away, the folder is named with the flag that points at another copy
    (--pipeline), which then samples."""
    import shutil

    import sample_mmdit
    from tests.conftest import LATENT_RUN
    moved = tmp_path / "pipeline"
    shutil.copytree(sd3_dir, moved)
    (tmp_path / "prompts.txt").write_text("a red cat\n")
    run_precompute(moved, image_folder(tmp_path / "images", [(16, 16)] * 4), tmp_path / "data",
                   "--validation-prompts", str(tmp_path / "prompts.txt"))
    latents = [*LATENT_RUN, f"data.path={tmp_path / 'data'}"]
    base = export_random_base(latents, tmp_path / "base")
    assert main([*latents, f"model.init_from={base}", "lora.enabled=true", "lora.rank=2", "training.max_steps=1",
                 "training.train_batch_size=2", "validation.at_end=false", f"logging.output_dir={tmp_path / 'run'}"]) == 0
    shutil.rmtree(moved)
    sample = ["--checkpoint", str(tmp_path / "run"), "--steps", "1"]
    assert sample_mmdit.main([*sample, "--out", str(tmp_path / "a")]) == 2
    assert f"{moved / 'vae'} is not a diffusers VAE folder (no config.json); set --pipeline to the pipeline (or its " \
           f"vae/ folder) that encoded the data" in caplog.text and not (tmp_path / "a").exists()
    assert sample_mmdit.main([*sample, "--pipeline", str(sd3_dir), "--prompts", str(tmp_path / "prompts.txt"),
                              "--out", str(tmp_path / "b")]) == 0
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["0000.png"]
