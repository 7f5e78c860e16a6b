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


def open_image(source: Path | bytes, mode: str = "RGB", what: str = "image") -> Image.Image:
    """Decoded in `mode` (RGB, RGBA, L), as displayed (phone photos are stored sideways with an EXIF rotation)."""
    try:
        with Image.open(source if isinstance(source, Path) else io.BytesIO(source)) as image:
            return ImageOps.exif_transpose(image).convert(mode)
    except Image.UnidentifiedImageError:  # its message names the stream object: not reproducible
        raise BadSample(f"corrupt {what}: not an image PIL recognises") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise BadSample(f"corrupt {what}: {e}") from None


def open_with_mask(sample: Sample) -> tuple[Image.Image, Image.Image | None]:
    """The RGB image and its loss mask (L, white = train): the mask file beside it if there is one, else the
    image's alpha channel unless that is opaque everywhere (then no mask: the sample trains everywhere)."""
    with_alpha = open_image(sample.image, "RGBA")
    if sample.mask is not None:
        mask = open_image(sample.mask, "L", "mask")
        if mask.size != with_alpha.size:
            raise BadSample(f"mask size {mask.width}x{mask.height} differs from the image's "
                            f"{with_alpha.width}x{with_alpha.height}")
    else:
        alpha = with_alpha.getchannel("A")
        mask = alpha if alpha.getextrema()[0] < 255 else None
    return with_alpha.convert("RGB"), mask


def resize_crop(image: Image.Image, size: tuple[int, int]) -> torch.Tensor:
    """[bands, H, W] uint8 (3 for RGB, 1 for a mask): resized to cover (height, width), then centre-cropped."""
    height, width = size
    scale = max(width / image.width, height / image.height)
    resized = image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale))),
                           Image.BICUBIC)
    left, top = (resized.width - width) // 2, (resized.height - height) // 2
    pixels = torch.frombuffer(bytearray(resized.crop((left, top, left + width, top + height)).tobytes()),
                              dtype=torch.uint8)
    return pixels.view(height, width, len(image.getbands())).permute(2, 0, 1)


def latent_weights(masks: torch.Tensor, latent_size: tuple[int, int]) -> torch.Tensor:
    """[B, 1, H, W] uint8 masks -> [B, 1, h, w] loss weights in [0, 1]: each latent element weighs the mean of
    the pixels it encodes (the VAE's downsampling square), so a half-covered element counts half."""
    return torch.nn.functional.adaptive_avg_pool2d(masks.float() / 255, latent_size)


def to_unit_range(pixels: torch.Tensor) -> torch.Tensor:
    return pixels.float() / 127.5 - 1


def pixels_of(image: Image.Image) -> torch.Tensor:
    """[3, H, W] uint8 of an RGB image."""
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(image.height, image.width, 3) \
        .permute(2, 0, 1)


def prepare(sample: Sample, buckets: list[tuple[int, int]], reference=None) -> tuple:
    """(sample, target size, pixels, mask pixels (None without a mask), references), cropped alike, or the sample
    with the `problem` that makes it unusable (runs in the decoding threads). A mask that is black wherever the
    crop keeps would train nothing: the sample is bad ("empty mask"). An edit's references are each
    `reference(image)`: (its pixels as the family's edit pipeline sizes them, what its text encoder sees of it)."""
    def bad(problem: str) -> tuple:
        return dataclasses.replace(sample, problem=problem), None, None, None, ()
    if sample.problem:
        return sample, None, None, None, ()
    try:
        image, mask = open_with_mask(sample)
        references = tuple(reference(open_image(r, what="reference")) for r in sample.references)
    except BadSample as e:
        return bad(str(e))
    size = target_size(image.size, buckets)
    mask = resize_crop(mask, size) if mask is not None else None
    if mask is not None and not mask.any():
        return bad("empty mask: black everywhere in the crop")
    return sample, size, resize_crop(image, size), mask, references


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
