"""What precompute reads: image folders, JSONL manifests and webdataset shards, split into units of work; each
input is checked before anything is written."""

import dataclasses
import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass
from itertools import count, takewhile
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

from PIL import Image

from data.webdataset import IMAGE_SUFFIXES as SHARD_IMAGE_SUFFIXES
from data.webdataset import MASK_SUFFIX, REFERENCE_MISSING, Sample, ShardError, read_samples
from errors import InputError
from models.diffusers_io import CheckpointFormatError
from models.families import FAMILIES, Family, family_of_pipeline

log = logging.getLogger("mmdit")
IMAGE_SUFFIXES = {f".{suffix}" for suffix in SHARD_IMAGE_SUFFIXES}  # of folder inputs: what shards may hold
EXIF_ORIENTATION = 0x0112
MASK_NAME = f".{MASK_SUFFIX}"  # `NAME.mask.png` beside an image of a folder or manifest
NO_CAPTION, NOT_UTF8 = "no same-named .txt caption", "not UTF-8 text"
UTF8_HINT = "; captions are read as UTF-8 (convert a latin-1 file with iconv -f latin1 -t utf-8)"
BAD_INPUTS_LISTED = 50  # of a folder's or manifest's bad inputs, listed in the error (all are counted)
SAMPLES_PEEKED = 100  # of the first shard, whose most common number of references is the dataset's


class PrecomputeError(InputError):
    pass


class BadSample(ValueError):
    pass


@dataclass
class Unit:
    name: str  # in reports and errors: the input shard, or the items of a folder or manifest
    samples: Callable[[], Iterator[Sample]]


def read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PrecomputeError(f"{what} {path} is not readable UTF-8 text ({e})") from None


def read_caption(path: Path) -> tuple[str | None, str | None]:
    """(caption, None), or (None, why it cannot be used). Only UTF-8: another encoding (latin-1, Windows-1252)
    cannot be told from the bytes, and a wrong guess would train on other characters than the file's."""
    try:
        return path.read_text(encoding="utf-8").strip(), None
    except UnicodeDecodeError as e:
        return None, f"{NOT_UTF8} (byte 0x{e.object[e.start]:02x} at offset {e.start})"
    except OSError as e:
        return None, f"not readable ({e.strerror})"


def read_image_folder(directory: Path) -> tuple[list[tuple[Path, str | None]], list[tuple[str, str]]]:
    """Every image of the folder with its caption (None where there is no usable one), and those problems as
    (file, why), for `check_items` to report with the unreadable images."""
    if not directory.is_dir():
        raise PrecomputeError(f"--images {directory} is not a directory")
    images = sorted(p for p in directory.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES
                    and not p.name.lower().endswith(MASK_NAME))
    if not images:
        raise PrecomputeError(f"--images {directory}: no image files ({sorted(IMAGE_SUFFIXES)})")
    items, bad = [], []
    for image in images:
        caption_file = image.with_suffix(".txt")
        caption, problem = read_caption(caption_file) if caption_file.is_file() else (None, NO_CAPTION)
        items.append((image, caption))
        if problem:
            bad.append((str(image if problem == NO_CAPTION else caption_file), problem))
    return items, bad


def read_manifest(path: Path) -> tuple[list[tuple[Path, str]], list[tuple[str, str]], dict[Path, tuple[Path, ...]]]:
    """The manifest's images with their captions, its bad lines and missing images as (where, why), for
    `check_items`, and the reference images of the lines that list them (`"references": [path, ...]`, relative to
    the manifest: an edit's)."""
    if not path.is_file():
        raise PrecomputeError(f"--manifest {path} does not exist")
    items, bad, references = [], [], {}
    for number, line in enumerate(read_text(path, "--manifest").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            image, caption = path.parent / record["image"], record["caption"]
            listed = tuple(path.parent / name for name in record.get("references", ()))
        except (ValueError, KeyError, TypeError) as e:
            bad.append((f"--manifest {path} line {number}", f'not an {{"image": ..., "caption": ...}} line '
                        f"({type(e).__name__}: {e})"))
            continue
        missing = [str(r) for r in listed if not r.is_file()]
        if not image.is_file():
            bad.append((str(image), f"does not exist (--manifest line {number})"))
        elif missing:
            bad.append((str(image), f"{REFERENCE_MISSING}: {', '.join(missing)} (--manifest line {number})"))
        else:
            items.append((image, str(caption)))
            if listed:
                references[image] = listed
    if not items and not bad:
        raise PrecomputeError(f"--manifest {path} lists no images")
    return items, bad, references


REFERENCE_ORPHAN = "reference without a target"


def folder_references(items: list[tuple[Path, str | None]], images: Path, folder: Path
                      ) -> tuple[dict[Path, tuple[Path, ...]], list[tuple[str, str]]]:
    """Each image's reference images in `folder` (--references): the file of its stem at the same relative path
    (`cat.png` -> `folder/cat.png`, any image suffix), or several, `cat_0.png`, `cat_1.png`, ...; and the
    problems as (file, why): a target without one, a reference of no target."""
    if not folder.is_dir():
        raise PrecomputeError(f"--references {folder} is not a directory")
    files = {p.relative_to(folder).with_suffix(""): p for p in sorted(folder.rglob("*"))
             if p.suffix.lower() in IMAGE_SUFFIXES}
    references, bad, claimed = {}, [], set()
    for image, _ in items:
        stem = image.relative_to(images).with_suffix("")
        several = list(takewhile(lambda name: name in files, (stem.with_name(f"{stem.name}_{i}") for i in count())))
        names = [stem] if stem in files else several
        if not names or (stem in files and several):
            bad.append((str(image), f"{REFERENCE_MISSING}: expected {folder / stem}.png, or {stem.name}_0.png, "
                        f"{stem.name}_1.png, ... beside it" if not names else
                        f"{REFERENCE_MISSING}: both {files[stem].name} and {files[several[0]].name} (one, or "
                        f"numbered ones)"))
            continue
        references[image] = tuple(files[name] for name in names)
        claimed |= set(names)
    bad += [(str(files[name]), f"{REFERENCE_ORPHAN}: no image {images / name}.* in --images")
            for name in files if name not in claimed]
    return references, bad


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
        raise BadSample(f"not a readable image ({e})") from None


def check_items(items: list[tuple[Path, str | None]], bad: list[tuple[str, str]], source: str,
                references: dict[Path, tuple[Path, ...]] | None = None) -> None:
    """Folder and JSONL inputs: one error naming every bad input (the readers' `bad`, and unreadable images and
    reference images), so that one round of fixes is enough; an edit dataset's targets all have references, the
    same number; a warning for empty captions."""
    references = references or {}
    unreadable = []
    for path, _ in items:
        for file in (path, *references.get(path, ())):
            try:
                image_size(file)
            except BadSample as e:
                unreadable.append((str(path), str(e) if file == path else f"reference {file}: {e}"))
    bad = bad + unreadable
    bad += reference_counts(items, references, {where for where, _ in bad})
    if bad:
        kinds = Counter(why.partition(" (")[0] for _, why in bad)
        raise PrecomputeError(
            f"{source}: {len(bad)} bad input(s) ({', '.join(f'{kind}: {n}' for kind, n in kinds.most_common())}); fix or remove them and rerun "
            f"(nothing was written){UTF8_HINT if NOT_UTF8 in kinds else ''}:\n  " +
            "\n  ".join(f"{where}: {why}" for where, why in bad[:BAD_INPUTS_LISTED]) +
            (f"\n  ... and {len(bad) - BAD_INPUTS_LISTED} more" if len(bad) > BAD_INPUTS_LISTED else ""))
    empty = [str(path.with_suffix(".txt") if source.startswith("--images") else path) for path, caption in items
             if not caption]
    if empty:  # a caption file left empty by mistake trains its image unconditionally: each one named
        log.warning("%d of %d images have an empty caption (trained as unconditional): %s%s", len(empty), len(items),
                    ", ".join(empty[:BAD_INPUTS_LISTED]),
                    f" and {len(empty) - BAD_INPUTS_LISTED} more" if len(empty) > BAD_INPUTS_LISTED else "")


def reference_counts(items: list[tuple[Path, str | None]], references: dict[Path, tuple[Path, ...]],
                     reported: set[str]) -> list[tuple[str, str]]:
    """Of an edit dataset (some item has references): each item not `reported` yet with another number of
    references than the most common (none counted), as (image, why)."""
    if not references:
        return []
    common = Counter(len(r) for r in references.values()).most_common(1)[0][0]
    found = {path: len(references.get(path, ())) for path, _ in items if str(path) not in reported}
    return [(str(path), f"{REFERENCE_MISSING}: none listed, the other images have {common}" if not n else
             f"{n} reference(s), the other images {common}") for path, n in found.items() if n != common]


def item_units(items: list[tuple[Path, str]], size: int, source: str,
               references: dict[Path, tuple[Path, ...]] | None = None) -> list[Unit]:
    """Folder and JSONL inputs in units of `size` items."""
    references = references or {}

    def samples(chunk):
        return lambda: (Sample(str(path), path, caption, mask=mask_beside(path), references=references.get(path, ()))
                        for path, caption in chunk)
    return [Unit(f"{source} items {start}-{min(start + size, len(items)) - 1}", samples(items[start : start + size]))
            for start in range(0, len(items), size)]


def mask_beside(image: Path) -> Path | None:
    """`NAME.mask.png` beside `NAME.ext`: the image's loss mask (white = train), if there is one."""
    mask = image.with_name(image.stem + MASK_NAME)
    return mask if mask.is_file() else None


def shard_units(sources: list[str], caption_field: str | None, references: int) -> list[Unit]:
    """Shards in units of one; a sample with another number of `references` than the dataset's is bad."""
    def samples(source: str) -> Iterator[Sample]:
        for sample in read_samples(source, caption_field):
            found = len(sample.references)
            if not sample.problem and found != references:
                why = (f"{REFERENCE_MISSING}: none, the dataset's samples have {references}" if not found else
                       f"reference count: {found}, the dataset's samples have {references}")
                sample = dataclasses.replace(sample, problem=why)
            yield sample
    return [Unit(source, lambda source=source: samples(source)) for source in sources]


def shard_references(sources: list[str], caption_field: str | None) -> int:
    """The reference images per sample of a dataset of shards (0: text to image), which cannot be read whole before
    it is encoded: the most common number among the first SAMPLES_PEEKED samples of the first shard that can be
    read (a shard that cannot is passed over here; its unit fails as it would anyway), bad samples not counted."""
    found, read = Counter(), 0
    for source in sources:
        samples = read_samples(source, caption_field)
        try:
            for sample in samples:
                read += 1
                if not sample.problem:
                    found[len(sample.references)] += 1
                if read == SAMPLES_PEEKED:
                    break
            break
        except ShardError:
            continue
        finally:
            samples.close()  # a `pipe:` command read in part is stopped
    references, agreeing = (found.most_common(1) or [(0, 0)])[0]
    if references:
        log.info("--shards: %d reference image(s) per sample, as %d of the first %d samples of %s have (an edit "
                 "dataset); a sample with another number is skipped as bad", references, agreeing, read, source)
    return references


def fingerprint(units: list[Unit], items: list[tuple[Path, str]] | None,
                references: dict[Path, tuple[Path, ...]] | None = None) -> str:
    """Of the inputs: for folders and manifests each file's path, caption, size and modification time (a
    replaced image counts; its mask and references too); for shards their names (a shard that failed is replaced,
    then the job rerun)."""
    digest = hashlib.sha256()
    if items is not None:
        for path, caption in items:
            stat = path.stat()
            digest.update(f"{path}\0{caption}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
            mask = mask_beside(path)
            for extra in ([mask] if mask is not None else []) + list((references or {}).get(path, ())):
                digest.update(f"{extra}\0{extra.stat().st_size}\0{extra.stat().st_mtime_ns}\0".encode())
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


def pipeline_family(model_dir: Path) -> Family:
    """The family of a pipeline folder (its model_index.json; SD3's layout without one), with the folders its
    encoders need, before any weight is loaded."""
    if not model_dir.is_dir():
        raise PrecomputeError(f"--model {model_dir} " + ("is not a directory" if model_dir.exists() else
                              "does not exist") + "; expected a diffusers pipeline directory (SD3 / SD3.5, FLUX.1, "
                              "Qwen-Image or FLUX.2)")
    if not (model_dir / "vae").is_dir():
        raise PrecomputeError(f"--model {model_dir}: no vae/ folder; expected a diffusers pipeline directory")
    try:
        family = family_of_pipeline(model_dir) if (model_dir / "model_index.json").is_file() else FAMILIES["sd3"]
        family.text_encoders.check_pipeline(model_dir, "--model")
    except CheckpointFormatError as e:
        raise PrecomputeError(str(e)) from None
    return family


def default_sequence_length(model_dir: Path, family: Family) -> int:
    """The text tokens the family's pipeline uses for its transformer (FLUX.1-schnell, without a guidance
    embedding, 256, dev 512; SD3 256; Qwen-Image 512)."""
    config = model_dir / "transformer" / "config.json"
    return family.default_sequence_length(SimpleNamespace(**json.loads(config.read_text()) if config.is_file() else {}))


def vae_downsampling(model_dir: Path) -> int:
    """From vae/config.json, before any weight is loaded: image pixels per latent pixel, 8 for the released VAEs
    (`AutoencoderKL`: 2 per block but the last; the video VAEs: 2 per entry of `temperal_downsample`), 16 for
    FLUX.2's (`AutoencoderKLFlux2`: 8, then its 2 x 2 patchify)."""
    try:
        config = json.loads((model_dir / "vae" / "config.json").read_text())
        if "temperal_downsample" in config:
            return 2 ** len(config["temperal_downsample"])
        patchify = config["patch_size"][0] if config.get("_class_name") == "AutoencoderKLFlux2" else 1
        return 2 ** (len(config["block_out_channels"]) - 1) * patchify
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PrecomputeError(f"--model {model_dir}: vae/config.json is not a diffusers VAE config ({e})") from None
