"""Data parallelism over ranks: DDP, FSDP or HSDP (`parallel.strategy`), applied in the one order that works
for all of them: activation checkpointing, then torch.compile (per block, in place), then the wrap.

- ddp: every rank holds the whole model and optimizer; gradients are all-reduced in buckets during the last
  micro-step's backward (`no_sync` before it).
- fsdp: FSDP2 `fully_shard` on every transformer block, then on the root. Each rank keeps 1/N of the fp32
  weights, gradients, AdamW state and EMA; a block's weights are all-gathered for its forward (and again for
  its backward when `parallel.reshard_after_forward`), its gradients reduce-scattered after its backward, every
  micro-step, so gradients never exist unsharded for more than one block at a time.
- hsdp: the same within shard groups of `parallel.shard_size` ranks (usually a node), replicated across groups;
  the cross-group all-reduce of the (sharded) gradients runs once per optimizer step, on the last micro-step.

With training.dtype=bf16, FSDP computes in bf16 (weights are all-gathered in bf16) and reduces gradients in
fp32; the sharded master weights, AdamW state and EMA stay fp32. One process is never wrapped.
"""

import inspect
import logging
import os
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from perf.activation_checkpointing import apply_activation_checkpointing
from perf.compile import apply_compile
from perf.distributed import World

log = logging.getLogger("mmdit")


def shard_size(cfg: DictConfig, world: World) -> int:
    """Ranks per shard group: the whole world under fsdp; parallel.shard_size (default: this node's
    processes) under hsdp."""
    if cfg.parallel.strategy == "fsdp":
        return world.world_size
    return cfg.parallel.shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))


def check_parallel(cfg: DictConfig, world: World) -> None:
    """Settings the strategy cannot run with, named before any compute."""
    p = cfg.parallel
    if p.strategy != "hsdp" or not world.distributed:
        return
    size = shard_size(cfg, world)
    if world.world_size % size:
        raise ValueError(f"parallel.shard_size={size} must divide the world size {world.world_size} "
                         f"(hsdp: world = shard groups x parallel.shard_size)")


def device_mesh(cfg: DictConfig, world: World, device: torch.device) -> DeviceMesh:
    """1-D (shard) for fsdp; 2-D (replicate, shard) for hsdp. Always on the training device's type: without
    it, the default mesh would pick an accelerator even for a CPU run."""
    size = shard_size(cfg, world)
    if cfg.parallel.strategy == "fsdp":
        return init_device_mesh(device.type, (world.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device.type, (world.world_size // size, size), mesh_dim_names=("replicate", "shard"))


def apply_parallelism(model: nn.Module, cfg: DictConfig, world: World, device: torch.device) -> nn.Module:
    """The model as it trains, on the device: checkpointed, compiled, and wrapped or sharded for the strategy.
    Sharding moves each block to the device as it shards it, so the whole model is never there at once."""
    t, p = cfg.training, cfg.parallel
    sharded = world.distributed and p.strategy != "ddp"
    if not sharded:
        model.to(device)
    apply_activation_checkpointing(model, t.activation_checkpointing)
    apply_compile(model, cfg.compile)
    if not world.distributed:
        if p.strategy != "ddp":
            log.info("parallel.strategy=%s with one process: nothing to shard, training unsharded", p.strategy)
        return model
    if not sharded:
        return wrap_ddp(model, device, p.ddp_bucket_cap_mb)
    mesh = device_mesh(cfg, world, device)
    bf16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if t.dtype == "bf16" else {}
    for block in model.transformer.transformer_blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=p.reshard_after_forward,
                    mp_policy=MixedPrecisionPolicy(**bf16))
    # The root leaves its inputs as they come (FSDP would cast sigma to bf16, and timesteps would move in steps
    # of 2-4): autocast casts them where its matmuls need it, as under DDP. Its weights start the backward, so
    # they stay gathered after the forward.
    fully_shard(model, mesh=mesh, reshard_after_forward=False,
                mp_policy=MixedPrecisionPolicy(**bf16, cast_forward_inputs=False))
    log.info("%s: mesh %s, %d blocks sharded + the root, reshard after forward %s, %s", p.strategy,
             dict(zip(mesh.mesh_dim_names, mesh.shape)), len(model.transformer.transformer_blocks),
             p.reshard_after_forward, "bf16 compute, fp32 reduction" if t.dtype == "bf16" else "fp32")
    return model


def wrap_ddp(model: nn.Module, device: torch.device, bucket_cap_mb: float) -> nn.Module:
    """DDP after compile (dynamo's DDP optimiser then splits compiled graphs at bucket boundaries).
    find_unused_parameters stays off: the MMDiT has none, and `check_all_parameters_used` says so loudly."""
    # No buffer broadcast: the only buffer is the constant position table, and a broadcast in every forward
    # would be a collective that a rank failing mid-step (out of memory) never reaches.
    no_buffer_sync = ({"forward_sync_buffers": False}  # torch >= 2.13 name; the old one warns there
                      if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                      else {"broadcast_buffers": False})
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                   bucket_cap_mb=bucket_cap_mb, find_unused_parameters=False, **no_buffer_sync)


def unwrap(model: nn.Module) -> nn.Module:
    """The TextToImage module (DDP wraps it; FSDP2 shards it in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def is_hsdp(model: nn.Module) -> bool:
    param = next(model.parameters())
    return is_sharded(model) and isinstance(param, DTensor) and param.device_mesh.ndim == 2


def sync_gradients(model: nn.Module, last_micro_step: bool):
    """Wraps forward and backward of a micro-step. DDP: only the last one all-reduces (the forward must be
    inside too, or DDP prepares a reduction anyway). HSDP: every micro-step reduce-scatters within the shard
    group, only the last all-reduces across groups. FSDP: every micro-step reduce-scatters."""
    if isinstance(model, DistributedDataParallel):
        return nullcontext() if last_micro_step else model.no_sync()
    if is_hsdp(model) and not last_micro_step:
        return no_cross_group_reduction(model)
    return nullcontext()


@contextmanager
def no_cross_group_reduction(model: FSDPModule):
    model.set_requires_all_reduce(False)
    try:
        yield
    finally:
        model.set_requires_all_reduce(True)


def reshard(model: nn.Module) -> None:
    """After a forward outside training (sampling, validation): the root keeps its weights gathered after a
    forward (they start the backward), so free them until the next step. Every FSDP module, not only the root
    (reshard() is not recursive): with reshard_after_forward=false the blocks would otherwise keep the weights
    gathered during validation (the EMA's) and the next step would skip its all-gather and train on them."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def check_all_parameters_used(model: nn.Module) -> None:
    """After the first backward: a trainable parameter without a gradient would break DDP's reduction (and
    means dead weights); name them instead of letting DDP fail later with a generic message."""
    unused = [name for name, p in unwrap(model).named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        raise RuntimeError(f"parameters received no gradient in the first step: {unused}; DDP runs with "
                           f"find_unused_parameters=False, so every trainable parameter must be used")

