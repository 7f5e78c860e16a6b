"""Latent datasets: VAE latents (and precomputed text embeddings, or only captions) in safetensors shards, with
an index that opens in constant memory.

A dataset directory (written by precompute_latents.py) holds
- shards, each a safetensors file with
      latents               [N, C, h, w]  VAE latents, shifted and scaled for the MMDiT (models/vae.py)
      latents_flipped       [N, C, h, w]  optional (--random-flip): the latents of the image mirrored left-right
      prompt_embeds         [N, L, J]     text-token embeddings (SD3: CLIP-L ++ CLIP-G, padded, then T5)
      pooled_prompt_embeds  [N, P]        pooled text embeddings, where the family has them (SD3, FLUX.1)
      prompt_embeds_mask    [N, L]        1 for a token, 0 for padding, where the family's text is padded to L
                                          (Qwen-Image): `text_shapes` says which a dataset has
      (with --caption-variants K > 1 each text field holds K encodings per item: [N, K, L, J], [N, K, P], [N, K, L],
      the caption's variants of data/captions.py; datasets without the record hold one)
      loss_mask             [N, 1, h, w]  optional: per-latent-element loss weights in [0, 1] from the image's
                                          mask (white = 1); shards without it belong to items without a mask
      reference_latents_i   [N, C, h_i, w_i]  an edit dataset's reference image i (i = 0 ... references - 1),
                                          encoded at its own size as the family's edit pipeline sizes it
  (the text fields are absent from datasets of `--text-embeddings none`, whose captions training encodes:
  data.text_encoding=on_the_fly), and the captions as a JSON list under the header key "captions";
- `dataset.json`: the format, the shards in order with their item count, latent size (and reference sizes),
  bytes and sha256 (what a published shard must still be), the fields' sizes, whether text embeddings are stored,
  the VAE and pipeline that encoded it (and its T5 sequence length), whether any item has a loss mask (`masks`),
  the reference images per item (`references`, 0 but for edit datasets), the buckets, and how its captions were
  made before encoding (`captions`: prefix, tag shuffling and dropout, variants; absent: as written, one each);
- `index/`: the per-item table as arrays, memory-mapped when the dataset opens (no shard is read for it, and
  loader workers share the pages): each item's shard, row and bucket, and where its caption lies in
  `index/captions.bin`;
- `negative_prompt.safetensors`: the encoding of the family's default negative prompt, where its pipelines use
  one other than "" (Qwen-Image's " "): the unconditional input of validation images;
- `empty_prompt.safetensors`: the encoding of "" (caption dropout's input, as SD3 pipelines use it for the
  unconditional branch), and `validation_prompts.safetensors`: the validation prompts' encodings (their
  captions alone in dataset.json for datasets encoded during training).

A bucket is the tuple (target latent size, reference latent sizes): every item of a shard has the same, and a
global batch is drawn from one bucket (data/loader.py), so the references of a batch stack like its targets. An
edit dataset (precompute_latents.py --references) holds the same number of references for every item; its caption
is the instruction; the loss mask, where there is one, is the target's.

Opening a dataset checks every shard's byte size against dataset.json, so a damaged or missing shard is named
before a run directory is touched; each shard's header is checked when a loader first reads it.
"""

import json
import logging
from functools import cached_property
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from safetensors import safe_open

from data.captions import recorded_style
from errors import InputError
from formats import check_format, sha256

FORMAT = 2  # dataset.json's "format"
INDEX = "dataset.json"
INDEX_DIR = "index"
EMPTY_PROMPT = "empty_prompt.safetensors"
NEGATIVE_PROMPT = "negative_prompt.safetensors"  # validation's unconditional input, where not the empty prompt
VALIDATION_PROMPTS = "validation_prompts.safetensors"  # encodings of --validation-prompts (optional)
PRECOMPUTE_SETTINGS = "precompute.json"  # written first by precompute; dataset.json is written last
TEXT_FIELDS = ("prompt_embeds", "pooled_prompt_embeds", "prompt_embeds_mask")  # what `text_shapes` may name
log = logging.getLogger("mmdit")


def text_shapes(tokens: int, dims: tuple[int, int], masked: bool = False) -> dict[str, tuple[int, ...]]:
    """The text fields of one item and their shapes: the token embeddings [tokens, dims[0]], the pooled vector
    [dims[1]] where the family has one (dims[1] > 0), and the padding mask [tokens] where its text is padded."""
    joint, pooled = dims
    shapes = {"prompt_embeds": (tokens, joint)}
    if pooled:
        shapes["pooled_prompt_embeds"] = (pooled,)
    if masked:
        shapes["prompt_embeds_mask"] = (tokens,)
    return shapes


def empty_text(shapes: dict[str, tuple[int, ...]], batch: int = 1) -> dict[str, torch.Tensor]:
    """Text fields of `batch` items, zero but for the mask (every token present): the shapes, for counting FLOPs
    and planning memory."""
    return {name: (torch.ones if name == "prompt_embeds_mask" else torch.zeros)(batch, *shape)
            for name, shape in shapes.items()}


class DataFormatError(InputError):
    pass


def shard_record(directory: Path, file: str, count: int, latent_size, reference_sizes=()) -> dict:
    """What dataset.json records of a published shard: what it holds, and the bytes and sha256 it must keep."""
    return {"file": file, "count": count, "latent_size": list(latent_size),
            "reference_sizes": [list(size) for size in reference_sizes],
            "bytes": (directory / file).stat().st_size, "sha256": sha256(directory / file)}


Bucket = tuple[tuple[int, int], tuple[tuple[int, int], ...]]  # (target size, reference sizes)


def bucket_of(shard: dict) -> Bucket:
    return tuple(shard["latent_size"]), tuple(tuple(size) for size in shard.get("reference_sizes", ()))


def bucket_name(bucket: Bucket) -> str:
    """8x8, or 8x8 with references 6x10, 4x4."""
    (h, w), references = bucket
    return f"{h}x{w}" + (f" with references {', '.join(f'{a}x{b}' for a, b in references)}" if references else "")


def publish_json(path: Path, record: dict) -> None:
    publish_text(path, json.dumps(record, indent=1))


def publish_text(path: Path, text: str) -> None:
    """Write a file whole or not at all (a reader never sees part of it): a temporary file, renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:  # no space left: nothing of it stays
        tmp.unlink(missing_ok=True)
        raise


def write_index(directory: Path, shards: list[dict], captions: Iterable[list[str]], info: dict) -> None:
    """Publish a dataset: the per-item arrays of `shards` (dicts with file, count, latent_size, bytes, sha256; in
    order) and their `captions` (a list per shard, streamed to disk), then dataset.json (with `info`: the fields'
    sizes, the encoders), last."""
    buckets = sorted({bucket_of(s) for s in shards})
    counts = np.array([s["count"] for s in shards], dtype=np.int64)
    index = directory / INDEX_DIR
    index.mkdir(exist_ok=True)
    lengths = np.zeros(int(counts.sum()), dtype=np.int64)
    with open(index / "captions.bin", "wb") as blob:
        for shard, start, texts in zip(shards, np.cumsum(counts) - counts, captions, strict=True):
            if len(texts) != shard["count"]:
                raise DataFormatError(f"{shard['file']}: {len(texts)} captions for {shard['count']} items")
            encoded = [text.encode() for text in texts]
            lengths[start : start + len(encoded)] = [len(e) for e in encoded]
            blob.write(b"".join(encoded))
    arrays = {"shard": np.repeat(np.arange(len(shards), dtype=np.int32), counts),
              "row": np.arange(len(lengths), dtype=np.int32) - np.repeat((np.cumsum(counts) - counts).astype(np.int32),
                                                                         counts),
              "bucket": np.repeat(np.array([buckets.index(bucket_of(s)) for s in shards], dtype=np.int16), counts),
              "caption_start": np.concatenate([[0], np.cumsum(lengths)])}
    for name, array in arrays.items():
        np.save(index / f"{name}.npy", array)
    record = {"format": FORMAT, **info, "latent_sizes": [list(t) for t in sorted({t for t, _ in buckets})],
              "buckets": [[list(target), [list(r) for r in references]] for target, references in buckets],
              "items": int(counts.sum()), "shards": shards}
    publish_json(directory / INDEX, record)  # the finished-dataset marker, last


def read_index(directory: Path) -> dict:
    """dataset.json, refusing an unfinished precompute or an earlier format."""
    if not directory.is_dir():
        raise DataFormatError(f"data.path={directory} is not a directory of latent shards")
    if not (directory / INDEX).is_file():
        if (directory / PRECOMPUTE_SETTINGS).is_file():
            raise DataFormatError(f"data.path={directory}: its precompute has not finished (no {INDEX}); rerun the "
                                  f"same precompute_latents.py command to complete it")
        raise DataFormatError(f"data.path={directory} holds no {INDEX} (run precompute_latents.py)")
    try:
        record = json.loads((directory / INDEX).read_text())
        record["shards"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataFormatError(f"{directory / INDEX} is not a dataset index ({type(e).__name__}: {e})") from None
    check_format(record, FORMAT, f"the dataset {directory}", "precompute_latents.py",
                 "rerun it into a new --out", DataFormatError)
    return record


def check_shards(directory: Path, shards: list[dict]) -> None:
    """Every shard exists with the byte size it was published with; all the damaged ones named at once."""
    problems = []
    for shard in shards:
        path = directory / shard["file"]
        if not path.is_file():
            problems.append(f"{shard['file']} is missing")
        elif path.stat().st_size != shard["bytes"]:
            problems.append(f"{shard['file']} has {path.stat().st_size} bytes, {shard['bytes']} were published")
    if problems:
        raise DataFormatError(f"data.path={directory}: {len(problems)} damaged shard(s): {'; '.join(problems[:10])}"
                              f"; rerun the same precompute_latents.py command: it redoes them")


class LatentDataset(torch.utils.data.Dataset):
    """Items: `latents` (float32), `caption`, and the text fields of `text_shapes` (float32) with
    `text_embeddings` (the dataset must store them; without, training encodes the captions), and `loss_mask`
    ([1, h, w] float32; all ones for an item without a mask) with `masks` (None: if the dataset has masks)."""

    def __init__(self, directory: str | Path, aspect_buckets: bool = False, text_embeddings: bool = True,
                 masks: bool | None = False):
        self.directory = Path(directory)
        self.index = read_index(self.directory)
        check_shards(self.directory, self.index["shards"])
        self.latent_sizes = [tuple(s) for s in self.index["latent_sizes"]]
        # a dataset written before edit datasets: one bucket per size, in the same (sorted) order
        self.buckets = [(tuple(t), tuple(tuple(r) for r in refs)) for t, refs in
                        self.index.get("buckets", [[size, []] for size in self.latent_sizes])]
        self.references = self.index.get("references", 0)
        if len(self.buckets) > 1 and not aspect_buckets:
            raise DataFormatError(f"data.path={self.directory} holds latents of {len(self.buckets)} sizes "
                                  f"({'; '.join(map(bucket_name, self.buckets))}); set data.aspect_buckets=true to "
                                  f"train on several sizes")
        self.latent_channels = self.index["channels"]
        if text_embeddings and not self.index["text_embeddings"]:
            raise DataFormatError(f"data.path={self.directory} stores captions without text embeddings "
                                  f"(precompute_latents.py --text-embeddings none): set data.text_encoding=on_the_fly")
        self.text_encoded = text_embeddings  # else the captions are encoded in the training step
        self.has_masks = bool(self.index.get("masks"))
        if masks and not self.has_masks:
            raise DataFormatError(f"data.use_masks=true but {self.directory} has no loss masks (its images had no "
                                  f"alpha channel and no NAME.mask.png beside them); set data.use_masks=auto or false")
        self.masks = self.has_masks if masks is None else masks
        self.text_tokens, self.text_dims = self.index.get("text_tokens"), tuple(self.index.get("text_dims") or ())
        self.text_mask = bool(self.index.get("text_mask"))  # recorded since Qwen-Image
        self.text_shapes = text_shapes(self.text_tokens, self.text_dims, self.text_mask) if self.text_dims else {}
        self.fields = ["latents", *(["latents_flipped"] if self.index["flipped"] else []),
                       *(self.text_shapes if self.text_encoded else []),
                       *(f"reference_latents_{i}" for i in range(self.references))]
        self.caption_style, self.caption_variants = recorded_style(self.index)
        arrays = {name: np.load(self.directory / INDEX_DIR / f"{name}.npy", mmap_mode="r")
                  for name in ("shard", "row", "bucket", "caption_start")}
        self.shard_of, self.row_of, self.bucket_of, self.caption_start = (arrays[k] for k in
                                                                          ("shard", "row", "bucket", "caption_start"))
        if len(self.shard_of) != self.index["items"]:
            raise DataFormatError(f"{self.directory / INDEX_DIR} holds {len(self.shard_of)} items, {INDEX} "
                                  f"{self.index['items']}; rerun precompute_latents.py")
        self.empty_prompt = self.read_prompts(EMPTY_PROMPT)[0] if self.text_encoded else None
        if self.text_encoded and self.empty_prompt is None:
            log.warning("%s has no %s: caption dropout feeds zeros instead of the encoding of \"\"", self.directory,
                        EMPTY_PROMPT)
        self.handles = {}

    @cached_property
    def captions_blob(self) -> np.memmap:
        return np.memmap(self.directory / INDEX_DIR / "captions.bin", dtype=np.uint8, mode="r") \
            if self.caption_start[-1] else np.zeros(0, dtype=np.uint8)

    def caption(self, index: int) -> str:
        return bytes(self.captions_blob[self.caption_start[index]:self.caption_start[index + 1]]).decode()

    @cached_property
    def commonest_bucket(self) -> Bucket:
        return self.buckets[int(np.bincount(self.bucket_of).argmax())]

    @property
    def commonest_size(self) -> tuple[int, int]:
        return self.commonest_bucket[0]

    def items_by_bucket(self, items: np.ndarray) -> dict[Bucket, np.ndarray]:
        """The given items grouped by bucket (each group in the order given)."""
        buckets = self.bucket_of[items]
        return {bucket: items[buckets == b] for b, bucket in enumerate(self.buckets)}

    @cached_property
    def validation_set(self) -> tuple[dict | None, list[str] | None]:
        """The validation prompts' encodings (None for datasets encoded during training) and captions, read when
        validation first asks (they are large, and every rank and loader worker holds the dataset)."""
        if not self.index["text_embeddings"]:
            return None, self.index.get("validation_prompts")
        prompts, captions = self.read_prompts(VALIDATION_PROMPTS)
        return (prompts if self.text_encoded else None), captions

    @cached_property
    def negative_prompt(self) -> dict | None:
        """The unconditional input of validation images: the family's negative prompt, else the empty one."""
        return (self.read_prompts(NEGATIVE_PROMPT)[0] or self.empty_prompt) if self.text_encoded else None

    @property
    def validation_prompts(self) -> dict | None:
        return self.validation_set[0]

    @property
    def validation_captions(self) -> list[str] | None:
        return self.validation_set[1]

    def read_prompts(self, name: str) -> tuple[dict | None, list[str] | None]:
        """An encoded-prompt file of the dataset (the encoding of "", or the validation prompts): its text
        tensors (float32) and captions; (None, None) if the file is absent."""
        path = self.directory / name
        if not path.is_file():
            return None, None
        with self.open(path) as f:
            count = f.get_slice("prompt_embeds").get_shape()[0]
            expected = {field: [count, *shape] for field, shape in self.text_shapes.items()}
            found = {field: f.get_slice(field).get_shape() if field in f.keys() else "nothing" for field in expected}
            if found != expected:
                raise DataFormatError(f"{path}: fields should have shapes {expected}, found {found}")
            prompts = {field: f.get_tensor(field).float() for field in expected}
            captions = json.loads((f.metadata() or {}).get("captions", "null"))
        return prompts, captions or [""] * count

    def open(self, path: Path):
        try:
            return safe_open(path, "pt")
        except Exception as e:  # safetensors reports a truncated or corrupt header without the file's name
            raise DataFormatError(f"{path}: not a readable safetensors file ({e}); rerun the same "
                                  f"precompute_latents.py command: it redoes damaged shards") from None

    def __len__(self) -> int:
        return len(self.shard_of)

    def handle(self, shard: int):
        """A memory-mapped view of a shard, opened once per process (loader workers open their own), its fields
        checked against dataset.json then."""
        if shard not in self.handles:
            record = self.index["shards"][shard]
            path = self.directory / record["file"]
            f = self.open(path)
            (n, (h, w)), c = (record["count"], record["latent_size"]), self.latent_channels
            k = [self.caption_variants] if self.caption_variants > 1 else []
            expected = {"latents": [n, c, h, w], "latents_flipped": [n, c, h, w], "loss_mask": [n, 1, h, w],
                        **{field: [n, *k, *shape] for field, shape in self.text_shapes.items()},
                        **{f"reference_latents_{i}": [n, c, *size]
                           for i, size in enumerate(record.get("reference_sizes", ()))}}
            fields = [*self.fields, *(["loss_mask"] if self.masks and record.get("masks") else [])]
            expected = {field: expected.get(field, f"a size {INDEX} records") for field in fields}
            found = {field: (f.get_slice(field).get_shape() if field in f.keys() else "missing") for field in expected}
            wrong_type = [field for field in expected if field in f.keys()
                          and f.get_slice(field).get_dtype() not in ("F16", "BF16", "F32")]
            if found != expected or wrong_type:
                raise DataFormatError(f"{path}: its fields {found}{f' (not floating point: {wrong_type})' if wrong_type else ''}"
                                      f" are not what {INDEX} records {expected}; rerun the same precompute_latents.py "
                                      f"command: it redoes damaged shards")
            self.handles[shard] = f
        return self.handles[shard]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "handles": {}}

    def __getitem__(self, index: int) -> dict:
        return self.item(index)

    def item(self, index: int, caption_key: int = 0) -> dict:
        """Item `index`, its text the caption variant `caption_key` mod K (data/captions.py) where there are K."""
        shard, row = int(self.shard_of[index]), int(self.row_of[index])
        f = self.handle(shard)
        variant = caption_key % self.caption_variants
        one_of_k = lambda name: self.caption_variants > 1 and name in self.text_shapes  # noqa: E731
        item = {name: (f.get_slice(name)[row : row + 1, variant : variant + 1][0, 0] if one_of_k(name)
                       else f.get_slice(name)[row : row + 1][0]).float() for name in self.fields}
        if self.references:
            item["references"] = tuple(item.pop(f"reference_latents_{i}") for i in range(self.references))
        if self.masks:
            masked = self.index["shards"][shard].get("masks")
            item["loss_mask"] = (f.get_slice("loss_mask")[row : row + 1][0].float() if masked
                                 else torch.ones_like(item["latents"][:1]))
        return {**item, "caption": self.caption(index)}


def vae_folder(dataset: "LatentDataset", override: str | None, key: str = "validation.vae_from") -> Path:
    """The VAE that decodes the dataset's latents: `override` (a pipeline or its vae/ folder: `key`), else the one its
    precompute recorded in dataset.json."""
    if override:
        folder, source = Path(override), key
    else:
        recorded = dataset.index.get("vae", {}).get("folder") or (dataset.index.get("model") and
                                                                 f"{dataset.index['model']}/vae")
        if not recorded:
            raise DataFormatError(f"{dataset.directory}/{INDEX} records no VAE; set {key} to the pipeline (or its "
                                  f"vae/ folder) that encoded the dataset")
        folder, source = Path(recorded), f"the VAE recorded in {dataset.directory}/{INDEX}"
    if (folder / "vae" / "config.json").is_file():
        folder = folder / "vae"
    if not (folder / "config.json").is_file():
        raise DataFormatError(f"{source}: {folder} is not a diffusers VAE folder (no config.json); set {key} to the "
                              f"pipeline (or its vae/ folder) that encoded the data")
    return folder

