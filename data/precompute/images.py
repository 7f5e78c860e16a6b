"""Image preparation: aspect buckets, EXIF orientation, resize to cover and centre-crop."""

import dataclasses
import io
import logging
import math
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import torch
from PIL import Image, ImageOps

from data.precompute.inputs import BadSample
from data.webdataset import Sample

log = logging.getLogger("mmdit")


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
