"""DDP: process group from the torchrun environment, the model wrap, and `no_sync` gradient accumulation.

One process per device. Without torchrun's variables (or with WORLD_SIZE=1) everything here is a no-op:
the rank is 0 of 1, the model is not wrapped and `sync_gradients` is a `nullcontext`.
"""

import datetime
import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger("mmdit")


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def is_distributed() -> bool:
    """Whether a process group is up (there are collectives to run)."""
    return dist.is_available() and dist.is_initialized()


def world_from_env() -> World:
    """Rank, world size and local rank as torchrun sets them."""
    env = os.environ
    return World(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def init_distributed(world: World, device: torch.device, timeout_s: int) -> torch.device:
    """Join the process group (NCCL on CUDA, gloo on CPU); returns this rank's device."""
    if not world.distributed:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=world.rank, world_size=world.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    log.info("distributed: %d processes, backend %s, timeout %ds", world.world_size, backend, timeout_s)
    return device


def destroy_distributed() -> None:
    if is_distributed():
        dist.destroy_process_group()


def broadcast_from_main(value):
    """Rank 0's value of a picklable object on every rank (the value itself without a process group)."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_error(error: str | None) -> str | None:
    """Any rank's error (the first by rank) on every rank, so that all stop together."""
    if not is_distributed():
        return error
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    if not is_distributed():
        return value
    value = value.detach().clone()
    dist.all_reduce(value)  # a sum: gloo has no AVG
    return value / dist.get_world_size()


def wrap_ddp(model: nn.Module, world: World, device: torch.device, bucket_cap_mb: float) -> nn.Module:
    """DDP after compile (dynamo's DDP optimiser then splits compiled graphs at bucket boundaries).
    find_unused_parameters stays off: the MMDiT has none, and `check_all_parameters_used` says so loudly."""
    if not world.distributed:
        return model
    # No buffer broadcast: the only buffer is the constant position table, and a broadcast in every forward
    # would be a collective that a rank failing mid-step (out of memory) never reaches.
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                   bucket_cap_mb=bucket_cap_mb, find_unused_parameters=False,
                                   broadcast_buffers=False)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def sync_gradients(model: nn.Module, last_micro_step: bool):
    """Wraps forward and backward of a micro-step: only the last one of an optimizer step all-reduces.
    The forward must be inside too, or DDP prepares a reduction anyway."""
    if last_micro_step or not isinstance(model, DistributedDataParallel):
        return nullcontext()
    return model.no_sync()


def check_all_parameters_used(model: nn.Module) -> None:
    """After the first backward: a trainable parameter without a gradient would break DDP's reduction (and
    means dead weights); name them instead of letting DDP fail later with a generic message."""
    unused = [name for name, p in unwrap(model).named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        raise RuntimeError(f"parameters received no gradient in the first step: {unused}; DDP runs with "
                           f"find_unused_parameters=False, so every trainable parameter must be used")
