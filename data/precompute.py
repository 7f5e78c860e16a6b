"""Encode an image-caption collection once into latent shards (see data/latents.py) for fine-tuning.

    python precompute_latents.py --model SD3_DIR (--images DIR | --manifest FILE) --out DIR
        [--resolution 1024] [--aspect-buckets] [--random-flip] [--validation-prompts FILE] [--batch-size 8]
        [--shard-size 1000] [--device auto] [--dtype fp16]

SD3_DIR is a Stable Diffusion 3 / 3.5 pipeline directory as diffusers lays it out: vae/, text_encoder/ +
tokenizer/ (CLIP-L), text_encoder_2/ + tokenizer_2/ (CLIP-G) and, optionally, text_encoder_3/ + tokenizer_3/
(T5; without it the T5 part is zeros, as the pipeline does). Nothing is downloaded.

--images DIR takes every image file with a same-named .txt caption beside it; --manifest takes a JSONL file
of {"image": path relative to the manifest, "caption": text}. The embeddings are what
`StableDiffusion3Pipeline.encode_prompt` gives; the latents are the VAE posterior mean, shifted and scaled as
the pipeline expects. Each image is resized to cover its target size and centre-cropped; the target is
--resolution squared, or with --aspect-buckets the bucket of about that area nearest its aspect ratio.

--random-flip also stores the latents of each image mirrored left-right; training then uses one of the two per
(seed, epoch, item). --validation-prompts FILE (one prompt per line) stores their encodings for the validation
images training draws (validation.every); they can be added or changed by rerunning with a finished dataset.

Every input (captions, image headers, the pipeline's folders) is checked before the output directory is made
or an encoder is loaded. The work runs in chunks of --shard-size items, each published by rename with a
marker; a rerun with the same settings skips finished chunks, so an interrupted run (Ctrl-C too) continues
where it stopped. `dataset.json` is written last: a directory without it is not a finished dataset.
"""

import argparse
import hashlib
import json
import logging
import math
import os
import sys
from pathlib import Path

import torch
from PIL import Image, ImageOps

from data.latents import EMPTY_PROMPT, INDEX, PRECOMPUTE_SETTINGS as SETTINGS, VALIDATION_PROMPTS
from models.diffusers_io import save_safetensors

log = logging.getLogger("mmdit")
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SD3_JOINT_DIM = 4096  # T5-XXL width: the width of the zeros that stand in for T5 when it is absent
PATCH = 2  # the MMDiT's patch side in latents (SD3 / SD3.5)
EXIF_ORIENTATION = 0x0112


class PrecomputeError(ValueError):
    pass


# ----------------------------------------------------------------------------------------------- inputs


def read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PrecomputeError(f"{what} {path} is not readable UTF-8 text ({e})") from None


def read_image_folder(directory: Path) -> list[tuple[Path, str]]:
    if not directory.is_dir():
        raise PrecomputeError(f"--images {directory} is not a directory")
    images = sorted(p for p in directory.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise PrecomputeError(f"--images {directory}: no image files ({sorted(IMAGE_SUFFIXES)})")
    uncaptioned = [str(p) for p in images if not p.with_suffix(".txt").is_file()]
    if uncaptioned:
        raise PrecomputeError(f"--images {directory}: {len(uncaptioned)} images have no same-named .txt caption, "
                              f"e.g. {uncaptioned[:3]}")
    return [(p, read_text(p.with_suffix(".txt"), "caption").strip()) for p in images]


def read_manifest(path: Path) -> list[tuple[Path, str]]:
    if not path.is_file():
        raise PrecomputeError(f"--manifest {path} does not exist")
    items = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            image, caption = path.parent / record["image"], record["caption"]
        except (ValueError, KeyError, TypeError) as e:
            raise PrecomputeError(f"--manifest {path} line {number}: expected "
                                  f'{{"image": ..., "caption": ...}} ({type(e).__name__}: {e})') from None
        if not image.is_file():
            raise PrecomputeError(f"--manifest {path} line {number}: image {image} does not exist")
        items.append((image, str(caption)))
    if not items:
        raise PrecomputeError(f"--manifest {path} lists no images")
    return items


def aspect_buckets(resolution: int, step: int) -> list[tuple[int, int]]:
    """(height, width) pixel sizes, multiples of `step`, of about resolution^2 area and aspect ratio 1:2 to 2:1."""
    sizes = set()
    for width in range(step, 2 * resolution + 1, step):
        height = round(resolution * resolution / width / step) * step
        if height and 0.5 <= width / height <= 2:
            sizes |= {(height, width), (width, height)}
    return sorted(sizes)


def target_size(image_size: tuple[int, int], buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest the image's (PIL size is width, height)."""
    ratio = math.log(image_size[0] / image_size[1])
    return min(buckets, key=lambda hw: abs(math.log(hw[1] / hw[0]) - ratio))


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) as displayed, from the file header (EXIF rotation applied); `verify` also checks the
    file's integrity where the format allows it (PNG checksums) without decoding the pixels."""
    try:
        with Image.open(path) as image:
            image.verify()  # must come right after opening
        with Image.open(path) as image:
            rotated = image.getexif().get(EXIF_ORIENTATION) in (5, 6, 7, 8)
            return image.size[::-1] if rotated else image.size
    except (OSError, SyntaxError, ValueError) as e:  # PIL reports some broken files as SyntaxError
        raise PrecomputeError(f"{path}: not a readable image ({e})") from None


def check_inputs(items: list[tuple[Path, str]]) -> list[tuple[int, int]]:
    """Every image's size, or one error listing every unreadable image; warns about empty captions."""
    sizes, bad = [], []
    for path, _ in items:
        try:
            sizes.append(image_size(path))
        except PrecomputeError as e:
            bad.append(str(e))
    if bad:
        raise PrecomputeError(f"{len(bad)} of {len(items)} images are not readable; remove or replace them and rerun "
                              f"(nothing was written): {bad[:5]}")
    empty = [str(path) for path, caption in items if not caption]
    if empty:
        log.warning("%d of %d images have an empty caption (trained as unconditional), e.g. %s", len(empty),
                    len(items), empty[:3])
    return sizes


def read_validation_prompts(path: Path) -> list[str]:
    if not path.is_file():
        raise PrecomputeError(f"--validation-prompts {path} does not exist")
    prompts = [line.strip() for line in read_text(path, "--validation-prompts").splitlines() if line.strip()]
    if not prompts:
        raise PrecomputeError(f"--validation-prompts {path} holds no prompt (one per line)")
    return prompts


def vae_downsampling(model_dir: Path) -> int:
    """From the pipeline's folders and vae/config.json, before any weight is loaded: 8 for SD3's VAE."""
    for folder in ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"):
        if not (model_dir / folder).is_dir():
            raise PrecomputeError(f"--model {model_dir}: no {folder}/ folder; expected an SD3 pipeline directory")
    try:
        return 2 ** (len(json.loads((model_dir / "vae" / "config.json").read_text())["block_out_channels"]) - 1)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PrecomputeError(f"--model {model_dir}: vae/config.json is not a diffusers VAE config ({e})") from None


def load_image(path: Path, size: tuple[int, int]) -> torch.Tensor:
    """[3, H, W] in [-1, 1]: resized to cover (height, width), then centre-cropped."""
    try:
        with Image.open(path) as image:
            image = ImageOps.exif_transpose(image).convert("RGB")  # phone photos: stored sideways
    except OSError as e:
        raise PrecomputeError(f"{path}: not a readable image ({e})") from None
    height, width = size
    scale = max(width / image.width, height / image.height)
    resized = image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale))),
                           Image.BICUBIC)
    left, top = (resized.width - width) // 2, (resized.height - height) // 2
    pixels = torch.frombuffer(bytearray(resized.crop((left, top, left + width, top + height)).tobytes()),
                              dtype=torch.uint8)
    return pixels.view(height, width, 3).permute(2, 0, 1).float() / 127.5 - 1


# ----------------------------------------------------------------------------------------------- encoders


class SD3Encoders:
    """The VAE and the three text encoders of an SD3 pipeline directory."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype, max_sequence_length: int):
        from diffusers import AutoencoderKL
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

        self.device, self.dtype, self.max_sequence_length = device, dtype, max_sequence_length
        load = dict(torch_dtype=dtype)
        self.vae = AutoencoderKL.from_pretrained(model_dir / "vae", **load).to(device).eval()
        self.clip = [(AutoTokenizer.from_pretrained(model_dir / tok),
                      CLIPTextModelWithProjection.from_pretrained(model_dir / enc, **load).to(device).eval())
                     for tok, enc in (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))]
        self.t5 = None
        if (model_dir / "text_encoder_3").is_dir():
            self.t5 = (AutoTokenizer.from_pretrained(model_dir / "tokenizer_3"),
                       T5EncoderModel.from_pretrained(model_dir / "text_encoder_3", **load).to(device).eval())
        transformer_config = model_dir / "transformer" / "config.json"
        self.joint_dim = (self.t5[1].config.d_model if self.t5 else
                          json.loads(transformer_config.read_text())["joint_attention_dim"]
                          if transformer_config.is_file() else SD3_JOINT_DIM)
        self.clip_length = self.clip[0][0].model_max_length  # the pipeline pads both CLIPs to CLIP-L's length
        self.truncated = 0

    def tokens(self, tokenizer, captions: list[str], length: int, **kwargs) -> torch.Tensor:
        ids = tokenizer(captions, padding="max_length", max_length=length, truncation=True, return_tensors="pt",
                        **kwargs).input_ids
        self.truncated += sum(len(tokenizer(c, verbose=False).input_ids) > length for c in captions)
        return ids.to(self.device)

    @torch.no_grad()
    def encode_text(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, clip_length + max_sequence_length, joint_dim], [B, pooled]) as SD3's encode_prompt."""
        hidden, pooled = [], []
        for tokenizer, encoder in self.clip:
            out = encoder(self.tokens(tokenizer, captions, self.clip_length), output_hidden_states=True)
            hidden.append(out.hidden_states[-2])  # the penultimate layer, as SD3 was trained
            pooled.append(out[0])
        clip = torch.cat(hidden, dim=-1)
        if self.t5 is None:
            t5 = torch.zeros(len(captions), self.max_sequence_length, self.joint_dim, device=self.device, dtype=clip.dtype)
        else:
            tokenizer, encoder = self.t5
            t5 = encoder(self.tokens(tokenizer, captions, self.max_sequence_length, add_special_tokens=True))[0]
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5.to(clip.dtype)], dim=-2), torch.cat(pooled, dim=-1)

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        mean = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist.mean
        return (mean - (config.shift_factor or 0.0)) * config.scaling_factor


# ----------------------------------------------------------------------------------------------- shards


def fingerprint(items: list[tuple[Path, str]]) -> str:
    """Of the inputs: paths, captions, and each file's size and modification time (a replaced image counts)."""
    digest = hashlib.sha256()
    for path, caption in items:
        stat = path.stat()
        digest.update(f"{path}\0{caption}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def check_output_directory(out: Path, settings: dict) -> None:
    """`out` must be new (or hold no finished chunk of this tool's), or have been started with the same settings
    (it is then resumed). Anything else is refused: a directory of other files, or finished work of other
    settings. Nothing is created here (see `start_output_directory`)."""
    for parent in [out, *out.parents]:
        if parent.exists() and not parent.is_dir():
            raise PrecomputeError(f"--out {out}: {parent} is a file, not a directory")
    if not (out / SETTINGS).is_file():
        if out.exists() and any(out.iterdir()):
            raise PrecomputeError(f"--out {out} exists and was not written by this tool; choose a new directory")
        return
    old = json.loads((out / SETTINGS).read_text())
    changed = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
    if changed and any(out.glob("chunk-*.json")):
        raise PrecomputeError(f"--out {out} was started with other settings (before, now): {changed}; "
                              f"use a new directory or the same settings to resume")
    if changed:  # nothing finished yet (an earlier attempt stopped early): start over
        log.info("--out %s holds no finished chunk; starting over with the new settings %s", out, sorted(changed))
        for path in [*out.glob("shard-*.safetensors"), *out.glob(".*.tmp"), out / SETTINGS]:
            path.unlink()


def start_output_directory(out: Path, settings: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if not (out / SETTINGS).is_file():
        (out / SETTINGS).write_text(json.dumps(settings, indent=1))


def encode_chunk(number: int, items: list[tuple[Path, str, tuple[int, int]]], encoders: SD3Encoders,
                 batch_size: int, store: torch.dtype, random_flip: bool, out: Path, progress) -> list[dict]:
    """Encode one chunk of (image, caption, target size) into a shard per size; returns their index entries."""
    by_size = {}
    for path, caption, size in items:
        by_size.setdefault(size, []).append((path, caption))
    shards = []
    for size, group in sorted(by_size.items()):
        parts = {"latents": [], "prompt_embeds": [], "pooled_prompt_embeds": [], "latents_flipped": []}
        for start in range(0, len(group), batch_size):
            batch = group[start : start + batch_size]
            pixels = torch.stack([load_image(p, size) for p, _ in batch])
            parts["latents"].append(encoders.encode_images(pixels).to(store).cpu())  # outputs wait on the host
            if random_flip:
                parts["latents_flipped"].append(encoders.encode_images(pixels.flip(-1)).to(store).cpu())
            text, vector = encoders.encode_text([c for _, c in batch])
            parts["prompt_embeds"].append(text.to(store).cpu())
            parts["pooled_prompt_embeds"].append(vector.to(store).cpu())
            progress.update(len(batch))
        tensors = {name: torch.cat(values) for name, values in parts.items() if values}
        h, w = tensors["latents"].shape[-2:]
        name = f"shard-{number:05d}-{h}x{w}.safetensors"
        save_safetensors(tensors, out / name, {"captions": json.dumps([c for _, c in group])})
        shards.append({"file": name, "count": len(group), "latent_size": [h, w]})
    return shards


def encode_prompts(encoders: SD3Encoders, prompts: list[str], store: torch.dtype, path: Path) -> None:
    prompt_embeds, pooled = encoders.encode_text(prompts)
    save_safetensors({"prompt_embeds": prompt_embeds.to(store), "pooled_prompt_embeds": pooled.to(store)}, path,
                      {"captions": json.dumps(prompts)})


def precompute(items: list[tuple[Path, str]], sizes: list[tuple[int, int]], encoders: SD3Encoders, out: Path,
               settings: dict, batch_size: int = 8, validation_prompts: list[str] | None = None) -> Path:
    """Encode `items` (whose displayed sizes `check_inputs` read) into `out`, resuming finished chunks."""
    from tqdm import tqdm

    start_output_directory(out, settings)
    buckets = (aspect_buckets(settings["resolution"], settings["bucket_step"]) if settings["aspect_buckets"]
               else [(settings["resolution"], settings["resolution"])])
    sized = [(path, caption, target_size(size, buckets)) for (path, caption), size in zip(items, sizes)]
    size, store = settings["shard_size"], DTYPES[settings["dtype"]]
    chunks = [sized[i : i + size] for i in range(0, len(sized), size)]
    markers = [out / f"chunk-{k:05d}.json" for k in range(len(chunks))]
    done = sum(len(c) for c, m in zip(chunks, markers) if m.is_file())
    if done:
        log.info("resuming: %d of %d items already encoded", done, len(items))
    with tqdm(total=len(items), initial=done, unit="img", desc="precompute") as progress:
        for number, (chunk, marker) in enumerate(zip(chunks, markers)):
            if not marker.is_file():
                shards = encode_chunk(number, chunk, encoders, batch_size, store, settings["random_flip"], out,
                                      progress)
                tmp = marker.with_name(f".{marker.name}.tmp")
                tmp.write_text(json.dumps({"shards": shards}))
                os.replace(tmp, marker)
    encode_prompts(encoders, [""], store, out / EMPTY_PROMPT)
    if validation_prompts:
        encode_prompts(encoders, validation_prompts, store, out / VALIDATION_PROMPTS)
    shards = [s for m in markers for s in json.loads(m.read_text())["shards"]]
    vae = encoders.vae.config
    index = {"shards": shards, "items": len(items), "resolution": settings["resolution"],
             "vae": {"scaling_factor": vae.scaling_factor, "shift_factor": vae.shift_factor or 0.0,
                     "folder": str(Path(settings["model"]) / "vae")},
             "model": settings["model"]}
    tmp = out / f".{INDEX}.tmp"  # the finished-dataset marker: published whole, also when rewritten on a rerun
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / INDEX)
    if encoders.truncated:
        log.warning("%d captions were longer than a text encoder's token limit and were cut", encoders.truncated)
    log.info("wrote %d items in %d shards to %s%s", len(items), len(shards), out,
             f", and {len(validation_prompts)} validation prompts" if validation_prompts else "")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="SD3 / SD3.5 pipeline directory (local)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--images", type=Path, help="folder of images with same-named .txt captions")
    source.add_argument("--manifest", type=Path, help='JSONL of {"image": ..., "caption": ...}')
    parser.add_argument("--out", required=True, type=Path, help="dataset directory to write (or resume)")
    parser.add_argument("--resolution", type=int, default=1024, help="side of the square target size in pixels")
    parser.add_argument("--aspect-buckets", action="store_true", help="keep aspect ratios (train with "
                        "data.aspect_buckets=true)")
    parser.add_argument("--bucket-step", type=int, default=64, help="bucket sides are multiples of this")
    parser.add_argument("--random-flip", action="store_true", help="also store each image mirrored left-right")
    parser.add_argument("--validation-prompts", type=Path, help="text file, one prompt per line, for the "
                        "validation images of training (validation.every)")
    parser.add_argument("--batch-size", type=int, default=8, help="images encoded at once")
    parser.add_argument("--shard-size", type=int, default=1000, help="items per chunk (the unit of resumption)")
    parser.add_argument("--max-sequence-length", type=int, default=256, help="T5 tokens (SD3 pipelines: 256)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp16",
                        help="storage dtype; also the encoders' dtype on a GPU (they run in fp32 on the CPU)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    for name in ("resolution", "bucket_step", "batch_size", "shard_size", "max_sequence_length"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    items = []
    try:  # every input is checked before anything is written or loaded
        items = read_image_folder(args.images) if args.images else read_manifest(args.manifest)
        sizes = check_inputs(items)
        prompts = read_validation_prompts(args.validation_prompts) if args.validation_prompts else None
        multiple = vae_downsampling(args.model) * PATCH  # every latent side must divide into patches
        name = "bucket_step" if args.aspect_buckets else "resolution"
        if getattr(args, name) % multiple:
            raise PrecomputeError(f"--{name.replace('_', '-')} {getattr(args, name)} must be a multiple of {multiple} "
                                  f"(VAE downsampling {multiple // PATCH} x patch {PATCH})")
        compute = DTYPES[args.dtype] if device.type == "cuda" else torch.float32
        settings = {"model": str(args.model.resolve()), "inputs": fingerprint(items), "resolution": args.resolution,
                    "aspect_buckets": args.aspect_buckets, "bucket_step": args.bucket_step,
                    "random_flip": args.random_flip, "shard_size": args.shard_size, "dtype": args.dtype,
                    "max_sequence_length": args.max_sequence_length,
                    "compute_dtype": str(compute)}  # a resume must not mix latents encoded at two precisions
        check_output_directory(args.out, settings)
        encoders = SD3Encoders(args.model, device, compute, args.max_sequence_length)
        precompute(items, sizes, encoders, args.out, settings, args.batch_size, prompts)
    except PrecomputeError as e:
        log.error("precompute: %s", e)
        return 2
    except KeyboardInterrupt:
        done = sum(s["count"] for m in args.out.glob("chunk-*.json") for s in json.loads(m.read_text())["shards"])
        log.error("precompute: interrupted with %d of %d items encoded; the same command resumes from there",
                  done, len(items))
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
