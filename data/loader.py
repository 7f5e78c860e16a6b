"""Deterministic step batches: which items form the global batch of step s depends on (seed, s) only.

The global batch of step s is the slice [s*G, (s+1)*G) of an endless stream of epochs, each epoch a
permutation of the dataset keyed by (seed, epoch). Rank r of W takes the contiguous positions
[r*G/W, (r+1)*G/W) of that batch, so the union over ranks is the same global batch for any world size, and
resuming at step s needs nothing but s. With aspect buckets (items of several latent sizes) every global
batch comes from one bucket: each epoch shuffles every bucket, cuts it into whole batches and shuffles the
batches, all keyed by (seed, epoch) as well.
"""

import logging
from functools import lru_cache

import torch

from models.rectified_flow import ORDER_STREAM, sample_key

log = logging.getLogger("mmdit")


def dataset_buckets(dataset) -> list[list[int]] | None:
    """Item indices by latent size, for datasets of several sizes; None when all items share one."""
    return dataset.buckets() if len(getattr(dataset, "latent_sizes", ())) > 1 else None


def check_batches(dataset, global_batch: int) -> None:
    """Before a run starts: with several latent sizes, some size must fill a global batch."""
    buckets = dataset_buckets(dataset)
    if buckets:
        batches_per_epoch(tuple(map(len, buckets)), global_batch)


@lru_cache
def batches_per_epoch(sizes: tuple[int, ...], global_batch: int) -> int:
    """Whole global batches per epoch when each batch comes from one bucket of the given sizes. Items of a
    bucket smaller than the global batch are never drawn: a warning (once) counts them, and an error is
    raised if no bucket fills a batch."""
    count = sum(n // global_batch for n in sizes)
    if not count:
        raise ValueError(f"no latent size has enough items for one global batch of {global_batch} "
                         f"(items per size: {sizes}); lower the batch or precompute without --aspect-buckets")
    never = [n for n in sizes if n < global_batch]
    if never:
        log.warning("%d items in %d latent sizes with fewer than %d items (one global batch) are never drawn",
                    sum(never), len(never), global_batch)
    return count


class StepBatchSampler:
    """Yields, for each step from `start_step` to `end_step`, this rank's (step, position, index) triples."""

    def __init__(self, num_items: int, global_batch: int, seed: int, rank: int, world_size: int,
                 start_step: int, end_step: int, buckets: list[list[int]] | None = None):
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by world size {world_size}")
        self.num_items, self.global_batch, self.seed, self.buckets = num_items, global_batch, seed, buckets
        self.per_epoch = batches_per_epoch(tuple(map(len, buckets)), global_batch) if buckets else None
        self.rank_batch = global_batch // world_size
        self.first_position = rank * self.rank_batch
        self.start_step, self.end_step = start_step, end_step

    @lru_cache(maxsize=2)
    def permutation(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(sample_key(self.seed, ORDER_STREAM, epoch))
        return torch.randperm(self.num_items, generator=gen)

    @lru_cache(maxsize=2)
    def bucket_batches(self, epoch: int) -> list[torch.Tensor]:
        """The epoch's global batches, each from one bucket; a bucket's remainder waits for another shuffle."""
        batches = []
        for b, items in enumerate(self.buckets):
            gen = torch.Generator().manual_seed(sample_key(self.seed, ORDER_STREAM, f"{epoch}/bucket{b}"))
            shuffled = torch.tensor(items)[torch.randperm(len(items), generator=gen)]
            whole = len(items) // self.global_batch * self.global_batch
            if whole:  # split() of an empty tensor would still give one (empty) batch
                batches += list(shuffled[:whole].split(self.global_batch))
        gen = torch.Generator().manual_seed(sample_key(self.seed, ORDER_STREAM, f"{epoch}/batches"))
        return [batches[i] for i in torch.randperm(len(batches), generator=gen)]

    def global_indices(self, step: int) -> torch.Tensor:
        if self.buckets:
            return self.bucket_batches(step // self.per_epoch)[step % self.per_epoch]
        flat = step * self.global_batch + torch.arange(self.global_batch)
        return torch.stack([self.permutation(int(f) // self.num_items)[int(f) % self.num_items] for f in flat])

    def __len__(self) -> int:
        return self.end_step - self.start_step

    def __iter__(self):
        for step in range(self.start_step, self.end_step):
            positions = range(self.first_position, self.first_position + self.rank_batch)
            indices = self.global_indices(step)
            yield [(step, p, int(indices[p])) for p in positions]


class StepDataset(torch.utils.data.Dataset):
    """Wraps a dataset so each item also carries the step and its position in the global batch."""

    def __init__(self, dataset: torch.utils.data.Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int, int]) -> dict:
        step, position, index = key
        return {**self.dataset[index], "step": step, "position": position}


class Collate:
    """Stacks tensors; tokenizes captions when a tokenizer is given; adds the empty caption's embeddings
    (`empty_<key>`, one row) when the dataset has them, for caption dropout."""

    def __init__(self, tokenizer=None, empty_prompt: dict | None = None):
        self.tokenizer = tokenizer
        self.empty_prompt = empty_prompt or {}

    def __call__(self, items: list[dict]) -> dict:
        batch = {}
        for key in items[0]:
            values = [item[key] for item in items]
            batch[key] = torch.stack(values) if isinstance(values[0], torch.Tensor) else values
        batch["step"] = batch["step"][0]
        batch["position"] = torch.tensor(batch["position"])
        if self.tokenizer is not None:
            batch["input_ids"] = self.tokenizer(batch["caption"])
        batch.update({f"empty_{k}": v for k, v in self.empty_prompt.items()})
        return batch


def step_batches(dataset, tokenizer, global_batch: int, seed: int, rank: int, world_size: int,
                 start_step: int, end_step: int, device: torch.device, num_workers: int = 0,
                 pin_memory: bool = True, prefetch_factor: int = 2) -> torch.utils.data.DataLoader:
    """One loader for the whole run (iterated once, so workers live as long as the run). Workers change
    where items are made, never which: the batches are the same for any worker count."""
    buckets = dataset_buckets(dataset)
    sampler = StepBatchSampler(len(dataset), global_batch, seed, rank, world_size, start_step, end_step, buckets)
    if num_workers < 0:
        num_workers = 4 if device.type == "cuda" else 0
    if num_workers:
        log.info("data loading: %d workers, prefetch %d, pinned memory %s", num_workers, prefetch_factor,
                 pin_memory and device.type == "cuda")
    collate = Collate(tokenizer, getattr(dataset, "empty_prompt", None))
    return torch.utils.data.DataLoader(StepDataset(dataset), batch_sampler=sampler, collate_fn=collate,
                                       num_workers=num_workers, pin_memory=pin_memory and device.type == "cuda",
                                       prefetch_factor=prefetch_factor if num_workers else None)
