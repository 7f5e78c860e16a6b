"""Captioned shapes: the built-in, procedural, download-free dataset, and the prompt-fidelity analysis.

32x32 RGB on black, one filled circle, square (axis-aligned) or triangle (isosceles, apex up) of half-size
4-6 px in one of six pure colours, centred near one of five anchors with +-2 px jitter, captioned
"a {color} {shape} in the {position}". Item i under seed s is always the same image and caption.

The edit set (`ShapesEditDataset`, data.name=shapes_edit) pairs such an image, the reference, with an instruction,
"make it {color}" or "move it to the {position}" (another colour or position of the captions'), and the target:
the same shape, size and jitter with that one change. Its fidelity is the same analysis of the edited image against
the target's colour, shape and position.
"""

import itertools

import torch

from models.rectified_flow import DATA_STREAM, sample_key

IMAGE_SIZE = 32
COLORS = {"red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1),
          "yellow": (1, 1, 0), "magenta": (1, 0, 1), "cyan": (0, 1, 1)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = {"top left": (8, 8), "top right": (8, 24), "bottom left": (24, 8),
             "bottom right": (24, 24), "center": (16, 16)}
VOCABULARY = sorted({w for text in [*COLORS, *SHAPES, *POSITIONS, "a in the"] for w in text.split()})
MAX_CAPTION_WORDS = 7
EDIT_VOCABULARY = sorted({w for text in [*COLORS, *POSITIONS, "make it move to the"] for w in text.split()})
MAX_INSTRUCTION_WORDS = 6  # "move it to the top left"
EDIT_STREAM = "edit"  # the edit's draws, apart from the reference's (the shapes dataset's item of the same index)


def caption(color: str, shape: str, position: str) -> str:
    return f"a {color} {shape} in the {position}"


def attributes_of(text: str) -> tuple[str, str, str]:
    """(color, shape, position) of a caption `caption` wrote."""
    words = text.split()
    return words[1], words[2], " ".join(words[5:])


def all_prompts() -> list[tuple[str, str, str]]:
    """The fixed prompt set: all 90 (color, shape, position) combinations, in a stable order."""
    return list(itertools.product(COLORS, SHAPES, POSITIONS))


def render(color: str, shape: str, center: tuple[int, int], half_size: int) -> torch.Tensor:
    """[3, 32, 32] image in [0, 1]."""
    ys, xs = torch.meshgrid(torch.arange(IMAGE_SIZE), torch.arange(IMAGE_SIZE), indexing="ij")
    dy, dx = ys - center[0], xs - center[1]
    if shape == "circle":
        mask = dy**2 + dx**2 <= half_size**2
    elif shape == "square":
        mask = (dy.abs() <= half_size) & (dx.abs() <= half_size)
    elif shape == "triangle":  # apex at the top row, base on the bottom row, width growing downwards
        mask = (dy.abs() <= half_size) & (2 * dx.abs() <= dy + half_size)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
    return mask.float()[None] * torch.tensor(COLORS[color], dtype=torch.float32)[:, None, None]


class ShapesDataset(torch.utils.data.Dataset):
    """Items carry `latents` (the image scaled to [-1, 1]; for this dataset pixel space is the latent space)
    and `caption`. Datasets of real latents provide the same `latents` key."""

    latent_channels = 3
    latent_sizes = [(IMAGE_SIZE, IMAGE_SIZE)]
    commonest_size = (IMAGE_SIZE, IMAGE_SIZE)
    references = 0  # an edit's reference images (none: text to image)
    buckets = [((IMAGE_SIZE, IMAGE_SIZE), ())]  # (target size, reference sizes): data/latents.py
    commonest_bucket = buckets[0]
    vocabulary, max_caption_words = VOCABULARY, MAX_CAPTION_WORDS  # of the text encoder trained with the model

    def __init__(self, num_items: int, seed: int):
        self.num_items = num_items
        self.seed = seed

    def __len__(self) -> int:
        return self.num_items

    def attributes(self, index: int) -> tuple[str, str, str, tuple[int, int], int]:
        gen = torch.Generator().manual_seed(sample_key(self.seed, DATA_STREAM, index))
        color = list(COLORS)[torch.randint(len(COLORS), (), generator=gen)]
        shape = SHAPES[torch.randint(len(SHAPES), (), generator=gen)]
        position = list(POSITIONS)[torch.randint(len(POSITIONS), (), generator=gen)]
        jitter = torch.randint(-2, 3, (2,), generator=gen).tolist()
        half_size = int(torch.randint(4, 7, (), generator=gen))
        anchor = POSITIONS[position]
        return color, shape, position, (anchor[0] + jitter[0], anchor[1] + jitter[1]), half_size

    @staticmethod
    def validation_captions() -> list[str]:
        """All 90 captions, in a stable order: what validation samples and scores."""
        return [caption(*p) for p in all_prompts()]

    @staticmethod
    def score_images(images: torch.Tensor, captions: list[str]) -> dict[str, float]:
        """Prompt fidelity of samples [N, 3, H, W] in [0, 1] of `captions`, per attribute (`analyze`)."""
        fidelity = prompt_fidelity(images, [attributes_of(c) for c in captions])
        return {f"fidelity/{k}": v for k, v in fidelity.items()}

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_items:
            raise IndexError(f"index {index} outside a dataset of {self.num_items} items")
        color, shape, position, center, half_size = self.attributes(index)
        image = render(color, shape, center, half_size)
        return {"latents": image * 2 - 1, "caption": caption(color, shape, position)}


# ----------------------------------------------------------------------------------------------- edits


def instruction(change: str, value: str) -> str:
    return f"make it {value}" if change == "color" else f"move it to the {value}"


def other(values: list[str], value: str, turn: int) -> str:
    """The `turn`-th (mod the others' count) of `values` other than `value`."""
    others = [v for v in values if v != value]
    return others[turn % len(others)]


def edited(color: str, position: str, change: str, value: str) -> tuple[str, str]:
    """The target's (color, position) after the instruction (change, value)."""
    return (value, position) if change == "color" else (color, value)


def render_at(color: str, shape: str, position: str, jitter: tuple[int, int], half_size: int) -> torch.Tensor:
    anchor = POSITIONS[position]
    return render(color, shape, (anchor[0] + jitter[0], anchor[1] + jitter[1]), half_size)


class ShapesEditDataset(ShapesDataset):
    """Items: `references` (the reference image in [-1, 1], one), `caption` (the instruction) and `latents` (the
    target in [-1, 1]): the shapes dataset's item of the same index, then one change of colour or position drawn
    from (seed, index) as well."""

    references = 1
    buckets = [((IMAGE_SIZE, IMAGE_SIZE), ((IMAGE_SIZE, IMAGE_SIZE),))]
    commonest_bucket = buckets[0]
    vocabulary, max_caption_words = EDIT_VOCABULARY, MAX_INSTRUCTION_WORDS

    def edit(self, index: int) -> tuple[str, str]:
        """(change, value): "color" and a colour, or "position" and a position, other than the reference's."""
        color, _, position, _, _ = self.attributes(index)
        gen = torch.Generator().manual_seed(sample_key(self.seed, DATA_STREAM, f"{EDIT_STREAM}/{index}"))
        change = ("color", "position")[int(torch.randint(2, (), generator=gen))]
        turn = int(torch.randint(len(COLORS) * len(POSITIONS), (), generator=gen))
        return change, other(list(COLORS) if change == "color" else list(POSITIONS),
                             color if change == "color" else position, turn)

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_items:
            raise IndexError(f"index {index} outside a dataset of {self.num_items} items")
        color, shape, position, center, half_size = self.attributes(index)
        anchor = POSITIONS[position]
        jitter = (center[0] - anchor[0], center[1] - anchor[1])
        new_color, new_position = edited(color, position, *self.edit(index))
        target = render_at(new_color, shape, new_position, jitter, half_size)
        return {"latents": target * 2 - 1, "references": (render(color, shape, center, half_size) * 2 - 1,),
                "caption": instruction(*self.edit(index))}

    @staticmethod
    def validation_edits() -> list[tuple[str, str, str, str, str]]:
        """90 fixed edits (color, shape, position of the reference; change, value), one per caption of the
        shapes data, colour and position changes alternating, the new value turning through the others."""
        edits = []
        for i, (color, shape, position) in enumerate(all_prompts()):
            change = ("color", "position")[i % 2]
            value = other(list(COLORS) if change == "color" else list(POSITIONS),
                          color if change == "color" else position, i // 2)
            edits.append((color, shape, position, change, value))
        return edits

    @classmethod
    def validation_captions(cls) -> list[str]:
        return [instruction(change, value) for *_, change, value in cls.validation_edits()]

    @classmethod
    def validation_references(cls) -> tuple[torch.Tensor]:
        """The 90 edits' reference images in [-1, 1] (the anchor's centre, half-size 5)."""
        return (torch.stack([render_at(color, shape, position, (0, 0), 5)
                             for color, shape, position, _, _ in cls.validation_edits()]) * 2 - 1,)

    @classmethod
    def score_images(cls, images: torch.Tensor, captions: list[str]) -> dict[str, float]:
        """Fidelity of the 90 edits' results [N, 3, H, W] in [0, 1] to their targets: colour and position after
        the change, the reference's shape (`analyze`)."""
        targets = []
        for color, shape, position, change, value in cls.validation_edits():
            new_color, new_position = edited(color, position, change, value)
            targets.append((new_color, shape, new_position))
        fidelity = prompt_fidelity(images, targets)
        return {f"fidelity/{k}": v for k, v in fidelity.items()}


# ----------------------------------------------------------------------------------------------- fidelity


def analyze(image: torch.Tensor) -> dict[str, str | None]:
    """Decide colour, shape and position of the shape in a [3, H, W] image in [0, 1] by image analysis.

    The shape is the set of pixels whose brightest channel exceeds 0.5. Colour: the palette entry nearest to
    its mean RGB. Position: the anchor nearest to its bounding-box centre. Shape: a square fills its bounding
    box; a triangle (apex up) has much more area below the box's middle row than above; else a circle.
    """
    mask = image.max(dim=0).values > 0.5
    if mask.sum() < 4:
        return {"color": None, "shape": None, "position": None}
    ys, xs = mask.nonzero(as_tuple=True)
    mean_rgb = image[:, ys, xs].mean(dim=1)
    palette = torch.tensor(list(COLORS.values()), dtype=torch.float32)
    color = list(COLORS)[int(((palette - mean_rgb) ** 2).sum(1).argmin())]

    y0, y1, x0, x1 = int(ys.min()), int(ys.max()), int(xs.min()), int(xs.max())
    cy, cx = (y0 + y1) / 2, (x0 + x1) / 2
    position = min(POSITIONS, key=lambda p: (POSITIONS[p][0] - cy) ** 2 + (POSITIONS[p][1] - cx) ** 2)

    fill = len(ys) / ((y1 - y0 + 1) * (x1 - x0 + 1))
    above, below = int((ys < cy).sum()), int((ys > cy).sum())
    if fill > 0.85:
        shape = "square"
    elif below > 1.6 * max(above, 1):
        shape = "triangle"
    else:
        shape = "circle"
    return {"color": color, "shape": shape, "position": position}


def prompt_fidelity(images: torch.Tensor, prompts: list[tuple[str, str, str]]) -> dict[str, float]:
    """Per-attribute accuracy of images [N, 3, H, W] in [0, 1] against their (color, shape, position)."""
    hits = {"color": 0, "shape": 0, "position": 0}
    for image, (color, shape, position) in zip(images, prompts):
        found = analyze(image)
        hits["color"] += found["color"] == color
        hits["shape"] += found["shape"] == shape
        hits["position"] += found["position"] == position
    return {k: v / len(prompts) for k, v in hits.items()}
