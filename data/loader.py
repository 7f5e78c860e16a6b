"""Deterministic step batches: which items form the global batch of step s depends on (seed, s) only.

The global batch of step s is the slice [s*G, (s+1)*G) of an endless stream of epochs, each epoch a
permutation of the dataset keyed by (seed, epoch). Rank r of W takes the contiguous positions
[r*G/W, (r+1)*G/W) of that batch, so the union over ranks is the same global batch for any world size, and
resuming at step s needs nothing but s.
"""

import logging
from functools import lru_cache

import torch

from models.rectified_flow import ORDER_STREAM, sample_key

log = logging.getLogger("mmdit")


class StepBatchSampler:
    """Yields, for each step from `start_step` to `end_step`, this rank's (step, position, index) triples."""

    def __init__(self, num_items: int, global_batch: int, seed: int, rank: int, world_size: int,
                 start_step: int, end_step: int):
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by world size {world_size}")
        self.num_items, self.global_batch, self.seed = num_items, global_batch, seed
        self.rank_batch = global_batch // world_size
        self.first_position = rank * self.rank_batch
        self.start_step, self.end_step = start_step, end_step

    @lru_cache(maxsize=2)
    def permutation(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(sample_key(self.seed, ORDER_STREAM, epoch))
        return torch.randperm(self.num_items, generator=gen)

    def global_indices(self, step: int) -> torch.Tensor:
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
    """Stacks tensors; tokenizes captions when a tokenizer is given."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def __call__(self, items: list[dict]) -> dict:
        batch = {}
        for key in items[0]:
            values = [item[key] for item in items]
            batch[key] = torch.stack(values) if isinstance(values[0], torch.Tensor) else values
        batch["step"] = batch["step"][0]
        batch["position"] = torch.tensor(batch["position"])
        if self.tokenizer is not None:
            batch["input_ids"] = self.tokenizer(batch["caption"])
        return batch


def step_batches(dataset, tokenizer, global_batch: int, seed: int, rank: int, world_size: int,
                 start_step: int, end_step: int, device: torch.device, num_workers: int = 0,
                 pin_memory: bool = True, prefetch_factor: int = 2) -> torch.utils.data.DataLoader:
    """One loader for the whole run (iterated once, so workers live as long as the run). Workers change
    where items are made, never which: the batches are the same for any worker count."""
    sampler = StepBatchSampler(len(dataset), global_batch, seed, rank, world_size, start_step, end_step)
    if num_workers < 0:
        num_workers = 4 if device.type == "cuda" else 0
    if num_workers:
        log.info("data loading: %d workers, prefetch %d, pinned memory %s", num_workers, prefetch_factor,
                 pin_memory and device.type == "cuda")
    return torch.utils.data.DataLoader(StepDataset(dataset), batch_sampler=sampler, collate_fn=Collate(tokenizer),
                                       num_workers=num_workers, pin_memory=pin_memory and device.type == "cuda",
                                       prefetch_factor=prefetch_factor if num_workers else None)
