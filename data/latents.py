"""Precomputed latents and text embeddings in safetensors shards, read through memory maps.

A dataset directory (written by `python precompute_latents.py`) holds shards, each a safetensors file with
    latents               [N, C, h, w]  VAE latents, already shifted and scaled for the MMDiT
    prompt_embeds         [N, L, J]     text-token embeddings (SD3: CLIP-L ++ CLIP-G, padded, then T5)
    pooled_prompt_embeds  [N, P]        pooled text embeddings
    latents_flipped       [N, C, h, w]  optional (--random-flip): the latents of the image mirrored left-right
and the captions as a JSON list under the header key "captions" (optional). `dataset.json` lists the shards
in order (and records the VAE that encoded them); without it every `*.safetensors` file is a shard, in name
order. `empty_prompt.safetensors` (one row of each text tensor) is the encoding of "", used for caption
dropout as SD3 pipelines use it for the unconditional branch; `validation_prompts.safetensors` holds the
encodings of the validation prompts. Every header is checked when the dataset opens, before any compute.
"""

import json
import logging
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

FIELDS = {"latents": 4, "prompt_embeds": 3, "pooled_prompt_embeds": 2}  # name -> number of dimensions
# sizes every shard must share, and the field each is read from
SHARED_DIMS = {"channels": "latents channels", "text_tokens": "prompt_embeds length",
               "joint_dim": "prompt_embeds width", "pooled_dim": "pooled_prompt_embeds width"}
EMPTY_PROMPT = "empty_prompt.safetensors"
VALIDATION_PROMPTS = "validation_prompts.safetensors"  # encodings of --validation-prompts (optional)
INDEX = "dataset.json"
PRECOMPUTE_SETTINGS = "precompute.json"  # written first by data.precompute; dataset.json is written last
log = logging.getLogger("mmdit")
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


class DataFormatError(ValueError):
    pass


def vae_folder(dataset: "LatentDataset", override: str | None) -> Path:
    """The VAE that decodes the dataset's latents: `override` (a pipeline or its vae/ folder), else the one its
    precompute recorded in dataset.json."""
    if override:
        folder, source = Path(override), "validation.vae_from"
    else:
        recorded = dataset.index.get("vae", {}).get("folder") or (dataset.index.get("model") and
                                                                 f"{dataset.index['model']}/vae")
        if not recorded:
            raise DataFormatError(f"{dataset.directory}/{INDEX} records no VAE; set validation.vae_from to the "
                                  f"pipeline (or its vae/ folder) that encoded the dataset")
        folder, source = Path(recorded), f"the VAE recorded in {dataset.directory}/{INDEX}"
    if (folder / "vae" / "config.json").is_file():
        folder = folder / "vae"
    if not (folder / "config.json").is_file():
        raise DataFormatError(f"{source}: {folder} is not a diffusers VAE folder (no config.json); set "
                              f"validation.vae_from to the SD3 pipeline (or its vae/ folder) that encoded the data")
    return folder


def load_vae(folder: Path, device: torch.device, dtype: torch.dtype):
    """A diffusers AutoencoderKL, in eval mode on `device`."""
    try:
        from diffusers import AutoencoderKL
    except ImportError:
        raise DataFormatError("decoding latents needs diffusers: pip install -e '.[finetune]'") from None
    try:
        vae = AutoencoderKL.from_pretrained(folder, torch_dtype=dtype)
    except (OSError, ValueError) as e:
        raise DataFormatError(f"the VAE in {folder} does not load: {e}") from None
    log.info("latents decoded by the VAE in %s", folder)
    return vae.to(device).eval()


def read_header(path: Path) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str]]:
    """{field: (dtype, shape)} and the string metadata of one safetensors file, without reading tensors."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100_000_000:
                raise ValueError(f"header length {size}")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as e:
        raise DataFormatError(f"{path}: not a readable safetensors file ({e})") from None
    metadata = header.pop("__metadata__", None) or {}
    return {k: (v["dtype"], v["shape"]) for k, v in header.items()}, metadata


def shard_paths(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise DataFormatError(f"data.path={directory} is not a directory of latent shards")
    if (directory / PRECOMPUTE_SETTINGS).is_file() and not (directory / INDEX).is_file():
        raise DataFormatError(f"data.path={directory}: its precompute has not finished (no {INDEX}); rerun the "
                              f"same python precompute_latents.py command to complete it")
    if (directory / INDEX).is_file():
        try:
            names = [s["file"] for s in json.loads((directory / INDEX).read_text())["shards"]]
        except (ValueError, KeyError, TypeError) as e:
            raise DataFormatError(f"{directory / INDEX}: expected {{'shards': [{{'file': ...}}, ...]}} ({e})") from None
        paths = [directory / n for n in names]
        absent = [str(p) for p in paths if not p.is_file()]
        if absent:
            raise DataFormatError(f"{directory / INDEX} lists shards that do not exist: {absent[:5]}")
        return paths
    paths = sorted(p for p in directory.glob("*.safetensors") if p.name not in (EMPTY_PROMPT, VALIDATION_PROMPTS))
    if not paths:
        raise DataFormatError(f"data.path={directory} holds no *.safetensors shards "
                              f"(run python precompute_latents.py)")
    return paths


class LatentDataset(torch.utils.data.Dataset):
    """Items: `latents`, `prompt_embeds`, `pooled_prompt_embeds` (float32) and `caption`."""

    def __init__(self, directory: str | Path, aspect_buckets: bool = False):
        self.directory = Path(directory)
        self.paths = shard_paths(self.directory)
        self.rows, self.sizes, self.captions, first = [], [], [], None
        for shard, path in enumerate(self.paths):
            fields, metadata = read_header(path)
            dims = self.check_shard(path, fields)
            first = first or (path, dims)
            for name, field in SHARED_DIMS.items():
                if dims[name] != first[1][name]:
                    raise DataFormatError(f"{path}: {field} is {dims[name]} but {first[0]} has {first[1][name]}; "
                                          f"all shards must come from the same VAE and text encoders")
            if dims["size"] != first[1]["size"] and not aspect_buckets:
                raise DataFormatError(f"{path}: latents are {dims['size'][0]}x{dims['size'][1]} but {first[0]} has "
                                      f"{first[1]['size'][0]}x{first[1]['size'][1]}; set data.aspect_buckets=true "
                                      f"to train on several sizes")
            captions = json.loads(metadata.get("captions", "null")) or [""] * dims["count"]
            if len(captions) != dims["count"]:
                raise DataFormatError(f"{path}: {len(captions)} captions for {dims['count']} latents")
            if dims["flipped"] != first[1]["flipped"]:
                raise DataFormatError(f"{path}: {'has' if dims['flipped'] else 'lacks'} latents_flipped but {first[0]} "
                                      f"does not; precompute the whole dataset with or without --random-flip")
            self.rows += [(shard, row) for row in range(dims["count"])]
            self.sizes += [dims["size"]] * dims["count"]
            self.captions += captions
        d = first[1]
        self.latent_channels, self.text_tokens = d["channels"], d["text_tokens"]
        self.text_dims = (d["joint_dim"], d["pooled_dim"])
        self.latent_sizes = sorted(set(self.sizes))
        self.fields = [*FIELDS, *(["latents_flipped"] if d["flipped"] else [])]
        self.empty_prompt, _ = self.read_prompts(EMPTY_PROMPT, rows=1)
        if self.empty_prompt is None:
            log.warning("%s has no %s: caption dropout feeds zeros instead of the encoding of \"\"",
                        self.directory, EMPTY_PROMPT)
        self.index = json.loads((self.directory / INDEX).read_text()) if (self.directory / INDEX).is_file() else {}
        self.handles = {}

    @staticmethod
    def check_shard(path: Path, fields: dict) -> dict:
        for name, ndim in FIELDS.items():
            if name not in fields:
                raise DataFormatError(f"{path}: field {name!r} is missing (found {sorted(fields)}); "
                                      f"expected {sorted(FIELDS)}")
            dtype, shape = fields[name]
            if len(shape) != ndim:
                raise DataFormatError(f"{path}: field {name!r} has shape {shape}, expected {ndim} dimensions")
            if dtype not in FLOAT_DTYPES:
                raise DataFormatError(f"{path}: field {name!r} has dtype {dtype}, expected one of {FLOAT_DTYPES}")
        counts = {name: fields[name][1][0] for name in FIELDS}
        if len(set(counts.values())) != 1:
            raise DataFormatError(f"{path}: fields have different numbers of rows {counts}")
        (count, channels, h, w), (_, tokens, joint), (_, pooled) = (fields[n][1] for n in FIELDS)
        if count == 0:
            raise DataFormatError(f"{path}: the shard is empty")
        flipped = "latents_flipped" in fields
        if flipped and fields["latents_flipped"][1] != fields["latents"][1]:
            raise DataFormatError(f"{path}: field 'latents_flipped' has shape {fields['latents_flipped'][1]}, "
                                  f"expected that of latents {fields['latents'][1]}")
        return {"count": count, "channels": channels, "size": (h, w), "text_tokens": tokens,
                "joint_dim": joint, "pooled_dim": pooled, "flipped": flipped}

    @cached_property
    def validation_set(self) -> tuple[dict | None, list[str] | None]:
        """The validation prompts' encodings and captions, read when validation first asks (they are large, and
        every rank and loader worker holds the dataset)."""
        return self.read_prompts(VALIDATION_PROMPTS)

    @property
    def validation_prompts(self) -> dict | None:
        return self.validation_set[0]

    @property
    def validation_captions(self) -> list[str] | None:
        return self.validation_set[1]

    def read_prompts(self, name: str, rows: int | None = None) -> tuple[dict | None, list[str] | None]:
        """An encoded-prompt file of the dataset (the encoding of "", or the validation prompts): its text
        tensors (float32) and captions; (None, None) if the file is absent."""
        path = self.directory / name
        if not path.is_file():
            return None, None
        fields, metadata = read_header(path)
        count = rows or fields.get("prompt_embeds", (None, [0]))[1][0]
        expected = {"prompt_embeds": [count, self.text_tokens, self.text_dims[0]],
                    "pooled_prompt_embeds": [count, self.text_dims[1]]}
        for field, shape in expected.items():
            if field not in fields or fields[field][1] != shape or not count:
                raise DataFormatError(f"{path}: field {field!r} should have shape {shape}, found "
                                      f"{fields.get(field, (None, 'nothing'))[1]}")
        with safe_open(path, "pt") as f:
            prompts = {field: f.get_tensor(field).float() for field in expected}
        return prompts, json.loads(metadata.get("captions", "null")) or [""] * count

    def __len__(self) -> int:
        return len(self.rows)

    def handle(self, shard: int):
        """A memory-mapped view of a shard, opened once per process (loader workers open their own)."""
        if shard not in self.handles:
            self.handles[shard] = safe_open(self.paths[shard], "pt")
        return self.handles[shard]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "handles": {}}

    def __getitem__(self, index: int) -> dict:
        shard, row = self.rows[index]
        f = self.handle(shard)
        item = {name: f.get_slice(name)[row : row + 1][0].float() for name in self.fields}
        return {**item, "caption": self.captions[index]}
