"""What a caption becomes before it is encoded: a trigger word or prefix, its comma-separated tags shuffled (the
first k kept in place) and some dropped, as kohya's sd-scripts do it (`caption_prefix`, `shuffle_caption`,
`keep_tokens`, `caption_tag_dropout_rate`).

Where the text is encoded in the step (data.text_encoding=on_the_fly, and the shapes data's own encoder) each sample
of each step gets its own draw, from a generator keyed by (seed, step, position in the global batch): a resume and
any world size draw the same. Precomputed embeddings were encoded once: precompute stores K variants per caption
(--caption-variants K, each a draw keyed by the caption and its number) and training takes variant
(key of (seed, step, position)) mod K. The default (no prefix, no shuffling, no dropout) leaves captions as
written, one encoding each.
"""

from dataclasses import asdict, dataclass

import torch

from models.rectified_flow import CAPTION_STREAM, sample_key

SEPARATOR = ","


@dataclass(frozen=True)
class CaptionStyle:
    prefix: str = ""  # put before every caption (with a space): a trigger word
    shuffle_tags: bool = False  # the tags after the first keep_tags in a random order
    keep_tags: int = 0  # the first tags that stay first and are never dropped
    tag_dropout: float = 0.0  # each other tag left out with this probability

    @property
    def random(self) -> bool:
        return self.shuffle_tags or self.tag_dropout > 0

    def apply(self, caption: str, generator: torch.Generator) -> str:
        """The caption as encoded; its tags are split and joined again only when they are shuffled or dropped."""
        if self.random:
            tags = [tag.strip() for tag in caption.split(SEPARATOR) if tag.strip()]
            kept, rest = tags[:self.keep_tags], tags[self.keep_tags:]
            if self.tag_dropout > 0:
                rest = [tag for tag, u in zip(rest, torch.rand(len(rest), generator=generator).tolist())
                        if u >= self.tag_dropout]
            if self.shuffle_tags:
                rest = [rest[i] for i in torch.randperm(len(rest), generator=generator).tolist()]
            caption = f"{SEPARATOR} ".join(kept + rest)
        return f"{self.prefix} {caption}".strip() if self.prefix else caption

    def variants(self, caption: str, count: int) -> list[str]:
        """Precompute's `count` encodings of a caption, each a draw keyed by the caption and its number."""
        return [self.apply(caption, torch.Generator().manual_seed(sample_key(0, CAPTION_STREAM, f"{j}/{caption}")))
                for j in range(count)]

    def record(self, variants: int) -> dict:
        """What dataset.json records of a precompute's captions."""
        return {**asdict(self), "variants": variants}


def caption_style(data) -> CaptionStyle:
    """The data section's caption settings."""
    return CaptionStyle(data.caption_prefix, data.shuffle_caption_tags, data.keep_tags, data.tag_dropout)


def recorded_style(index: dict) -> tuple[CaptionStyle, int]:
    """The caption settings and variant count of a precompute (its dataset.json, or its settings); datasets from
    before them: none, and one encoding per caption."""
    record = dict(index.get("captions") or {"variants": 1})
    return CaptionStyle(**{k: v for k, v in record.items() if k != "variants"}), record["variants"]


def caption_key(seed: int, step: int, position: int) -> int:
    """The draw of a sample's caption at a step: its generator's seed, and (mod K) its precomputed variant."""
    return sample_key(seed, step, f"caption/{position}")
