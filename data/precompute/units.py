"""A unit of work: encode its samples into output shards, then publish its report (the marker that it is done)."""

import json
import logging
from collections import Counter
from pathlib import Path

import torch

from data.captions import recorded_style
from data.latents import publish_json, shard_record
from data.precompute.encoders import PipelineEncoders
from data.precompute.images import aspect_buckets, latent_weights, ordered_map, prepare
from data.precompute.inputs import Unit
from formats import DTYPES, sha256
from models.diffusers_io import save_safetensors

log = logging.getLogger("mmdit")
REPORTS, PROGRESS = "reports", ".progress"


class UnitWriter:
    """One unit's output: samples wait per bucket (target size, and an edit's reference sizes) for a batch,
    encoded rows wait for a shard. A shard stores `loss_mask` when any of its samples has a mask; its samples
    without one weigh 1 everywhere."""

    def __init__(self, number: int, encoders: PipelineEncoders, settings: dict, out: Path, progress):
        self.number, self.encoders, self.out, self.progress = number, encoders, out, progress
        self.batch_size, self.shard_size = settings["batch_size"], settings["shard_size"]
        self.flip, self.store = settings["random_flip"], DTYPES[settings["dtype"]]
        self.caption_style, self.caption_variants = recorded_style(settings)
        self.waiting: dict[tuple[int, int], list] = {}
        self.encoded: dict[tuple[int, int], tuple[list, list]] = {}
        self.parts = Counter()
        self.shards, self.captions = [], []

    def add(self, size: tuple[int, int], pixels: torch.Tensor, caption: str, mask: torch.Tensor | None,
            references: tuple = ()) -> None:
        bucket = (size, tuple(tuple(r[0].shape[-2:]) for r in references))
        self.waiting.setdefault(bucket, []).append((pixels, caption, mask, references))
        if len(self.waiting[bucket]) == self.batch_size:
            self.encode(bucket)

    def encode(self, bucket: tuple) -> None:
        batch = self.waiting.pop(bucket)
        captions = [caption for _, caption, _, _ in batch]
        rows, done = self.encoded.setdefault(bucket, ([], []))
        variants = [self.caption_style.variants(caption, self.caption_variants) for caption in captions]
        rows.append(self.encoders.encode(torch.stack([p for p, _, _, _ in batch]), list(zip(*variants)), self.flip,
                                         self.store, [references for *_, references in batch]))
        if any(mask is not None for _, _, mask, _ in batch):
            masks = torch.stack([torch.full_like(p[:1], 255) if m is None else m for p, _, m, _ in batch])
            rows[-1]["loss_mask"] = latent_weights(masks, rows[-1]["latents"].shape[-2:]).to(self.store)
        done += captions
        self.progress(len(batch))
        if len(done) >= self.shard_size:
            self.write(bucket)

    def write(self, bucket: tuple) -> None:
        rows, captions = self.encoded.pop(bucket)
        if any("loss_mask" in r for r in rows):
            for r in rows:
                r.setdefault("loss_mask", torch.ones_like(r["latents"][:, :1]))
        tensors = {name: torch.cat([r[name] for r in rows]) for name in rows[0]}
        h, w = tensors["latents"].shape[-2:]
        references = [tuple(tensors[f"reference_latents_{i}"].shape[-2:]) for i in range(len(bucket[1]))]
        sizes = "".join(f"-r{a}x{b}" for a, b in references)
        name = f"shard-{self.number:05d}-{h}x{w}{sizes}-{self.parts[bucket]:03d}.safetensors"
        self.parts[bucket] += 1
        save_safetensors(tensors, self.out / name, {"captions": json.dumps(captions)})
        self.shards.append({**shard_record(self.out, name, len(captions), (h, w), references),
                            "masks": "loss_mask" in tensors})
        self.captions.append(captions)

    def finish(self) -> None:
        for size in sorted(self.waiting):
            self.encode(size)
        for size in sorted(self.encoded):
            self.write(size)


def encode_unit(number: int, unit: Unit, encoders: PipelineEncoders, settings: dict, out: Path, progress) -> dict:
    """Encode a unit and publish its report (the marker that it is finished); returns the report."""
    buckets = (aspect_buckets(settings["resolution"], settings["bucket_step"]) if settings["aspect_buckets"]
               else [(settings["resolution"], settings["resolution"])])
    writer, skipped, samples = UnitWriter(number, encoders, settings, out, progress), [], 0
    prepared = ordered_map(lambda s: prepare(s, buckets, encoders.reference), unit.samples(), settings["workers"])
    for sample, size, pixels, mask, references in prepared:
        samples += 1
        if sample.problem:
            skipped.append({"key": sample.key, "why": sample.problem})
        else:
            writer.add(size, pixels, sample.caption, mask, references)
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
