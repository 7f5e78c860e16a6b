"""The process group from the torchrun environment, and the few collectives the loop itself needs (the
strategies that use it are in perf/parallel.py).

One process per device. Without torchrun's variables (or with WORLD_SIZE=1) everything here is a no-op:
the rank is 0 of 1 and every collective returns its input.
"""

import datetime
import gc
import logging
import os
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported before any group exists: see destroy_distributed

from errors import InputError

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


def init_distributed(world: World, device: torch.device, timeout_s: int, group_of_one: bool = False) -> torch.device:
    """Join the process group (NCCL for CUDA tensors and gloo for host tensors on a GPU machine, gloo on the
    CPU); returns this rank's device. One process joins no group, unless `group_of_one` asks for it (FSDP's
    offload to host memory works through a process group, of one rank then)."""
    if not world.distributed and not group_of_one:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    store = None if world.distributed else dist.HashStore()  # a group of one needs no rendezvous
    dist.init_process_group(backend, rank=world.rank, world_size=world.world_size, store=store,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    log.info("distributed: %d processes, backend %s, timeout %ds", world.world_size, backend, timeout_s)
    return device


def host_group(timeout_s: int):
    """A gloo group of all ranks beside the training one (host tensors; its collectives never interleave with
    the training group's), failing after `timeout_s` like the training group rather than torch's default."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def destroy_distributed() -> None:
    """Leave the process groups and free them now. A group that outlives destroy_process_group (held by a
    reference cycle, as DDP's is, or by the default arguments of torch.distributed.nn's functions when that
    module is first imported after the group exists) is freed while the interpreter shuts down, where gloo
    now and then aborts the process: exit -6 and "terminate called without an active exception" after a run
    that succeeded (a few runs in 40 on CPU)."""
    if is_distributed():
        dist.destroy_process_group()
        gc.collect()


class RankFailed(RuntimeError):
    """Another rank failed inside a `stop_together` block with an error that is not the user's input; the
    message carries that rank's traceback."""


@contextmanager
def stop_together():
    """Run a block on every rank and, if it fails on any, stop on all of them, so that no rank waits in a
    collective for one that gave up. An `InputError` (the user's input: one line, exit 2) is raised on every
    rank, said once when every rank found the same. Anything else keeps its type and traceback on the rank
    that raised it; the other ranks raise `RankFailed` with that traceback, and only rank 0 prints it (the
    failing rank's own exception is marked `reported_by_main`). Blocks that contain collectives must fail (if
    at all) before them, on every rank alike."""
    if not is_distributed():
        yield
        return
    own, failure = None, None
    try:
        yield
    except InputError as e:
        own, failure = e, ("input", str(e))
    except Exception as e:
        own, failure = e, ("bug", "".join(traceback.format_exception(e)))
    failures = gather_objects(failure)
    if not any(failures):
        return
    rank = dist.get_rank()
    bugs = [(r, text) for r, f in enumerate(failures) if f and f[0] == "bug" for text in [f[1]]]
    if bugs:
        if failure and failure[0] == "bug":
            own.reported_by_main = rank != 0
            raise own
        first, text = bugs[0]
        raise RankFailed(f"rank {first} failed:\n{text}")
    messages = [f[1] for f in failures if f]
    if len(set(messages)) == 1 and len(messages) == len(failures):  # the same on every rank: say it once
        if own is not None:
            raise own
        raise InputError(messages[0])
    first = next(r for r, f in enumerate(failures) if f)
    raise InputError(f"rank {first}: {failures[first][1]}")


def gather_objects(value, group=None) -> list:
    """Every rank's `value` (picklable), in rank order, on every rank; `[value]` without a process group."""
    if not is_distributed():
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    if not is_distributed():
        return value
    value = value.detach().clone()
    dist.all_reduce(value)  # a sum: gloo has no AVG
    return value / dist.get_world_size()
