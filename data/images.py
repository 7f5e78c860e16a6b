"""Writing images: single PNGs and captioned sample grids."""

from pathlib import Path

import torch
from PIL import Image, ImageDraw

CELL_SCALE = 4  # grid cells are upscaled (nearest) so 32-px samples are visible


def to_pil(image: torch.Tensor, scale: int = 1) -> Image.Image:
    """[3, H, W] in [0, 1] -> RGB image, optionally upscaled by an integer factor."""
    array = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    pil = Image.fromarray(array, "RGB")
    return pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST) if scale > 1 else pil


def save_png(image: torch.Tensor, path: Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    to_pil(image).save(path)


def save_grid(images: torch.Tensor, captions: list[str], path: Path, columns: int = 4) -> None:
    """A grid of upscaled images, each with its caption underneath; captions also go to a .txt beside it."""
    cell = images.shape[-1] * CELL_SCALE
    label_height, cell_width = 24, max(cell, 180)
    rows = (len(images) + columns - 1) // columns
    grid = Image.new("RGB", (columns * cell_width, rows * (cell + label_height)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, text) in enumerate(zip(images, captions)):
        x, y = (i % columns) * cell_width, (i // columns) * (cell + label_height)
        grid.paste(to_pil(image, CELL_SCALE), (x + (cell_width - cell) // 2, y))
        draw.text((x + 4, y + cell + 4), text.removeprefix("a "), fill="black")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    Path(path).with_suffix(".txt").write_text("\n".join(captions) + "\n")
