"""Deterministic step batches: which items form the global batch of step s depends on (seed, s) only.

The global batch of step s is the slice [s*G, (s+1)*G) of an endless stream of epochs, each epoch a
permutation of the training items keyed by (seed, epoch). Rank r of W takes the contiguous positions
[r*G/W, (r+1)*G/W) of that batch, so the union over ranks is the same global batch for any world size, and
resuming at step s needs nothing but s. With aspect buckets (items of several latent sizes) every global
batch comes from one bucket: each epoch shuffles every bucket, cuts it into whole batches and shuffles the
batches, all keyed by (seed, epoch) as well.

The training items are the dataset less a held-out set (`split_holdout`), itself a permutation keyed by the
seed. Datasets that store mirrored latents (`latents_flipped`) give one of the two per (seed, epoch, item), and
the item's loss mask with it; datasets that store K encodings per caption give the one of (seed, step, position)
(data/captions.py). Several datasets (`data.datasets`, data/mixture.py) each keep their own epochs;
which dataset each position of the stream takes is dealt by their weights, a function of the position alone.
"""

import logging
from functools import lru_cache

import numpy as np
import torch

from data.captions import CaptionStyle, caption_key
from data.latents import TEXT_FIELDS, Bucket, bucket_name
from data.mixture import Mixture
from errors import ConfigError
from models.rectified_flow import FLIP_STREAM, HOLDOUT_STREAM, ORDER_STREAM, draw_sample_noise, sample_key

log = logging.getLogger("mmdit")


def split_holdout(num_items: int, holdout: int, seed: int, dataset: int = 0) -> tuple[np.ndarray, list[int]]:
    """(training items, held-out items): the held-out ones are the first `holdout` of a permutation keyed by
    the seed (and the dataset's number in a mixture), so they are the same for every run of that seed and never
    trained on. The training items are an array (8 bytes an item, where a Python list would take 36)."""
    if holdout >= num_items:
        raise ConfigError(f"data.holdout={holdout} leaves nothing to train on: the dataset has {num_items} items")
    if not holdout:
        return np.arange(num_items), []
    key = sample_key(seed, HOLDOUT_STREAM, dataset)
    order = torch.randperm(num_items, generator=torch.Generator().manual_seed(key))
    held = sorted(order[:holdout].tolist())
    kept = np.ones(num_items, dtype=bool)
    kept[held] = False
    return np.flatnonzero(kept), held


def training_buckets(dataset, items) -> dict[Bucket, np.ndarray] | None:
    """The training items by bucket (latent size, and reference sizes: data/latents.py), for datasets of several;
    None when all items share one."""
    if len(getattr(dataset, "buckets", ())) <= 1:
        return None
    return dataset.items_by_bucket(np.asarray(items))


def training_order(dataset, items) -> dict:
    """StepBatchSampler's `items` and `buckets` for the training items of a dataset, and for a mixture of
    datasets (data/mixture.py) its lists of them, and the `weights`. A mixture over several buckets is bucketed
    in every dataset (each global batch is one dataset's and one bucket's)."""
    if not hasattr(dataset, "parts"):
        return {"items": items, "buckets": training_buckets(dataset, items)}
    parts, bucketed = dataset.parts(items), len(dataset.buckets) > 1
    buckets = [{bucket: b for bucket, b in dataset.items_by_bucket(part).items() if len(b)} if bucketed else None
               for part in parts]
    return {"items": parts, "buckets": buckets, "weights": dataset.weights}


def check_batches(dataset, items, global_batch: int) -> None:
    """Before a run starts: with several buckets, some bucket must fill a global batch (in every dataset); with
    one, a global batch larger than the training items is said, since every step then repeats items."""
    order = training_order(dataset, items)
    bucketings = order["buckets"] if "weights" in order else [order["buckets"]]
    for buckets in bucketings:
        if buckets:
            batches_per_epoch(tuple((bucket, len(b)) for bucket, b in buckets.items()), global_batch)
    if not any(bucketings) and len(items) < global_batch:
        log.warning("the global batch (%d) is larger than the %d training items: every step holds some of them more "
                    "than once (lower training.train_batch_size, training.gradient_accumulation_steps or the "
                    "process count to see each item once per step)", global_batch, len(items))


@lru_cache
def batches_per_epoch(bucket_sizes: tuple[tuple[Bucket, int], ...], global_batch: int) -> int:
    """Whole global batches per epoch when each batch comes from one bucket; `bucket_sizes` holds (bucket, items)
    pairs. Items of a bucket smaller than the global batch are never drawn: a warning (once) names those sizes,
    and an error is raised if no bucket fills a batch."""
    count = sum(n // global_batch for _, n in bucket_sizes)
    sizes = ", ".join(f"{bucket_name(bucket)}: {n}" for bucket, n in bucket_sizes)
    if not count:
        raise ConfigError(f"no latent size has enough items for one global batch of {global_batch} (items per "
                         f"latent size: {sizes}); lower training.train_batch_size or "
                         f"training.gradient_accumulation_steps, or precompute without --aspect-buckets")
    never = [f"{bucket_name(bucket)} ({n} items)" for bucket, n in bucket_sizes if n < global_batch]
    if never:
        log.warning("latent sizes with fewer items than one global batch (%d) are never drawn: %s",
                    global_batch, ", ".join(never))
    return count


class ItemOrder:
    """One dataset's training items in an endless stream of epochs, each a permutation keyed by (seed, epoch)
    (and the dataset's `key`, empty for the first); with `buckets`, a stream of whole global batches, each from
    one bucket."""

    def __init__(self, items, global_batch: int, seed: int, key: str, buckets: dict | None):
        self.items, self.global_batch, self.seed, self.key = torch.as_tensor(np.asarray(items)), global_batch, seed, key
        self.buckets = list(buckets.values()) if buckets else None
        self.per_epoch = (batches_per_epoch(tuple((s, len(b)) for s, b in buckets.items()), global_batch)
                          if buckets else None)
        # each dataset's last two epochs (a step can straddle two), cached per dataset: a mixture alternates
        self.permutation, self.bucket_batches = lru_cache(2)(self.permutation), lru_cache(2)(self.bucket_batches)

    def generator(self, name) -> torch.Generator:
        return torch.Generator().manual_seed(sample_key(self.seed, ORDER_STREAM, f"{self.key}{name}"))

    def permutation(self, epoch: int) -> torch.Tensor:
        return self.items[torch.randperm(len(self.items), generator=self.generator(epoch))]

    def bucket_batches(self, epoch: int) -> list[torch.Tensor]:
        """The epoch's global batches, each from one bucket; a bucket's remainder waits for another shuffle."""
        batches = []
        for b, items in enumerate(self.buckets):
            order = torch.randperm(len(items), generator=self.generator(f"{epoch}/bucket{b}"))
            shuffled = torch.as_tensor(np.asarray(items))[order]
            whole = len(items) // self.global_batch * self.global_batch
            if whole:  # split() of an empty tensor would still give one (empty) batch
                batches += list(shuffled[:whole].split(self.global_batch))
        return [batches[i] for i in torch.randperm(len(batches), generator=self.generator(f"{epoch}/batches"))]

    def item(self, j: int) -> tuple[int, int]:
        """The stream's j-th item, and its epoch."""
        epoch = j // len(self.items)
        return int(self.permutation(epoch)[j % len(self.items)]), epoch

    def batch(self, j: int) -> tuple[torch.Tensor, int]:
        """The stream's j-th global batch (with buckets), and its epoch."""
        return self.bucket_batches(j // self.per_epoch)[j % self.per_epoch], j // self.per_epoch


class StepBatchSampler:
    """Yields, for each step from `start_step` to `end_step`, this rank's (step, position, index, epoch).

    One dataset: `items` and `buckets` (or None). Several (data/mixture.py): a list of item arrays, a list of
    bucket dicts (or None) and the datasets' `weights`; with buckets each global batch comes from one dataset."""

    def __init__(self, items, global_batch: int, seed: int, rank: int, world_size: int,
                 start_step: int, end_step: int, buckets=None, weights: list[float] | None = None):
        if global_batch % world_size:
            raise ConfigError(f"global batch {global_batch} is not divisible by world size {world_size}")
        parts, part_buckets = (items, buckets) if weights else ([items], [buckets])
        self.global_batch, self.mixture = global_batch, Mixture(weights or [1.0])
        self.bucketed = bool(part_buckets[0])
        self.orders = [ItemOrder(part, global_batch, seed, f"dataset{d}/" if d else "", b)
                       for d, (part, b) in enumerate(zip(parts, part_buckets))]
        self.rank_batch = global_batch // world_size
        self.first_position = rank * self.rank_batch
        self.start_step, self.end_step = start_step, end_step

    def global_batch_of(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The dataset indices of step `step`'s global batch, and the epoch each one is drawn in."""
        if self.bucketed:
            [(source, j)] = self.mixture.deal(step, step + 1)
            indices, epoch = self.orders[source].batch(j)
            return indices, torch.full_like(indices, epoch)
        drawn = [self.orders[source].item(j) for source, j in
                 self.mixture.deal(step * self.global_batch, (step + 1) * self.global_batch)]
        return torch.tensor([i for i, _ in drawn]), torch.tensor([e for _, e in drawn])

    def __len__(self) -> int:
        return self.end_step - self.start_step

    def __iter__(self):
        for step in range(self.start_step, self.end_step):
            positions = range(self.first_position, self.first_position + self.rank_batch)
            indices, epochs = self.global_batch_of(step)
            yield [(step, p, int(indices[p]), int(epochs[p])) for p in positions]


class StepDataset(torch.utils.data.Dataset):
    """Wraps a dataset so each item also carries the step and its position in the global batch, and picks
    plain or mirrored latents (where stored) by (seed, epoch, item) and a caption's encoding (where a latent dataset
    stores several) by (seed, step, position)."""

    def __init__(self, dataset: torch.utils.data.Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int, int, int]) -> dict:
        step, position, index, epoch = key
        item = dict(self.dataset.item(index, caption_key(self.seed, step, position)) if hasattr(self.dataset, "item")
                    else self.dataset[index])
        flipped = item.pop("latents_flipped", None)
        if flipped is not None and sample_key(self.seed, FLIP_STREAM, f"{epoch}/{index}") % 2:
            item["latents"] = flipped
            if "loss_mask" in item:  # the mask of the mirrored image is the mask mirrored
                item["loss_mask"] = item["loss_mask"].flip(-1)
        return {**item, "step": step, "position": position}


class Collate:
    """Stacks a rank's items into its share of a step's batch, with all that is random about them: noise, noise
    level and caption dropout, drawn per sample from (seed, step, position in the global batch) as
    models/rectified_flow.py keys them. This runs in the loader (in its workers, when there are any), so the
    training step only copies the batch to the device.

    `sigmas(draws, latent size)` maps the draws to noise levels (the size sets FLUX's resolution shift).
    A dropped caption becomes the empty caption: the tokens of "" for a text encoder in the model, the encoding
    of "" for precomputed embeddings (zeros when the dataset has none). Captions a text encoder in the model encodes
    take `captions` (prefix, tag shuffling and dropout) with the sample's draw of (seed, step, position).

    Items of a mixture carry their dataset (`source`), which picks their caption dropout and loss weight from
    the per-dataset lists; `loss_weight` (1 for a single dataset) and `loss_mask` (where items have one) go
    into the batch."""

    def __init__(self, seed: int, sigmas, caption_dropout: float | list[float], tokenizer=None,
                 empty_prompt: dict | None = None, loss_weights: list[float] = (1.0,),
                 captions: CaptionStyle = CaptionStyle()):
        self.seed, self.sigmas, self.captions = seed, sigmas, captions
        self.caption_dropout = torch.tensor(caption_dropout, dtype=torch.float32).reshape(-1)
        self.loss_weights = torch.tensor(loss_weights, dtype=torch.float32)
        self.tokenizer, self.empty_prompt = tokenizer, empty_prompt

    def __call__(self, items: list[dict]) -> dict:
        step, positions = items[0]["step"], torch.tensor([item["position"] for item in items])
        sources = torch.tensor([item.get("source", 0) for item in items])
        latents = torch.stack([item["latents"] for item in items])
        draws = draw_sample_noise(self.seed, step, positions, tuple(latents.shape[1:]))
        dropped = draws.dropout_uniform < self.caption_dropout[sources]
        batch = {"step": step, "first_position": int(positions[0]), "latents": latents, "noise": draws.noise,
                 "sigma": self.sigmas(draws, tuple(latents.shape[-2:])), "text": self.text(items, dropped, step),
                 "source": sources,
                 "loss_weight": self.loss_weights[sources]}
        if "loss_mask" in items[0]:
            batch["loss_mask"] = torch.stack([item["loss_mask"] for item in items])
        if "references" in items[0]:  # an edit's reference latents, never noised; kept when the caption drops
            batch["references"] = tuple(torch.stack(rows) for rows in zip(*(item["references"] for item in items)))
        return batch

    def text(self, items: list[dict], dropped: torch.Tensor, step: int) -> dict:
        if self.tokenizer is not None:  # token ids, for a text encoder in the model
            draw = lambda p: torch.Generator().manual_seed(caption_key(self.seed, step, p))  # noqa: E731
            return self.tokenizer(["" if drop else self.captions.apply(item["caption"], draw(item["position"]))
                                   for item, drop in zip(items, dropped.tolist())])
        text = {}
        for key in (k for k in TEXT_FIELDS if k in items[0]):
            values = torch.stack([item[key] for item in items])
            empty = self.empty_prompt[key] if self.empty_prompt else torch.zeros_like(values[:1])
            text[key] = torch.where(dropped.view(-1, *[1] * (values.dim() - 1)), empty.to(values.dtype), values)
        return text


def micro_batches(batch: dict, size: int):
    """The batch in consecutive slices of `size` samples (tensors and lists alike)."""
    count = len(batch["latents"])
    for start in range(0, count, size):
        yield take(batch, slice(start, start + size))


def take(tree, part: slice):
    """Of a batch: the samples `part` of its tensors and lists (a tuple holds tensors of its own: references)."""
    if isinstance(tree, dict):
        return {key: take(value, part) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(take(value, part) for value in tree)
    return tree[part] if isinstance(tree, (torch.Tensor, list)) else tree


def to_device(tree, device: torch.device):
    """Every tensor of a batch on the device, copied without blocking the host (batches are pinned on CUDA)."""
    if isinstance(tree, dict):
        return {key: to_device(value, device) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(to_device(value, device) for value in tree)
    return tree.to(device, non_blocking=True) if isinstance(tree, torch.Tensor) else tree


def step_batches(dataset, collate: Collate, items, global_batch: int, seed: int, rank: int,
                 world_size: int, start_step: int, end_step: int, device: torch.device, num_workers: int = 0,
                 pin_memory: bool = True, prefetch_factor: int = 2) -> torch.utils.data.DataLoader:
    """One loader for the whole run (iterated once, so workers live as long as the run). Workers change
    where items are made, never which: the batches are the same for any worker count."""
    sampler = StepBatchSampler(global_batch=global_batch, seed=seed, rank=rank, world_size=world_size,
                               start_step=start_step, end_step=end_step, **training_order(dataset, items))
    if num_workers < 0:
        num_workers = 4 if device.type == "cuda" else 0
    if num_workers:
        log.info("data loading: %d workers, prefetch %d, pinned memory %s", num_workers, prefetch_factor,
                 pin_memory and device.type == "cuda")
    return torch.utils.data.DataLoader(StepDataset(dataset, seed), batch_sampler=sampler, collate_fn=collate,
                                       num_workers=num_workers, pin_memory=pin_memory and device.type == "cuda",
                                       prefetch_factor=prefetch_factor if num_workers else None)
