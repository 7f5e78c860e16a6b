"""Writing images: single PNGs and captioned sample grids."""

import textwrap
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

CELL = 256  # grid cells are about this wide: small samples are upscaled (nearest), large ones shrunk
# PIL's bitmap font: every character, a space too, 6 px wide, so a caption wraps by its length. PIL's default
# since Pillow 10.1 is a scalable font whose space is 2 px wide at its 10 px size: the words ran together.
FONT = ImageFont.load_default_imagefont()
CHAR_WIDTH, LINE_HEIGHT = 6, 12


def to_unit(x: torch.Tensor) -> torch.Tensor:
    """Model or VAE output in [-1, 1] -> image values in [0, 1]."""
    return (x.clamp(-1, 1) + 1) / 2


def to_pil(image: torch.Tensor, width: int | None = None) -> Image.Image:
    """[3, H, W] in [0, 1] -> RGB image, optionally resized to `width` (nearest when enlarging pixel art)."""
    array = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    pil = Image.fromarray(array, "RGB")
    if width is None or width == pil.width:
        return pil
    height = round(pil.height * width / pil.width)
    return pil.resize((width, height), Image.NEAREST if width > pil.width else Image.BICUBIC)


def save_png(image: torch.Tensor, path: Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    to_pil(image).save(path)


def save_grid(images: torch.Tensor, captions: list[str], path: Path, columns: int = 4) -> None:
    """A grid of images, each with its (wrapped) caption underneath; captions also go to a .txt beside it. Fewer
    images than `columns` make one row of just them."""
    columns = max(1, min(columns, len(images)))
    height, width = images.shape[-2:]
    cell = width * max(1, CELL // width) if width < CELL else CELL  # integer upscaling keeps pixels square
    cell_height = round(height * cell / width)
    lines = caption_lines(captions, cell)
    label_height = 4 + LINE_HEIGHT * max(len(x) for x in lines)
    rows = (len(images) + columns - 1) // columns
    grid = Image.new("RGB", (columns * (cell + 8), rows * (cell_height + label_height)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, label) in enumerate(zip(images, lines)):
        x, y = (i % columns) * (cell + 8), (i // columns) * (cell_height + label_height)
        grid.paste(to_pil(image, cell), (x + 4, y))
        draw.multiline_text((x + 4, y + cell_height + 2), "\n".join(label), fill="black", font=FONT, spacing=0)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    Path(path).with_suffix(".txt").write_text("\n".join(captions) + "\n")


def caption_lines(captions: list[str], cell: int) -> list[list[str]]:
    """Each caption wrapped to a cell's width, whole (up to four lines)."""
    return [textwrap.wrap(text, max(1, cell // CHAR_WIDTH))[:4] or [""] for text in captions]
