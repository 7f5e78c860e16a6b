"""Several latent datasets in one run, drawn by weight (`data.datasets`).

Which dataset each unit of the run's stream comes from is fixed by the weights alone, with no random draw:
the stream is dealt like a stratified sample, so every prefix of it holds each dataset's share to within a
fraction of a unit. A unit is one sample of a global batch (sample k of the run is position k % G of step
k // G), or, with aspect buckets over datasets of several latent sizes, a whole global batch (each batch then
comes from one dataset and one latent size). Within a dataset the items come in epochs, each a permutation
keyed by (seed, dataset, epoch) as for a single dataset (data/loader.py). So the batch of step s is a function
of (seed, s, global batch) only, whatever the world size, and a resume at step s needs nothing but s.

The deal, level by level: dataset 0 takes round(n * r_0) of the first n units (r_0 its share), dataset 1
round(n_1 * r_1) of the n_1 units dataset 0 left (r_1 its share of what remains), and so on; the last takes the
rest. Every count is exact integer arithmetic on the weights as written (0.3 is 3/10), rises by 0 or 1 per unit,
and stays within (D - 1) / 2 units of n * share for every n (D datasets): the realised share over a run of n
units is its weight to within (D - 1) / (2 n).
"""

from fractions import Fraction
from functools import cached_property

import numpy as np
import torch

from errors import InputError


class Mixture:
    """Which dataset each unit comes from, for positive `weights`."""

    def __init__(self, weights: list[float]):
        exact = [Fraction(repr(float(w))) for w in weights]  # the decimal as written, not its binary rounding
        self.shares = [w / sum(exact) for w in exact]
        remaining, self.ratios = sum(exact), []
        for w in exact:
            ratio = w / remaining
            self.ratios.append((ratio.numerator, ratio.denominator))
            remaining -= w

    def counts(self, n: int) -> list[int]:
        """Units of each dataset among the first `n`."""
        out = []
        for p, q in self.ratios:
            taken = (2 * n * p + q) // (2 * q)  # round(n * p / q), halves up
            out.append(taken)
            n -= taken
        return out

    def deal(self, start: int, stop: int) -> list[tuple[int, int]]:
        """For units start..stop-1: (dataset, how many units of that dataset came before it)."""
        before, out = self.counts(start), []
        for k in range(start, stop):
            after = self.counts(k + 1)
            source = next(d for d, (a, b) in enumerate(zip(before, after)) if b > a)
            out.append((source, before[source]))
            before = after
        return out


class MixedDataset(torch.utils.data.Dataset):
    """Latent datasets as one: item i of dataset d is index offsets[d] + i, and carries its `source` d (the loader
    picks its caption dropout and loss weight by it). Where some dataset uses masks, the items of the others
    get all-ones masks (which train exactly as no mask)."""

    def __init__(self, datasets: list, names: list[str], weights: list[float]):
        first = datasets[0]
        for name, d in zip(names[1:], datasets[1:]):
            ours = (d.latent_channels, d.text_shapes, d.text_encoded, d.references)
            theirs = (first.latent_channels, first.text_shapes, first.text_encoded, first.references)
            if ours != theirs:
                raise InputError(f"data.datasets: {name} has (latent channels, text fields, text embeddings, "
                                 f"references) {ours}, {names[0]} {theirs}: precompute them with the same pipeline, "
                                 f"--text-embeddings and number of references")
        self.datasets, self.names, self.weights = datasets, names, weights
        self.offsets = np.cumsum([0, *(len(d) for d in datasets)])
        self.latent_sizes = sorted({size for d in datasets for size in d.latent_sizes})
        self.buckets, self.references = sorted({b for d in datasets for b in d.buckets}), first.references
        self.latent_channels, self.text_dims, self.text_tokens = first.latent_channels, first.text_dims, first.text_tokens
        self.text_mask, self.text_shapes = first.text_mask, first.text_shapes
        self.text_encoded, self.empty_prompt, self.negative_prompt = first.text_encoded, first.empty_prompt, \
            first.negative_prompt
        self.index, self.directory = first.index, first.directory  # the pipeline and VAE (validation, tokenizers)
        self.commonest_size, self.commonest_bucket = first.commonest_size, first.commonest_bucket
        self.masks = any(d.masks for d in datasets)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def sources(self, indices) -> np.ndarray:
        return np.searchsorted(self.offsets, np.asarray(indices), side="right") - 1

    def __getitem__(self, index: int) -> dict:
        return self.item(index)

    def item(self, index: int, caption_key: int = 0) -> dict:
        """Item `index`, with its dataset's caption variant of `caption_key` (LatentDataset.item)."""
        source = int(self.sources(index))
        item = dict(self.datasets[source].item(index - int(self.offsets[source]), caption_key))
        if self.masks and "loss_mask" not in item:
            item["loss_mask"] = torch.ones_like(item["latents"][:1])
        return {**item, "source": source}

    def parts(self, items) -> list[np.ndarray]:
        """The given items of each dataset."""
        items = np.asarray(items)
        sources = self.sources(items)
        return [items[sources == d] for d in range(len(self.datasets))]

    def items_by_bucket(self, items: np.ndarray) -> dict:
        """The given items grouped by bucket (each group in the order given)."""
        buckets = np.empty(len(items), dtype=np.int64)
        sources = self.sources(items)
        for d, dataset in enumerate(self.datasets):
            mine = sources == d
            local = [self.buckets.index(b) for b in dataset.buckets]
            buckets[mine] = np.asarray(local)[dataset.bucket_of[items[mine] - self.offsets[d]]]
        return {bucket: items[buckets == b] for b, bucket in enumerate(self.buckets)}

    @cached_property
    def validation_set(self) -> tuple[dict | None, list[str] | None]:
        """Every dataset's validation prompts, in dataset order."""
        sets = [d.validation_set for d in self.datasets if d.validation_set[1]]
        if not sets:
            return None, None
        captions = [c for _, cs in sets for c in cs]
        if any(prompts is None for prompts, _ in sets):
            return None, captions
        return {k: torch.cat([prompts[k] for prompts, _ in sets]) for k in sets[0][0]}, captions

    @property
    def validation_prompts(self) -> dict | None:
        return self.validation_set[0]

    @property
    def validation_captions(self) -> list[str] | None:
        return self.validation_set[1]
