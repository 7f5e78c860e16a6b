"""Samples from webdataset tar shards, as img2dataset writes them: `KEY.jpg` (or .png/.webp), `KEY.txt` (the
caption), `KEY.json` (metadata), optionally `KEY.mask.png` (a loss mask), files of one sample next to each other
in the tar. An edit pair's reference images are `KEY.reference.png` (one) or `KEY.reference_0.jpg`,
`KEY.reference_1.jpg`, ... (several, numbered from 0; any image suffix), its caption the instruction.

Read with the standard library's `tarfile` in streaming mode: one pass over a local file or over the output of
a `pipe:` command (`pipe:aws s3 cp s3://bucket/00000.tar -`, as webdataset spells object-store URLs), each
sample named by its shard and key, so a bad one can be reported and skipped. Shard lists are given as
webdataset gives them: brace ranges (`data/{00000..00999}.tar`), lists (`{a,b}`) and, for local paths, globs.
"""

import glob
import json
import re
import subprocess
import tarfile
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count, takewhile
from pathlib import Path
from typing import Iterator

from errors import InputError

IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "bmp")  # in order of preference when a sample has several
UNSUPPORTED_IMAGES = ("gif", "tif", "tiff", "avif", "heic", "heif", "jxl", "svg")
PIPE = "pipe:"
MASK_SUFFIX = "mask.png"  # `KEY.mask.png`: the sample's loss mask (white = train), read instead of an alpha channel
REFERENCE = re.compile(r"(reference(?:_\d+)?)\.([^.]+)")  # `KEY.reference.png`, `KEY.reference_0.jpg`: an edit's
REFERENCE_MISSING = "reference missing"
MISSING_NAMED = 10  # of the missing shards of a pattern, named in its error
STDERR_LINES = 5  # of a failed `pipe:` command, in its error
COMMAND_EXIT_WAIT_S = 5  # for a command whose output broke off, to tell its failure from a bad tar


class ShardError(InputError):
    """A whole input shard cannot be read (missing, truncated, or its command failed)."""


@dataclass
class Sample:
    key: str  # names it in reports: the image file, or the tar shard and the sample's key
    image: bytes | Path | None  # None when the sample has no usable image (`problem` says why)
    caption: str | None
    problem: str | None = None  # why it cannot be used, known before decoding
    mask: bytes | Path | None = None  # a mask image beside it (`NAME.mask.png`, `KEY.mask.png`): white = train
    references: tuple[bytes | Path, ...] = ()  # an edit's reference images


def expand_braces(pattern: str) -> list[str]:
    """Brace expansion as the shell and webdataset do it: `{000..003}` (zero-padded like its bounds), `{a,b}`."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    head, body, tail = pattern[: match.start()], match.group(1), pattern[match.end():]
    bounds = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if bounds:
        first, last = bounds.groups()
        width = max(len(first), len(last)) if (first[0] == "0" and len(first) > 1) or \
            (last[0] == "0" and len(last) > 1) else 0
        step = 1 if int(last) >= int(first) else -1
        choices = [str(n).zfill(width) for n in range(int(first), int(last) + step, step)]
    elif "," in body:
        choices = body.split(",")
    else:
        return [head + "{" + body + "}" + item for item in expand_braces(tail)]
    return [item for choice in choices for item in expand_braces(head + choice + tail)]


def expand_shards(patterns: list[str]) -> list[str]:
    """The input shards, in the order given: local paths (globs expanded, sorted) or `pipe:` commands. Local
    files must exist; a pattern that names nothing, or a shard named twice, is an error."""
    sources = []
    for pattern in patterns:
        expanded, missing = expand_braces(pattern), []
        for source in expanded:
            if source.startswith(PIPE):
                sources.append(source)
            elif glob.has_magic(source):
                matches = sorted(glob.glob(source))
                if not matches:
                    missing.append(f"{source} matches no file")
                sources += matches
            elif not Path(source).is_file():
                missing.append(f"{source} does not exist")
            else:
                sources.append(source)
        if missing and len(expanded) == 1:
            raise ShardError(f"--shards {pattern}: {missing[0]}")
        if missing:  # every one: a range partly downloaded is then fixed in one go
            raise ShardError(f"--shards {pattern}: {len(missing)} of {len(expanded)} shards are missing: "
                             f"{', '.join(missing[:MISSING_NAMED])}" +
                             (f" and {len(missing) - MISSING_NAMED} more" if len(missing) > MISSING_NAMED else ""))
    repeated = sorted({s for s in sources if sources.count(s) > 1})
    if repeated:
        raise ShardError(f"--shards names these shards more than once: {repeated[:5]}")
    if not sources:
        raise ShardError(f"--shards {patterns} names no shard")
    return sources


@contextmanager
def open_shard(source: str):
    """A readable byte stream of the shard. A `pipe:` command must exit 0 once read, or the shard is not trusted
    (a failed download can look like a short tar); when it fails, the error is the command's (its status and the
    end of its stderr), not the tar it did not deliver: a download refused for its credentials is not bad data."""
    if not source.startswith(PIPE):
        with open(source, "rb") as stream:
            yield stream
        return
    with tempfile.TemporaryFile() as stderr:  # a file, not a pipe: a chatty command can never block on it
        process = subprocess.Popen(source[len(PIPE):], shell=True, stdout=subprocess.PIPE, stderr=stderr)
        try:
            yield process.stdout
        except BaseException as e:
            status = None
            if isinstance(e, Exception):  # a command that failed has closed its output: it has ended or is about
                try:  # to; one that is still writing is fine, and the tar it sends is not
                    status = process.wait(timeout=COMMAND_EXIT_WAIT_S)
                except subprocess.TimeoutExpired:
                    pass
            if status:
                raise command_failed(source, status, stderr) from None
            process.kill()  # the reader stopped early or the tar is bad
            process.wait()
            raise
        finally:
            process.stdout.close()
        status = process.wait()
        if status:
            raise command_failed(source, status, stderr)


def command_failed(source: str, status: int, stderr) -> ShardError:
    stderr.seek(0)
    lines = stderr.read().decode("utf-8", "replace").strip().splitlines()[-STDERR_LINES:]
    said = "; its stderr ended with:\n    " + "\n    ".join(lines) if lines else " (nothing on stderr)"
    return ShardError(f"{source}: the command failed with exit status {status}{said}")


def split_name(name: str) -> tuple[str, str] | None:
    """webdataset's rule: the key is the path up to the first dot of the file name, the suffix the rest."""
    match = re.fullmatch(r"((?:.*/)?[^./][^/]*?)\.([^/]*)", name)
    return (match.group(1), match.group(2).lower()) if match else None


class Tail:
    """A byte stream, counting what it gives and keeping its end: to tell a whole tar from a cut one (tarfile
    takes an archive that stops between members for a finished one)."""

    KEEP = 1 << 16

    def __init__(self, stream):
        self.stream, self.total, self.tail = stream, 0, b""

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.total += len(data)
        self.tail = (self.tail + data)[-self.KEEP:]
        return data

    def ends_archive_at(self, offset: int) -> bool:
        """The stream ends in tar's end-of-archive marker (at least two zero blocks) right after `offset`."""
        while self.read(1 << 20):
            pass
        rest = self.total - offset
        return rest >= 2 * tarfile.BLOCKSIZE and not any(self.tail[-min(rest, self.KEEP):])


def read_samples(source: str, caption_field: str | None = None) -> Iterator[Sample]:
    """The shard's samples in order, their files grouped by key as webdataset groups them; a shard cut short
    (a failed download) is an error, not a shorter shard."""
    try:
        with open_shard(source) as raw:
            stream = Tail(raw)
            with tarfile.open(fileobj=stream, mode="r|*") as tar:
                key, files = None, {}
                for member in tar:
                    parts = split_name(member.name) if member.isfile() else None
                    if parts is None:
                        continue
                    if parts[0] != key and files:
                        yield make_sample(source, key, files, caption_field)
                        files = {}
                    key = parts[0]
                    files[parts[1]] = tar.extractfile(member).read()
                    if len(files[parts[1]]) != member.size:
                        raise EOFError(f"{member.name} is cut short")
                compressed = tar.fileobj.comptype != "tar"  # then the decompressor checks the stream's end
                if not compressed and not stream.ends_archive_at(tar.offset):
                    raise EOFError("the archive stops without its end marker")
                if files:
                    yield make_sample(source, key, files, caption_field)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ShardError(f"{source}: not a readable tar shard ({type(e).__name__}: {e})") from None


def make_sample(source: str, key: str, files: dict[str, bytes], caption_field: str | None) -> Sample:
    name = f"{Path(source).name if not source.startswith(PIPE) else source}:{key}"
    image = next((files[s] for s in IMAGE_SUFFIXES if s in files), None)  # whole suffixes: never `reference.png`
    caption, problem = caption_of(files, caption_field)
    references, reference_problem = references_of(files)
    if image is None:
        unsupported = [s for s in files if s in UNSUPPORTED_IMAGES]
        problem = (f"unsupported format: .{unsupported[0]} (read: {', '.join(IMAGE_SUFFIXES)})" if unsupported else
                   f"no image: only {', '.join('.' + s for s in sorted(files))}")
    return Sample(name, image, caption, problem or reference_problem, files.get(MASK_SUFFIX), references)


def references_of(files: dict[str, bytes]) -> tuple[tuple[bytes, ...], str | None]:
    """(an edit's reference images in order, None), or ((), why they cannot be used): `reference.EXT` alone, or
    `reference_0.EXT`, `reference_1.EXT`, ... without a gap (as an image folder's `cat.png` / `cat_0.png`, ...);
    of one reference in several formats, the target's preferred one."""
    formats = {}
    for suffix in files:
        match = REFERENCE.fullmatch(suffix)
        if match:
            formats.setdefault(match.group(1), []).append(match.group(2))
    numbered = list(takewhile(lambda name: name in formats, (f"reference_{i}" for i in count())))
    names = ["reference"] if "reference" in formats else numbered
    if "reference" in formats and numbered:
        return (), f"{REFERENCE_MISSING}: both .reference.* and .reference_0.* (one, or numbered ones)"
    stray = sorted(set(formats) - set(names))
    if stray:
        return (), f"{REFERENCE_MISSING}: .{stray[0]}.{formats[stray[0]][0]} without .reference_{len(numbered)}.*"
    references = []
    for name in names:
        suffix = next((s for s in IMAGE_SUFFIXES if s in formats[name]), None)
        if suffix is None:
            return (), f"unsupported format: .{name}.{formats[name][0]} (read: {', '.join(IMAGE_SUFFIXES)})"
        references.append(files[f"{name}.{suffix}"])
    return tuple(references), None


def caption_of(files: dict[str, bytes], field: str | None) -> tuple[str | None, str | None]:
    """(caption, problem): from `.txt`, or from `field` of `.json`."""
    if field is None:
        if "txt" not in files:
            return None, "no caption: no .txt"
        text = files["txt"]
    else:
        try:
            text = json.loads(files["json"])[field] if "json" in files else None
        except (ValueError, KeyError, TypeError):
            text = None
        if not isinstance(text, (str, bytes)):
            return None, f"no caption: no string field {field!r} in .json"
    try:
        caption = (text.decode("utf-8") if isinstance(text, bytes) else text).strip()
    except UnicodeDecodeError:
        return None, "no caption: .txt is not UTF-8"
    return (caption, None) if caption else (None, "no caption: empty")
