"""Encode image-caption collections once into a latent dataset (see data/latents.py).

    python precompute_latents.py --model SD3_DIR (--images DIR | --manifest FILE | --shards PATTERN ...) --out DIR
        [--resolution 1024] [--aspect-buckets] [--random-flip] [--validation-prompts FILE] [--batch-size 8]
        [--shard-size 1000] [--text-embeddings precomputed|none] [--caption-field NAME] [--max-bad-fraction 0.01]
        [--workers 4] [--device auto] [--dtype fp16]
    torchrun --nproc_per_node N [--nnodes ...] precompute_latents.py ...   (the same command, on N processes)

SD3_DIR is a Stable Diffusion 3 / 3.5 pipeline directory as diffusers lays it out: vae/, text_encoder/ +
tokenizer/ (CLIP-L), text_encoder_2/ + tokenizer_2/ (CLIP-G) and, optionally, text_encoder_3/ + tokenizer_3/
(T5; without it the T5 part is zeros, as the pipeline does). Nothing is downloaded.

Inputs:
- --images DIR: every image file with a same-named .txt caption beside it; --manifest FILE: JSONL of
  {"image": path relative to the manifest, "caption": text}. Every image and caption is checked before
  anything is written or loaded; one bad input stops the run (fix it and rerun).
- --shards PATTERN ...: webdataset tar shards as img2dataset writes them (data/webdataset.py): local paths, globs,
  brace ranges ('data/{00000..00999}.tar') or `pipe:` commands ('pipe:aws s3 cp s3://b/{00000..00999}.tar -').
  A bad sample (corrupt image, no caption, unsupported format) is skipped, counted and named in its shard's
  report; past --max-bad-fraction of all samples the job fails, because then the input is wrong, not noisy.

The latents are the VAE posterior mean, shifted and scaled as the pipeline expects; the text embeddings are what
`StableDiffusion3Pipeline.encode_prompt` gives (models/sd3_text.py), or, with --text-embeddings none, not
stored: training encodes the captions itself (data.text_encoding=on_the_fly), and a sample costs its latents
alone. Each image is resized to cover its target size and centre-cropped; the target is --resolution squared,
or with --aspect-buckets the bucket of about that area nearest its aspect ratio.

The work is split into units: each input shard (or, for folder and JSONL inputs, each run of --shard-size
items), spread over the processes of a torchrun launch (each holds one copy of the encoders, on its own GPU).
A unit becomes output shards of at most about --shard-size items each, then its report (`reports/NNNNN.json`:
its samples, what was skipped and why, its shards' sizes and checksums), published last, by rename: the marker
that the unit is finished. A rerun of the same command, on any number of processes, verifies finished units
(sizes and checksums) and redoes only the unfinished or damaged ones; the result is the same, bitwise on CPU,
for any number of processes and interruptions. Rank 0 writes the index and `dataset.json` last, in unit order,
once every unit is finished.
"""

import argparse
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import shutil
import sys
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before the group exists: see Ranks.close
from PIL import Image, ImageOps

from data.latents import (EMPTY_PROMPT, INDEX, PRECOMPUTE_SETTINGS as SETTINGS, VALIDATION_PROMPTS, publish_json,
                          shard_record, sha256, write_index)
from data.webdataset import IMAGE_SUFFIXES as SHARD_IMAGE_SUFFIXES, Sample, ShardError, expand_shards, read_samples
from models.diffusers_io import CheckpointFormatError, save_safetensors
from models.sd3_text import SD3TextEncoders, SD3Tokenizers, check_pipeline

log = logging.getLogger("mmdit")
IMAGE_SUFFIXES = {f".{suffix}" for suffix in SHARD_IMAGE_SUFFIXES}  # of folder inputs: what shards may hold
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PATCH = 2  # the MMDiT's patch side in latents (SD3 / SD3.5)
EXIF_ORIENTATION = 0x0112
REPORTS, PROGRESS = "reports", ".progress"
# Ranks meet twice: at the start, and when every unit is verified; verifying a large dataset's checksums can
# take a while on the slowest rank.
MEETING_TIMEOUT = timedelta(hours=6)


class PrecomputeError(ValueError):
    pass


class BadSample(ValueError):
    pass


@dataclass
class Unit:
    name: str  # in reports and errors: the input shard, or the items of a folder or manifest
    samples: Callable[[], Iterator[Sample]]


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


def check_items(items: list[tuple[Path, str]]) -> None:
    """Folder and JSONL inputs: one error listing every unreadable image; a warning for empty captions."""
    bad = []
    for path, _ in items:
        try:
            image_size(path)
        except PrecomputeError as e:
            bad.append(str(e))
    if bad:
        raise PrecomputeError(f"{len(bad)} of {len(items)} images are not readable; remove or replace them and rerun "
                              f"(nothing was written): {bad[:5]}")
    empty = [str(path) for path, caption in items if not caption]
    if empty:
        log.warning("%d of %d images have an empty caption (trained as unconditional), e.g. %s", len(empty),
                    len(items), empty[:3])


def item_units(items: list[tuple[Path, str]], size: int, source: str) -> list[Unit]:
    """Folder and JSONL inputs in units of `size` items."""
    def samples(chunk):
        return lambda: (Sample(str(path), path, caption) for path, caption in chunk)
    return [Unit(f"{source} items {start}-{min(start + size, len(items)) - 1}", samples(items[start : start + size]))
            for start in range(0, len(items), size)]


def shard_units(sources: list[str], caption_field: str | None) -> list[Unit]:
    return [Unit(source, lambda source=source: read_samples(source, caption_field)) for source in sources]


def fingerprint(units: list[Unit], items: list[tuple[Path, str]] | None) -> str:
    """Of the inputs: for folders and manifests each file's path, caption, size and modification time (a
    replaced image counts); for shards their names (a shard that failed is replaced, then the job rerun)."""
    digest = hashlib.sha256()
    if items is not None:
        for path, caption in items:
            stat = path.stat()
            digest.update(f"{path}\0{caption}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    else:
        for unit in units:
            digest.update(f"{unit.name}\0".encode())
    return digest.hexdigest()


def read_validation_prompts(path: Path) -> list[str]:
    if not path.is_file():
        raise PrecomputeError(f"--validation-prompts {path} does not exist")
    prompts = [line.strip() for line in read_text(path, "--validation-prompts").splitlines() if line.strip()]
    if not prompts:
        raise PrecomputeError(f"--validation-prompts {path} holds no prompt (one per line)")
    return prompts


def vae_downsampling(model_dir: Path) -> int:
    """From the pipeline's folders and vae/config.json, before any weight is loaded: 8 for SD3's VAE."""
    if not (model_dir / "vae").is_dir():
        raise PrecomputeError(f"--model {model_dir}: no vae/ folder; expected an SD3 pipeline directory")
    try:
        check_pipeline(model_dir, "--model")
    except CheckpointFormatError as e:
        raise PrecomputeError(str(e)) from None
    try:
        return 2 ** (len(json.loads((model_dir / "vae" / "config.json").read_text())["block_out_channels"]) - 1)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PrecomputeError(f"--model {model_dir}: vae/config.json is not a diffusers VAE config ({e})") from None


# ----------------------------------------------------------------------------------------------- images


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


def open_image(source: Path | bytes) -> Image.Image:
    """Decoded RGB, as displayed (phone photos are stored sideways with an EXIF rotation)."""
    try:
        with Image.open(source if isinstance(source, Path) else io.BytesIO(source)) as image:
            return ImageOps.exif_transpose(image).convert("RGB")
    except Image.UnidentifiedImageError:  # its message names the stream object: not reproducible
        raise BadSample("corrupt image: not an image PIL recognises") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise BadSample(f"corrupt image: {e}") from None


def resize_crop(image: Image.Image, size: tuple[int, int]) -> torch.Tensor:
    """[3, H, W] uint8: resized to cover (height, width), then centre-cropped."""
    height, width = size
    scale = max(width / image.width, height / image.height)
    resized = image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale))),
                           Image.BICUBIC)
    left, top = (resized.width - width) // 2, (resized.height - height) // 2
    pixels = torch.frombuffer(bytearray(resized.crop((left, top, left + width, top + height)).tobytes()),
                              dtype=torch.uint8)
    return pixels.view(height, width, 3).permute(2, 0, 1)


def load_image(path: Path, size: tuple[int, int]) -> torch.Tensor:
    """[3, H, W] in [-1, 1], as precompute feeds it to the VAE."""
    return to_unit_range(resize_crop(open_image(path), size))


def to_unit_range(pixels: torch.Tensor) -> torch.Tensor:
    return pixels.float() / 127.5 - 1


def prepare(sample: Sample, buckets: list[tuple[int, int]]) -> tuple[Sample, tuple[int, int] | None, torch.Tensor | None]:
    """A sample with its target size and pixels, or with the `problem` that makes it unusable (runs in the
    decoding threads)."""
    if sample.problem:
        return sample, None, None
    try:
        image = open_image(sample.image)
    except BadSample as e:
        return dataclasses.replace(sample, problem=str(e)), None, None
    size = target_size(image.size, buckets)
    return sample, size, resize_crop(image, size)


def ordered_map(fn, items: Iterator, workers: int) -> Iterator:
    """fn over items in `workers` threads (PIL decodes without the GIL), in order, at most 2 x workers ahead."""
    if workers <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(workers) as pool:
        window = deque()
        for item in items:
            window.append(pool.submit(fn, item))
            if len(window) > 2 * workers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


# ----------------------------------------------------------------------------------------------- encoders


class SD3Encoders:
    """The VAE of an SD3 pipeline directory, and its text encoders (models/sd3_text.py) unless text embeddings
    are not stored."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype, max_sequence_length: int,
                 text_embeddings: bool):
        from diffusers import AutoencoderKL

        self.device, self.dtype = device, dtype
        self.vae = AutoencoderKL.from_pretrained(model_dir / "vae", torch_dtype=dtype).to(device).eval()
        self.tokenizers = SD3Tokenizers(model_dir, max_sequence_length)
        with torch.device("meta"):
            self.text = SD3TextEncoders(model_dir, max_sequence_length)
        self.text_dims = (self.text.joint_dim, self.text.pooled_dim)
        if text_embeddings:
            self.text.check("--model")
            self.text.load(device, dtype)
        else:
            self.text = None
        self.truncated = 0

    @torch.no_grad()
    def encode_text(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        self.truncated += self.tokenizers.truncated(captions)
        return self.text(**{k: v.to(self.device) for k, v in self.tokenizers(captions).items()})

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        mean = self.vae.encode(to_unit_range(pixels).to(self.device, self.dtype)).latent_dist.mean
        return (mean - (config.shift_factor or 0.0)) * config.scaling_factor

    def encode(self, pixels: torch.Tensor, captions: list[str], flip: bool, store: torch.dtype) -> dict:
        """A batch's stored fields, in the storage dtype, on the host."""
        rows = {"latents": self.encode_images(pixels)}
        if flip:
            rows["latents_flipped"] = self.encode_images(pixels.flip(-1))
        if self.text is not None:
            rows["prompt_embeds"], rows["pooled_prompt_embeds"] = self.encode_text(captions)
        return {name: values.to(store).cpu() for name, values in rows.items()}


def encode_prompts(encoders: SD3Encoders, prompts: list[str], store: torch.dtype, path: Path) -> None:
    prompt_embeds, pooled = encoders.encode_text(prompts)
    save_safetensors({"prompt_embeds": prompt_embeds.to(store), "pooled_prompt_embeds": pooled.to(store)}, path,
                     {"captions": json.dumps(prompts)})


# ----------------------------------------------------------------------------------------------- units


class UnitWriter:
    """One unit's output: samples wait per target size for a batch, encoded rows wait for a shard."""

    def __init__(self, number: int, encoders: SD3Encoders, settings: dict, out: Path, progress):
        self.number, self.encoders, self.out, self.progress = number, encoders, out, progress
        self.batch_size, self.shard_size = settings["batch_size"], settings["shard_size"]
        self.flip, self.store = settings["random_flip"], DTYPES[settings["dtype"]]
        self.waiting: dict[tuple[int, int], list] = {}
        self.encoded: dict[tuple[int, int], tuple[list, list]] = {}
        self.parts = Counter()
        self.shards, self.captions = [], []

    def add(self, size: tuple[int, int], pixels: torch.Tensor, caption: str) -> None:
        self.waiting.setdefault(size, []).append((pixels, caption))
        if len(self.waiting[size]) == self.batch_size:
            self.encode(size)

    def encode(self, size: tuple[int, int]) -> None:
        batch = self.waiting.pop(size)
        captions = [caption for _, caption in batch]
        rows, done = self.encoded.setdefault(size, ([], []))
        rows.append(self.encoders.encode(torch.stack([p for p, _ in batch]), captions, self.flip, self.store))
        done += captions
        self.progress(len(batch))
        if len(done) >= self.shard_size:
            self.write(size)

    def write(self, size: tuple[int, int]) -> None:
        rows, captions = self.encoded.pop(size)
        tensors = {name: torch.cat([r[name] for r in rows]) for name in rows[0]}
        h, w = tensors["latents"].shape[-2:]
        name = f"shard-{self.number:05d}-{h}x{w}-{self.parts[size]:03d}.safetensors"
        self.parts[size] += 1
        save_safetensors(tensors, self.out / name, {"captions": json.dumps(captions)})
        self.shards.append(shard_record(self.out, name, len(captions), (h, w)))
        self.captions.append(captions)

    def finish(self) -> None:
        for size in sorted(self.waiting):
            self.encode(size)
        for size in sorted(self.encoded):
            self.write(size)


def encode_unit(number: int, unit: Unit, encoders: SD3Encoders, settings: dict, out: Path, progress) -> dict:
    """Encode a unit and publish its report (the marker that it is finished); returns the report."""
    buckets = (aspect_buckets(settings["resolution"], settings["bucket_step"]) if settings["aspect_buckets"]
               else [(settings["resolution"], settings["resolution"])])
    writer, skipped, samples = UnitWriter(number, encoders, settings, out, progress), [], 0
    for sample, size, pixels in ordered_map(lambda s: prepare(s, buckets), unit.samples(), settings["workers"]):
        samples += 1
        if sample.problem:
            skipped.append({"key": sample.key, "why": sample.problem})
        else:
            writer.add(size, pixels, sample.caption)
    writer.finish()
    report = {"input": unit.name, "samples": samples, "encoded": samples - len(skipped), "skipped": skipped,
              "shards": writer.shards, "captions": writer.captions}
    publish_json(report_path(out, number), report)
    return report


def report_path(out: Path, number: int) -> Path:
    return out / REPORTS / f"{number:05d}.json"


def verified(out: Path, number: int) -> bool | None:
    """Whether a unit is finished and its shards are as published (their sizes and checksums); None when it has
    no report."""
    path = report_path(out, number)
    if not path.is_file():
        return None
    try:
        shards = json.loads(path.read_text())["shards"]
    except (ValueError, KeyError):
        return False
    return all((out / s["file"]).is_file() and (out / s["file"]).stat().st_size == s["bytes"]
               and sha256(out / s["file"]) == s["sha256"] for s in shards)


# ----------------------------------------------------------------------------------------------- ranks


class Ranks:
    """The processes of a torchrun launch (or one), meeting over gloo: only to agree on the output directory
    and on which units are left. Otherwise they share nothing but the output directory."""

    def __init__(self):
        self.rank, self.size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if self.size > 1:
            dist.init_process_group("gloo", timeout=MEETING_TIMEOUT)

    def share(self, value) -> list:
        """Every rank's `value`, in rank order."""
        if self.size == 1:
            return [value]
        values = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def close(self) -> None:
        """Leave the group, which is then freed: diffusers imports torch.distributed.nn, whose functions, when
        first imported after the group exists, would hold it in their default arguments until the interpreter
        shuts down, where gloo aborts the process now and then (perf/distributed.py:destroy_distributed)."""
        if dist.is_initialized():
            dist.destroy_process_group()


class Progress:
    """A rank's images and units, written to `out/.progress/` every few seconds; rank 0 shows a bar over all
    units with images/s in all and per rank, and waits there for the other ranks to finish."""

    def __init__(self, out: Path, ranks: Ranks, units: int, done: int):
        self.path = out / PROGRESS / f"rank-{ranks.rank:05d}.json"
        self.ranks, self.start, self.written = ranks, time.monotonic(), 0.0
        self.state = {"images": 0, "units": 0, "failed": [], "finished": False, "seconds": 0.0}
        self.bar = None
        if ranks.rank == 0:
            from tqdm import tqdm
            self.bar = tqdm(total=units, initial=done, unit="unit", desc="precompute", file=sys.stdout)

    def __call__(self, images: int = 0, units: int = 0) -> None:
        self.state["images"] += images
        self.state["units"] += units
        if time.monotonic() - self.written > 2 or units:
            self.write()

    def write(self) -> None:
        self.state["seconds"] = time.monotonic() - self.start
        self.written = time.monotonic()
        publish_json(self.path, self.state)
        if self.bar is not None:
            self.show()

    def show(self) -> list[dict]:
        states = []
        for rank in range(self.ranks.size):
            path = self.path.with_name(f"rank-{rank:05d}.json")
            try:
                states.append(json.loads(path.read_text()))
            except (OSError, ValueError):  # not started yet
                states.append({"images": 0, "units": 0, "failed": [], "finished": False, "seconds": 0.0})
        rates = [s["images"] / s["seconds"] if s["seconds"] else 0.0 for s in states]
        self.bar.n = self.bar.initial + sum(s["units"] for s in states)
        self.bar.set_postfix_str(f"{sum(rates):.1f} img/s" + (
            f" ({' '.join(f'{r:.1f}' for r in rates)} per rank)" if self.ranks.size > 1 else ""), refresh=True)
        return states

    def finish(self, failed: list[str]) -> list[str]:
        """This rank is done; on rank 0, wait for the others. Returns the units that failed on any rank."""
        self.state.update(finished=True, failed=failed)
        self.write()
        if self.bar is None:
            return failed
        states = self.show()
        while not all(s["finished"] for s in states):
            time.sleep(1)
            states = self.show()
        self.bar.close()
        return [f for s in states for f in s["failed"]]


# ----------------------------------------------------------------------------------------------- the run


def check_output_directory(out: Path, settings: dict) -> None:
    """`out` must be new (or hold no finished unit of this tool's), or have been started with the same settings
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
    if changed and any((out / REPORTS).glob("*.json")):
        raise PrecomputeError(f"--out {out} was started with other settings (before, now): {changed}; "
                              f"use a new directory or the same settings to resume")
    if changed:  # nothing finished yet (an earlier attempt stopped early): start over
        log.info("--out %s holds no finished unit; starting over with the new settings %s", out, sorted(changed))
        for path in [*out.glob("shard-*.safetensors"), *out.glob(".*.tmp"), out / SETTINGS]:
            path.unlink()


def start_output_directory(out: Path, settings: dict) -> None:
    (out / REPORTS).mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / PROGRESS, ignore_errors=True)
    (out / PROGRESS).mkdir()
    if not (out / SETTINGS).is_file():
        publish_json(out / SETTINGS, settings)


def remaining_units(out: Path, count: int, ranks: Ranks) -> list[int]:
    """Units without a verified report; each rank verifies a share of the finished ones, and a damaged unit's
    report is removed, so it is redone."""
    mine = {}
    for number in range(ranks.rank, count, ranks.size):
        mine[number] = verified(out, number)
        if mine[number] is False:
            report_path(out, number).unlink()
    shared = {n: ok for part in ranks.share(mine) for n, ok in part.items()}
    damaged = [n for n, ok in shared.items() if ok is False]
    if damaged:
        log.warning("%d finished unit(s) have damaged or missing shards and are redone: %s", len(damaged),
                    damaged[:10])
    done = sum(1 for ok in shared.values() if ok)
    if done:
        log.info("resuming: %d of %d units already finished", done, count)
    return [n for n in range(count) if not shared[n]]


def precompute(units: list[Unit], encoders: SD3Encoders, out: Path, settings: dict, ranks: Ranks,
               validation_prompts: list[str] | None = None, max_bad_fraction: float = 1.0) -> int:
    """Encode the units left to do (this rank's share), then on rank 0 write the dataset; the exit status."""
    left = remaining_units(out, len(units), ranks)
    progress, failed = Progress(out, ranks, len(units), len(units) - len(left)), []
    for number in left[ranks.rank :: ranks.size]:
        try:
            encode_unit(number, units[number], encoders, settings, out, progress)
        except ShardError as e:
            failed.append(str(e))
        progress(units=1)
    store = DTYPES[settings["dtype"]]
    if ranks.rank == 0 and encoders.text is not None:
        encode_prompts(encoders, [""], store, out / EMPTY_PROMPT)
        if validation_prompts:
            encode_prompts(encoders, validation_prompts, store, out / VALIDATION_PROMPTS)
    failed = progress.finish(failed)
    if ranks.rank != 0:
        return 0
    if failed:
        log.error("precompute: %d input shard(s) could not be read; the others are finished. Fix or replace them "
                  "(or rerun: a download may have failed) and rerun the same command: %s", len(failed), failed[:5])
        return 1
    reports = [json.loads(report_path(out, n).read_text()) for n in range(len(units))]
    if not summarize(reports, out, max_bad_fraction):
        return 1
    shutil.rmtree(out / PROGRESS, ignore_errors=True)
    write_dataset(reports, encoders, out, settings, validation_prompts)
    return 0


def summarize(reports: list[dict], out: Path, max_bad_fraction: float) -> bool:
    """Log what was encoded and skipped; False when more than `max_bad_fraction` of the samples were bad."""
    samples = sum(r["samples"] for r in reports)
    skipped = [(r["input"], s) for r in reports for s in r["skipped"]]
    reasons = Counter(s["why"].partition(":")[0] for _, s in skipped)
    log.info("%d samples from %d unit(s): %d encoded, %d skipped%s", samples, len(reports), samples - len(skipped),
             len(skipped), f" ({', '.join(f'{why} {n}' for why, n in reasons.most_common())}); each unit's "
                           f"skipped samples are in {out / REPORTS}/" if skipped else "")
    for unit, s in skipped[:5]:
        log.info("  skipped %s: %s", s["key"], s["why"])
    if samples and len(skipped) > max_bad_fraction * samples:
        log.error("precompute: %d of %d samples (%.1f %%) were bad, more than --max-bad-fraction %g: the input is "
                  "likely wrong rather than noisy (%s). See %s/; rerun with a higher --max-bad-fraction to accept "
                  "them (finished units are kept)", len(skipped), samples, 100 * len(skipped) / samples,
                  max_bad_fraction, ", ".join(f"{why} {n}" for why, n in reasons.most_common()), out / REPORTS)
        return False
    if samples == len(skipped):
        log.error("precompute: no sample could be encoded")
        return False
    return True


def write_dataset(reports: list[dict], encoders: SD3Encoders, out: Path, settings: dict,
                  validation_prompts: list[str] | None) -> None:
    shards = [s for r in reports for s in r["shards"]]
    vae = encoders.vae.config
    info = {"channels": vae.latent_channels, "text_embeddings": encoders.text is not None,
            "text_tokens": encoders.tokenizers.tokens, "text_dims": list(encoders.text_dims),
            "max_sequence_length": settings["max_sequence_length"], "flipped": settings["random_flip"],
            "resolution": settings["resolution"], "model": settings["model"],
            "vae": {"scaling_factor": vae.scaling_factor, "shift_factor": vae.shift_factor or 0.0,
                    "folder": str(Path(settings["model"]) / "vae")},
            "validation_prompts": validation_prompts if encoders.text is None else None,
            "skipped": sum(len(r["skipped"]) for r in reports)}
    write_index(out, shards, (captions for r in reports for captions in r["captions"]), info)
    if encoders.truncated:
        log.warning("%d captions were longer than a text encoder's token limit and were cut", encoders.truncated)
    log.info("wrote %d items in %d shards to %s%s", sum(s["count"] for s in shards), len(shards), out,
             f", and {len(validation_prompts)} validation prompts" if validation_prompts else "")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="SD3 / SD3.5 pipeline directory (local)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--images", type=Path, help="folder of images with same-named .txt captions")
    source.add_argument("--manifest", type=Path, help='JSONL of {"image": ..., "caption": ...}')
    source.add_argument("--shards", nargs="+", help="webdataset tar shards: paths, globs, {000..999} ranges, pipe:")
    parser.add_argument("--out", required=True, type=Path, help="dataset directory to write (or resume)")
    parser.add_argument("--resolution", type=int, default=1024, help="side of the square target size in pixels")
    parser.add_argument("--aspect-buckets", action="store_true", help="keep aspect ratios (train with "
                        "data.aspect_buckets=true)")
    parser.add_argument("--bucket-step", type=int, default=64, help="bucket sides are multiples of this")
    parser.add_argument("--random-flip", action="store_true", help="also store each image mirrored left-right")
    parser.add_argument("--validation-prompts", type=Path, help="text file, one prompt per line, for the "
                        "validation images of training (validation.every)")
    parser.add_argument("--text-embeddings", choices=("precomputed", "none"), default="precomputed",
                        help="none: store captions only (2.7 MB less per SD3 sample); train with "
                             "data.text_encoding=on_the_fly")
    parser.add_argument("--caption-field", help="--shards: take captions from this field of each sample's .json "
                        "instead of its .txt")
    parser.add_argument("--max-bad-fraction", type=float, default=0.01, help="--shards: fail when more of the "
                        "samples than this are skipped as bad")
    parser.add_argument("--batch-size", type=int, default=8, help="images encoded at once")
    parser.add_argument("--shard-size", type=int, default=1000, help="items per output shard (and per unit of "
                        "folder and JSONL inputs)")
    parser.add_argument("--workers", type=int, default=4, help="threads decoding images")
    parser.add_argument("--max-sequence-length", type=int, default=256, help="T5 tokens (SD3 pipelines: 256)")
    parser.add_argument("--device", default="auto", help="auto (under torchrun: this process's GPU), cpu, cuda:1")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp16",
                        help="storage dtype; also the encoders' dtype on a GPU (they run in fp32 on the CPU)")
    args = parser.parse_args(argv)
    for name in ("resolution", "bucket_step", "batch_size", "shard_size", "max_sequence_length", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.max_bad_fraction <= 1:
        parser.error("--max-bad-fraction must be between 0 and 1")
    return args


def read_inputs(args: argparse.Namespace) -> tuple[list[Unit], str]:
    """The units of work and the inputs' fingerprint; folder and JSONL inputs are checked whole first."""
    if args.shards:
        try:
            units = shard_units(expand_shards(args.shards), args.caption_field)
        except ShardError as e:
            raise PrecomputeError(str(e)) from None
        return units, fingerprint(units, None)
    if args.caption_field:
        raise PrecomputeError("--caption-field applies to --shards inputs (folders and manifests give captions)")
    items = read_image_folder(args.images) if args.images else read_manifest(args.manifest)
    check_items(items)
    source = f"--images {args.images}" if args.images else f"--manifest {args.manifest}"
    units = item_units(items, args.shard_size, source)
    return units, fingerprint(units, items)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ranks = Ranks()
    logging.basicConfig(level=logging.INFO if ranks.rank == 0 else logging.ERROR, format="%(message)s",
                        stream=sys.stdout)
    gpu = torch.cuda.is_available() and args.device == "auto"
    device = torch.device(f"cuda:{ranks.local_rank}" if gpu else "cpu" if args.device == "auto" else args.device)
    try:
        return run(args, ranks, device)
    finally:
        ranks.close()


def run(args: argparse.Namespace, ranks: Ranks, device: torch.device) -> int:
    try:  # every rank checks the inputs alike, before anything is written or loaded
        units, inputs = read_inputs(args)
        prompts = read_validation_prompts(args.validation_prompts) if args.validation_prompts else None
        multiple = vae_downsampling(args.model) * PATCH  # every latent side must divide into patches
        name = "bucket_step" if args.aspect_buckets else "resolution"
        if getattr(args, name) % multiple:
            raise PrecomputeError(f"--{name.replace('_', '-')} {getattr(args, name)} must be a multiple of {multiple} "
                                  f"(VAE downsampling {multiple // PATCH} x patch {PATCH})")
        compute = DTYPES[args.dtype] if device.type == "cuda" else torch.float32
        settings = {"model": str(args.model.resolve()), "inputs": inputs, "resolution": args.resolution,
                    "aspect_buckets": args.aspect_buckets, "bucket_step": args.bucket_step,
                    "random_flip": args.random_flip, "shard_size": args.shard_size, "dtype": args.dtype,
                    "max_sequence_length": args.max_sequence_length, "text_embeddings": args.text_embeddings,
                    "caption_field": args.caption_field,
                    "compute_dtype": str(compute)}  # a resume must not mix latents encoded at two precisions
        refused = None
        if ranks.rank == 0:
            try:
                check_output_directory(args.out, settings)
                start_output_directory(args.out, settings)
            except PrecomputeError as e:
                refused = str(e)
        refused = ranks.share(refused)[0]
        if refused:
            raise PrecomputeError(refused)
        encoders = SD3Encoders(args.model, device, compute, args.max_sequence_length,
                               args.text_embeddings == "precomputed")
        work = {**settings, "batch_size": args.batch_size, "workers": args.workers}
        return precompute(units, encoders, args.out, work, ranks, prompts, args.max_bad_fraction)
    except PrecomputeError as e:
        log.error("precompute: %s", e)
        return 2
    except KeyboardInterrupt:
        done = len(list((args.out / REPORTS).glob("*.json")))
        log.error("precompute: interrupted with %d unit(s) finished; the same command resumes from there", done)
        return 130
