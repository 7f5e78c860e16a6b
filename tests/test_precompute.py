"""The precompute tool on a tiny, randomly initialised SD3 pipeline saved locally (nothing is downloaded), and
the whole fine-tuning path: image folder -> precompute -> full and LoRA fine-tunes -> export -> diffusers."""

import json

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import export_mmdit
from data import precompute
from data.latents import LatentDataset
from models.diffusers_io import LORA_WEIGHTS
from tests.conftest import export_random_base
from train_mmdit_stable import main

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
WORDS = "a red blue green circle square cat dog on the grass in snow photo of".split()
CLIP_TOKENS, T5_TOKENS = 8, 6


def tokenizer(max_length: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                                eos_token="<eos>", model_max_length=max_length)


def clip(hidden: int):
    config = transformers.CLIPTextConfig(vocab_size=len(WORDS) + 3, hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=CLIP_TOKENS,
                                         projection_dim=8, pad_token_id=0, eos_token_id=2)
    return transformers.CLIPTextModelWithProjection(config)


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    """An SD3 pipeline directory in diffusers' layout: 16-channel... here 4-channel VAE with one downsampling,
    CLIP-L (8 wide), CLIP-G (16 wide), T5 (24 wide): joint dim 24, pooled dim 8 + 8."""
    root = tmp_path_factory.mktemp("sd3")
    torch.manual_seed(0)
    diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                            up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1,
                            latent_channels=4, norm_num_groups=4, shift_factor=0.0609,
                            scaling_factor=1.5305).save_pretrained(root / "vae")
    clip(8).save_pretrained(root / "text_encoder")
    clip(16).save_pretrained(root / "text_encoder_2")
    t5 = transformers.T5Config(vocab_size=len(WORDS) + 3, d_model=24, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
                               relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=2)
    transformers.T5EncoderModel(t5).save_pretrained(root / "text_encoder_3")
    for folder, length in (("tokenizer", CLIP_TOKENS), ("tokenizer_2", CLIP_TOKENS), ("tokenizer_3", T5_TOKENS)):
        tokenizer(length).save_pretrained(root / folder)
    return root


def image_folder(directory, sizes):
    """Random-coloured images of the given (width, height) with captions from the tokenizers' vocabulary."""
    directory.mkdir()
    gen = torch.Generator().manual_seed(0)
    for i, (w, h) in enumerate(sizes):
        pixels = torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(directory / f"img{i:02d}.png")
        words = [WORDS[j] for j in torch.randint(len(WORDS), (4 + i % 5,), generator=gen)]
        (directory / f"img{i:02d}.txt").write_text(" ".join(words))
    return directory


def run_precompute(sd3_dir, images, out, *extra):
    return precompute.main(["--model", str(sd3_dir), "--images", str(images), "--out", str(out), "--resolution", "16",
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


def test_shards_hold_what_the_sd3_pipeline_computes(sd3_dir, tmp_path):
    images = image_folder(tmp_path / "images", [(16, 16), (20, 16), (16, 24), (32, 32), (16, 16), (17, 15)])
    assert run_precompute(sd3_dir, images, tmp_path / "data") == 0
    ds = LatentDataset(tmp_path / "data")
    assert len(ds) == 6 and ds.latent_sizes == [(8, 8)] and ds.text_dims == (24, 16)
    assert ds.text_tokens == CLIP_TOKENS + T5_TOKENS
    pipe = pipeline(sd3_dir, None)
    captions = [(images / f"img{i:02d}.txt").read_text() for i in range(6)]
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(captions, None, None, do_classifier_free_guidance=False,
                                                  max_sequence_length=T5_TOKENS)
        empty, _, empty_pooled, _ = pipe.encode_prompt("", None, None, do_classifier_free_guidance=False,
                                                       max_sequence_length=T5_TOKENS)
        pixels = torch.stack([precompute.load_image(images / f"img{i:02d}.png", (16, 16)) for i in range(6)])
        latents = (pipe.vae.encode(pixels).latent_dist.mean - 0.0609) * 1.5305
    for i in range(6):
        assert ds[i]["caption"] == captions[i]
        torch.testing.assert_close(ds[i]["prompt_embeds"], embeds[i], rtol=0, atol=1e-6)
        torch.testing.assert_close(ds[i]["pooled_prompt_embeds"], pooled[i], rtol=0, atol=1e-6)
        torch.testing.assert_close(ds[i]["latents"], latents[i], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ds.empty_prompt["prompt_embeds"], empty, rtol=0, atol=1e-6)
    torch.testing.assert_close(ds.empty_prompt["pooled_prompt_embeds"], empty_pooled, rtol=0, atol=1e-6)


def test_aspect_buckets_and_resume(sd3_dir, tmp_path):
    sizes = [(32, 32), (64, 32), (32, 64), (32, 32), (48, 32), (64, 32), (32, 32), (30, 62), (32, 32)]
    images = image_folder(tmp_path / "images", sizes)
    buckets = ["--aspect-buckets", "--resolution", "32"]  # 32x32, 40x24, 24x40, 48x24, 24x48 pixels
    assert run_precompute(sd3_dir, images, tmp_path / "whole", *buckets) == 0
    whole = LatentDataset(tmp_path / "whole", aspect_buckets=True)
    assert whole.latent_sizes == [(12, 20), (12, 24), (16, 16), (24, 12)]  # the VAE halves each side
    assert [whole.sizes[i] for i in range(4)] == [(12, 24), (16, 16), (16, 16), (24, 12)]  # chunk 0, by size
    # Interrupted after the first chunk: the rerun skips it and finishes with the same shards.
    assert run_precompute(sd3_dir, images, tmp_path / "part", *buckets) == 0
    for path in [tmp_path / "part" / "dataset.json", *(tmp_path / "part").glob("chunk-0000[12].json")]:
        path.unlink()
    with pytest.raises(ValueError, match="its precompute has not finished"):
        LatentDataset(tmp_path / "part", aspect_buckets=True)
    kept = sorted((tmp_path / "part").glob("shard-00000-*"))
    mtimes = [p.stat().st_mtime_ns for p in kept]
    assert run_precompute(sd3_dir, images, tmp_path / "part", *buckets) == 0
    assert [p.stat().st_mtime_ns for p in kept] == mtimes  # chunk 0 was not redone
    assert json.loads((tmp_path / "part" / "dataset.json").read_text())["shards"] == \
        json.loads((tmp_path / "whole" / "dataset.json").read_text())["shards"]
    for name in [s["file"] for s in json.loads((tmp_path / "whole" / "dataset.json").read_text())["shards"]]:
        a, b = load_file(tmp_path / "whole" / name), load_file(tmp_path / "part" / name)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_inputs_are_named_before_compute(sd3_dir, tmp_path, caplog):
    images = image_folder(tmp_path / "images", [(16, 16), (16, 16)])
    (images / "img01.txt").unlink()
    assert run_precompute(sd3_dir, images, tmp_path / "out") == 2
    assert "1 images have no same-named .txt caption" in caplog.text and "img01.png" in caplog.text
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"image": "images/img00.png", "caption": "a cat"}\n{"img": "x"}\n')
    assert precompute.main(["--model", str(sd3_dir), "--manifest", str(manifest), "--out", str(tmp_path / "o")]) == 2
    assert "line 2: expected" in caplog.text
    assert precompute.main(["--model", str(sd3_dir), "--manifest", str(tmp_path / "none.jsonl"), "--out", "x"]) == 2
    assert "none.jsonl does not exist" in caplog.text
    (images / "img01.txt").write_text("a dog")
    assert run_precompute(sd3_dir, images, tmp_path / "out") == 0
    assert run_precompute(sd3_dir, images, tmp_path / "out", "--aspect-buckets") == 2  # not the settings it began with
    assert "was started with other settings" in caplog.text and "aspect_buckets" in caplog.text
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert run_precompute(sd3_dir, images, tmp_path / "mine") == 2
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert run_precompute(tmp_path, images, tmp_path / "new") == 2
    assert "no vae/ folder" in caplog.text
    assert run_precompute(sd3_dir, images, tmp_path / "odd", "--aspect-buckets", "--bucket-step", "6") == 2
    assert "--bucket-step 6 must be a multiple of 4 (VAE downsampling 2 x patch 2)" in caplog.text


def test_exif_rotation_is_applied(tmp_path):
    """A phone photo stored sideways with an EXIF orientation is bucketed and encoded as it is displayed."""
    exif = Image.Exif()
    exif[precompute.EXIF_ORIENTATION] = 6  # rotate 90 degrees to display
    pixels = torch.zeros(20, 40, 3, dtype=torch.uint8)
    pixels[:, :20] = 255  # the stored left half is white: displayed, the top half
    Image.fromarray(pixels.numpy()).save(tmp_path / "phone.png", exif=exif)
    assert precompute.image_size(tmp_path / "phone.png") == (20, 40)
    image = precompute.load_image(tmp_path / "phone.png", (40, 20))
    assert image[:, :20].mean() > 0.9 and image[:, 20:].mean() < -0.9


FINETUNE = ["data.name=latents", "model.patch_size=2", "model.num_layers=2", "model.num_attention_heads=2",
            "model.attention_head_dim=8", "model.sample_size=8", "model.pos_embed_max_size=8",
            "model.dual_attention_layers=[0]", "training.train_batch_size=4", "training.max_steps=3",
            "optimizer.lr=5e-2", "optimizer.warmup_steps=1", "logging.log_every=1", "logging.save_freq=0"]


@pytest.mark.slow
def test_image_folder_to_diffusers_full_and_lora(sd3_dir, tmp_path):
    """The README's worked example on tiny local models: the exported transformer, and the exported adapter
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
