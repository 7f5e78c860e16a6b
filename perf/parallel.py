"""Data parallelism over ranks: DDP, FSDP or HSDP (`parallel.strategy`), applied in the one order that works
for all of them: float8 linears, then activation checkpointing, then torch.compile (per block, in place), then
block swapping (its hooks run outside the compiled blocks; it keeps the swapped weights off the device from the
start), then the wrap. The model arrives built on the meta device and is materialized here: on the device, or under FSDP only
the shards this rank holds, so no rank ever holds the whole model (an 8B model is 32 GB in fp32).

- ddp: every rank holds the whole model and optimizer; gradients are all-reduced in buckets during the last
  micro-step's backward (`no_sync` before it).
- fsdp: FSDP2 `fully_shard` on every transformer block (and on every layer, then every encoder, of SD3's
  text encoders when they run in the step, frozen or with LoRA adapters), then on the root. Each rank keeps 1/N
  of the fp32 weights, gradients, AdamW state and EMA; a block's weights are all-gathered for its forward (and
  again for its backward when `parallel.reshard_after_forward`), its gradients reduce-scattered after its backward,
  every micro-step, so gradients never exist unsharded for more than one block at a time.
- hsdp: the same within shard groups of `parallel.shard_size` ranks (usually a node), replicated across groups;
  the cross-group all-reduce of the (sharded) gradients runs once per optimizer step, on the last micro-step.

With training.dtype=bf16, FSDP computes in bf16 (weights are all-gathered in bf16) and reduces gradients in
fp32; the sharded master weights, AdamW state and EMA stay fp32. With parallel.cpu_offload those shards, their
gradients and the AdamW state live in host memory (FSDP2's CPUOffloadPolicy): each block's weights are copied
to the GPU for its forward and backward, its gradients back, and the optimizer step runs on the CPU. One
process is not wrapped, except to offload (FSDP over a group of one).
"""

import inspect
import logging
import os
from contextlib import contextmanager, nullcontext
from itertools import chain

import torch
import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from errors import ConfigError
from models.pipeline_text import PipelineTextEncoders
from perf.activation_checkpointing import apply_activation_checkpointing
from perf.block_swap import BlockSwap, apply_block_swap
from perf.compile import apply_compile
from perf.float8 import apply_float8
from runtime.distributed import World

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
        raise ConfigError(f"parallel.shard_size={size} must divide the world size {world.world_size} "
                         f"(hsdp: world = shard groups x parallel.shard_size)")


def device_mesh(cfg: DictConfig, world: World, device: torch.device) -> DeviceMesh:
    """1-D (shard) for fsdp; 2-D (replicate, shard) for hsdp. Always on the training device's type: without
    it, the default mesh would pick an accelerator even for a CPU run."""
    size = shard_size(cfg, world)
    if cfg.parallel.strategy == "fsdp":
        return init_device_mesh(device.type, (world.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device.type, (world.world_size // size, size), mesh_dim_names=("replicate", "shard"))


def apply_parallelism(model: nn.Module, cfg: DictConfig, world: World, device: torch.device,
                      initial_values) -> nn.Module:
    """The model as it trains: float8, checkpointed, compiled, wrapped or sharded for the strategy, and
    materialized from `initial_values` (see `materialize`)."""
    t, p = cfg.training, cfg.parallel
    apply_float8(model, cfg.float8, device, sharded=sharded(cfg, world))
    apply_activation_checkpointing(model, t.activation_checkpointing, t.activation_checkpointing_every)
    apply_compile(model, cfg.compile)
    if not sharded(cfg, world):  # block swap is refused with sharding (configs/schema.py)
        swap = apply_block_swap(model, cfg.offload.blocks_to_swap, device)
        materialize(model, device, initial_values, swap=swap)
        if world.distributed:
            return wrap_ddp(model, device, p.ddp_bucket_cap_mb, ignored=list(swap.names) if swap else [])
        if p.strategy != "ddp":
            log.info("parallel.strategy=%s with one process: nothing to shard, training unsharded", p.strategy)
        return model
    mesh = device_mesh(cfg, world, device)
    bf16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if t.dtype == "bf16" else {}
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if p.cpu_offload else OffloadPolicy()
    for block in model.transformer.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=p.reshard_after_forward,
                    mp_policy=MixedPrecisionPolicy(**bf16), offload_policy=offload)
    frozen = ([*model.text_encoder.blocks(), *model.text_encoder.encoders()]
              if isinstance(model.text_encoder, PipelineTextEncoders) else [])
    # gathered for the forward, freed after it; a CLIP with adapters (lora.text_encoders) is gathered again for its
    # backward, and its adapters' gradients reduce-scattered, like a transformer block's
    for module in frozen:
        fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(**bf16), offload_policy=offload)
    # The root leaves its inputs as they come (FSDP would cast sigma to bf16, and timesteps would move in steps
    # of 2-4): autocast casts them where its matmuls need it, as under DDP. Its weights start the backward, so
    # they stay gathered after the forward.
    fully_shard(model, mesh=mesh, reshard_after_forward=False,
                mp_policy=MixedPrecisionPolicy(**bf16, cast_forward_inputs=False), offload_policy=offload)
    # offloaded shards live in host memory (FSDP copies each block's to the GPU when it runs); buffers, which FSDP
    # does not manage, on the GPU
    materialize(model, torch.device("cpu") if p.cpu_offload else device, initial_values, buffers=device)
    log.info("%s: mesh %s, %d blocks%s sharded + the root, reshard after forward %s, %s%s", p.strategy,
             dict(zip(mesh.mesh_dim_names, mesh.shape)), len(model.transformer.blocks),
             f" and {len(frozen)} modules of the frozen text encoders" if frozen else "",
             p.reshard_after_forward, "bf16 compute, fp32 reduction" if t.dtype == "bf16" else "fp32",
             ", weights, gradients and AdamW state offloaded to host memory" if p.cpu_offload else "")
    return model


def sharded(cfg: DictConfig, world: World) -> bool:
    """FSDP/HSDP over several ranks, or over one to offload to host memory."""
    return cfg.parallel.strategy != "ddp" and (world.distributed or cfg.parallel.cpu_offload)


def materialize(model: nn.Module, device: torch.device, initial_values, buffers: torch.device | None = None,
                swap: BlockSwap | None = None) -> None:
    """Allocate the parameters and buffers of a model built on the meta device on `device` (buffers on `buffers`,
    if given) and fill each from `initial_values(name, offsets, sizes)`: the block of it this rank holds, the
    whole tensor unless FSDP sharded it; the weights `swap` swaps go to its host buffers instead (never to the
    device). Peak host memory beyond what the process keeps: one tensor (or block) at a time, and one file of
    model.init_from mapped (models/diffusers_io.py's WeightReader)."""
    with swap.set_aside() if swap else nullcontext():
        model.to_empty(device=device)
    if buffers is not None:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module.register_buffer(name, torch.empty_like(buffer, device=buffers),
                                       persistent=name not in module._non_persistent_buffers_set)
    with torch.no_grad():
        for name, tensor in chain(model.named_parameters(), model.named_buffers()):
            if isinstance(tensor, DTensor):
                chunk = tensor.__create_chunk_list__()[0]
                offsets, sizes, local = tuple(chunk.offsets), tuple(chunk.sizes), tensor.to_local()
            else:
                offsets, sizes, local = (0,) * tensor.dim(), tuple(tensor.shape), tensor
            local = swap.master(name) if swap and swap.master(name) is not None else local
            if local.numel():
                local.copy_(initial_values(name, offsets, sizes))
    if swap:
        swap.pin()


def wrap_ddp(model: nn.Module, device: torch.device, bucket_cap_mb: float, ignored: list[str] = ()) -> nn.Module:
    """DDP after compile (dynamo's DDP optimiser then splits compiled graphs at bucket boundaries).
    find_unused_parameters stays off: the MMDiT has none, and `check_all_parameters_used` says so loudly. `ignored`:
    parameters DDP must not touch (block swapping's, which have no device memory between uses: DDP would broadcast
    them from rank 0 as it starts; each rank read the same frozen values)."""
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
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

