"""Masked loss: masks from alpha channels and mask files become latent-resolution loss weights at precompute
(cropped and mirrored with their image; an empty one is a skipped sample), the loss is the mean over weighted
latent elements, all-white masks train exactly as no mask, and the masked-out region gets no gradient."""

import json
import logging

import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import precompute_latents
from data.latents import INDEX, LatentDataset, shard_record
from data.loader import StepDataset
from data.webdataset import read_samples
from models.rectified_flow import FLIP_STREAM, per_sample_loss, sample_key
from tests.conftest import T5_TOKENS, assert_close, assert_differs, final_weights, write_latent_shards, write_shard
from train_mmdit_stable import main


def add_masks(directory, mask_of) -> None:
    """Give a latent dataset a `loss_mask` field (mask_of(latents) -> [N, 1, h, w]), as precompute stores it."""
    index = json.loads((directory / INDEX).read_text())
    for record in index["shards"]:
        path = directory / record["file"]
        tensors = load_file(path)
        tensors["loss_mask"] = mask_of(tensors["latents"]).half()
        save_file(tensors, path, metadata={"captions": json.dumps(["?"] * record["count"])})
        record.update(shard_record(directory, record["file"], record["count"], record["latent_size"]), masks=True)
    (directory / INDEX).write_text(json.dumps({**index, "masks": True}))


def save(image: Image.Image, path, **options) -> None:
    image.save(path, **options)
    path.with_name(path.name.split(".")[0] + ".txt").write_text("a red cat")


def test_precompute_turns_alpha_and_mask_files_into_latent_weights(sd3_dir, tmp_path):
    """16 px images, a VAE that halves: 8x8 latents, each weight the mean of its 2x2 pixels' mask."""
    images = tmp_path / "images"
    images.mkdir()
    def noise(w: int, h: int) -> Image.Image:
        gen = torch.Generator().manual_seed(w)
        return Image.frombytes("RGB", (w, h), torch.randint(0, 256, (w * h * 3,), dtype=torch.uint8, generator=gen)
                               .numpy().tobytes())
    rgba = noise(16, 16).convert("RGBA")
    rgba.putalpha(Image.frombytes("L", (16, 16), bytes([0] * 8 + [255] * 8) * 16))  # left half transparent
    save(rgba, images / "a.png")
    save(noise(20, 16), images / "b.png")  # 20 wide: the crop keeps columns 2..17 of it and of its mask
    Image.frombytes("L", (20, 16), bytes([255] * 20 * 8 + [0] * 20 * 8)).save(images / "b.mask.png")  # top half
    save(noise(16, 16), images / "c.png")  # no mask: weighs 1 everywhere
    save(noise(16, 16), images / "d.png")
    Image.new("L", (16, 16), 0).save(images / "d.mask.png")  # black everywhere: skipped
    webp = noise(16, 16).convert("RGBA")
    webp.putalpha(Image.frombytes("L", (16, 16), (bytes([0] * 8 + [255] * 8) * 8) + bytes([255] * 16 * 8)))
    save(webp, images / "e.webp", lossless=True)  # top-left quadrant transparent
    out = tmp_path / "data"
    assert precompute_latents.main(["--model", str(sd3_dir), "--images", str(images), "--out", str(out),
                                    "--resolution", "16", "--dtype", "fp32", "--max-sequence-length", str(T5_TOKENS),
                                    "--random-flip", "--max-bad-fraction", "0.5"]) == 0
    assert json.loads((out / INDEX).read_text())["masks"] is True
    skipped = json.loads((out / "reports" / "00000.json").read_text())["skipped"]
    assert [(s["key"].rsplit("/", 1)[1], s["why"]) for s in skipped] == [("d.png", "empty mask: black everywhere in "
                                                                                   "the crop")]
    ds = LatentDataset(out, masks=True)
    half = torch.tensor([0.0] * 4 + [1.0] * 4)
    top = (torch.arange(8) < 4)[:, None].float().expand(8, 8)
    expected = [half.expand(8, 8), top, torch.ones(8, 8), torch.where((top > 0) & (half == 0), 0.0, 1.0)]
    for i, mask in enumerate(expected):
        assert torch.equal(ds[i]["loss_mask"], mask[None]), i
    mirrored = next(k for k in range(64) if sample_key(0, FLIP_STREAM, f"{k}/0") % 2)  # an epoch mirroring item 0
    item = StepDataset(ds, seed=0)[(0, 0, 0, mirrored)]
    assert torch.equal(item["latents"], ds[0]["latents_flipped"])
    assert torch.equal(item["loss_mask"], half.flip(0).expand(1, 8, 8))
    assert "loss_mask" not in LatentDataset(out)[0]  # data.use_masks=false


def test_a_shard_sample_reads_its_mask_member(tmp_path):
    shard = write_shard(tmp_path / "00000.tar", {"k0.png": b"png0", "k0.txt": b"a cat", "k0.mask.png": b"mask0",
                                                  "k1.png": b"png1", "k1.txt": b"a dog"})
    samples = list(read_samples(str(shard)))
    assert [(s.image, s.mask) for s in samples] == [(b"png0", b"mask0"), (b"png1", None)]


def test_the_loss_is_the_mean_over_weighted_elements_and_the_masked_out_region_gets_no_gradient():
    gen = torch.Generator().manual_seed(0)
    v, x0, noise = (torch.randn(2, 4, 6, 6, generator=gen) for _ in range(3))
    v.requires_grad_(True)
    x0.requires_grad_(True)
    mask = torch.ones(2, 1, 6, 6)
    mask[:, :, :, :3] = 0  # left half out
    mask[1, :, 0, 3] = 0.5
    loss = per_sample_loss(v, x0, noise, mask)
    squared = (v - (noise - x0)) ** 2
    torch.testing.assert_close(loss, (squared * mask).sum((1, 2, 3)) / (4 * mask.sum((1, 2, 3))), rtol=0, atol=1e-6)
    grad_v, grad_x0 = torch.autograd.grad(loss.sum(), (v, x0))
    for grad in (grad_v, grad_x0):
        assert not grad[..., :3].any() and grad[..., 3:].all()  # no gradient from the masked-out region
    plain = per_sample_loss(v, x0, noise)
    assert torch.equal(per_sample_loss(v, x0, noise, torch.ones_like(mask)), plain)


def test_all_white_masks_train_bit_for_bit_as_no_mask_and_real_masks_change_training(latent_run, tmp_path, caplog):
    white, half = tmp_path / "white", tmp_path / "half"
    for directory, value in ((white, 1.0), (half, 0.0)):
        write_latent_shards(directory, flipped=True)
        add_masks(directory, lambda latents: torch.cat([torch.full_like(latents[:, :1, :, :4], value),
                                                        torch.ones_like(latents[:, :1, :, 4:])], -1))
    caplog.set_level(logging.INFO)
    steps = ["training.max_steps=2", "data.caption_dropout=0.5"]
    assert main(latent_run(*steps, "data.use_masks=false", data=white, run="unmasked")) == 0
    assert main(latent_run(*steps, data=white, run="white")) == 0  # auto: the dataset has masks
    assert "has loss masks: the loss is weighted by them" in caplog.text
    assert_close(final_weights(tmp_path / "white"), final_weights(tmp_path / "unmasked"))
    assert main(latent_run(*steps, data=half, run="half")) == 0
    assert_differs(final_weights(tmp_path / "half"), final_weights(tmp_path / "unmasked"))


def test_use_masks_true_on_a_dataset_without_masks_is_a_config_error(latent_run, tmp_path, caplog):
    assert main(latent_run("training.max_steps=1", "data.use_masks=true")) == 2
    assert "data.use_masks=true but" in caplog.text and "has no loss masks" in caplog.text
    assert not (tmp_path / "run").exists()
