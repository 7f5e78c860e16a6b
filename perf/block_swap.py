"""Block swapping (`offload.blocks_to_swap=N`): the frozen weights of N transformer blocks live in host memory and
are copied to the GPU one swapped block ahead of use, in the forward and again in the backward, on a side stream
while the GPU computes; the GPU holds two of those blocks at a time (so N - 2 blocks' weights are saved). For LoRA
runs on a base larger than the GPU (FLUX.2-dev's 32 B parameters on a 24 GB card). docs/performance.md ("Block
swapping") has the design and how it differs from musubi-tuner's.

What: the parameters of the swapped blocks that do not train (a LoRA base: bf16 weights, or nf4 / int8 codes and
scales, and biases); the adapters and every other trained parameter stay on the GPU, where the optimizer steps them.
Which: N blocks spread evenly over the forward order, the last block among them (`swapped_blocks`): the copy of
the next swapped block hides behind the compute of every block up to it, not behind one block, for the same two
blocks of GPU memory.

When (each swapped block s_k, k = 0..N-1; the hooks below):
- forward: at the start of a pass (block 0) s_0's copy starts; when s_k starts, it waits for its copy and s_{k+1}'s
  starts; when s_k ends, its weights are freed, but for s_{N-1}, which the backward needs first.
- backward: when the gradient of s_k's outputs arrives (a hook on them), it waits for its weights and s_{k-1}'s copy
  starts; when its inputs' gradients are all computed (an identity autograd Function on them, as FSDP2's
  post-backward) its weights are freed; what remains is freed when the backward ends (a block whose inputs need no
  gradient: the first, under LoRA).
So a training micro-step copies 2N - 1 blocks (N forward, N - 1 backward), a forward without gradients N.

How a weight is freed while autograd still holds it: without activation checkpointing a matmul saves its frozen
weight for the input's gradient, so dropping our reference would free nothing. The weight keeps its tensor and
shape for good, and only its storage is resized to 0 bytes (freed) and back (allocated, then refilled by the copy)
around each use, as FSDP2 frees and re-gathers parameters (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
`free_storage`, `alloc_storage`): every tensor autograd saved shares that storage and finds the same values again
in the backward. The copy writes through `param.data`, whose version counter is its own, so autograd's check of
saved tensors sees no in-place change (the values are the same frozen ones). With activation checkpointing the
backward re-runs the block's forward, which reads its weights then: loaded by the same backward hook. On a CPU a
weight used outside its window fails loudly ("storage of size 0", "not allocated"): the tests' proof of the
schedule.

Streams (CUDA): each load allocates the storages on the compute stream, records an event there, and the side
stream waits for that event before copying from pinned host memory (non_blocking), then records its own event,
which the compute stream waits for before the block runs (and before the storage is freed, should a pass stop
before using it). Memory is only ever allocated and freed on the compute stream, so the caching allocator never
hands a block to the side stream that the compute stream may still read, and no `record_stream` is needed. The
host buffers (one per swapped block, exact size) are page-locked with cudaHostRegister, as torch's own checkpoint
stager does (torch/cuda/_pin_memory_utils.py): the pinned caching allocator (`pin_memory=True`) rounds every
allocation up to a power of two (torch.cuda.host_memory_stats' docstring), up to twice the host memory. On a CPU
the streams are no-ops and the copies real (`SYNCHRONOUS`).

Applied from outside: forward pre- and post-hooks on every block, wrapped in `torch.compiler.disable` as FSDP2's
hooks are: a compiled block (`compile.scope=blocks`) runs its hooks eagerly, outside its graph, and stays one
graph, whose weights are always on the device when it runs (every block's inputs pass `BackwardDone`, so blocks of
one kind keep one graph). DDP is told to leave the swapped weights alone (perf/parallel.py's `wrap_ddp`).
"""

import functools
import logging
import weakref
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from errors import ConfigError

log = logging.getLogger("mmdit")

# The block swap of the model this process trains (apply_block_swap's last; None when off): tests read its copies
active: "BlockSwap | None" = None
ALIGN = 256  # bytes: where each weight starts in its block's host buffer (any dtype's element, and CUDA's copies)


def swapped_blocks(blocks: int, swapped: int) -> list[int]:
    """The indices (forward order) of `swapped` of `blocks` blocks, spread evenly, the last block among them:
    floor((k + 1) * blocks / swapped) - 1, which are distinct for swapped <= blocks."""
    return [(k + 1) * blocks // swapped - 1 for k in range(swapped)]


def planned_loads(blocks: int, swapped: int, backward: bool = True) -> list[tuple[str, int]]:
    """The copies a micro-step makes, in order: (phase, block)."""
    order = swapped_blocks(blocks, swapped)
    return [("forward", b) for b in order] + ([("backward", b) for b in reversed(order[:-1])] if backward else [])


class Synchronous:
    """torch.cuda's stream interface where nothing runs asynchronously (the CPU): no events, no waits."""

    class Stream:
        def record_event(self):
            return None

        def wait_event(self, event) -> None:
            pass

    def current_stream(self) -> "Synchronous.Stream":
        return self.Stream()

    def stream(self, stream):
        return nullcontext()


SYNCHRONOUS = Synchronous()


def register_host(buffer: torch.Tensor) -> None:
    """Page-lock `buffer` in place (cudaHostRegister, flags cudaHostRegisterPortable as torch's own helper), so that
    copies from it to the GPU run asynchronously."""
    status = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 1))
    if status != 0:
        raise RuntimeError(f"cudaHostRegister of {buffer.numel() / 2**20:.0f} MiB of block-swap weights failed with "
                           f"cudaError {status} (host memory that cannot be page-locked?)")


def unregister_host(pointers: list[int], buffers: list[torch.Tensor]) -> None:
    """Undo `register_host` before the buffers go (`buffers` is held until then)."""
    for pointer in pointers:
        torch.cuda.cudart().cudaHostUnregister(pointer)  # at exit CUDA may be gone already: nothing to do then


class BackwardDone(torch.autograd.Function):
    """The identity on a block's inputs; its backward runs once all their gradients are computed, i.e. once the
    block's backward is done, and calls `done`."""

    @staticmethod
    def forward(ctx, done, *inputs):
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None, *grads)


class BlockSwap:
    """The swapped blocks of `model.transformer`: which, their host buffers, the schedule (hooks on every block) and
    the copies. `streams`: torch.cuda's stream interface (the tests pass a recording one); `register`: page-locks a
    host buffer. `loads` lists every copy made, (phase, block), in order."""

    def __init__(self, model: nn.Module, swapped: int, device: torch.device, streams=None, register=None):
        blocks = list(model.transformer.blocks)
        if not 0 < swapped <= len(blocks):  # users' configs are checked before (check_block_swap); freed storage
            raise ValueError(f"{swapped} swapped blocks of {len(blocks)}")  # would be read otherwise
        self.device, self.blocks, self.order = device, len(blocks), swapped_blocks(len(blocks), swapped)
        self.rank = {b: k for k, b in enumerate(self.order)}
        self.streams = streams or (torch.cuda if device.type == "cuda" else SYNCHRONOUS)
        self.register = register or (register_host if device.type == "cuda" else None)
        self.side = self.streams.Stream()
        prefix = {id(module): name for name, module in model.named_modules()}
        self.slots: dict[int, list[tuple[nn.Module, str]]] = {}  # block -> (module, attribute) of each frozen weight
        self.names: dict[str, tuple[int, int]] = {}  # the model's name of each swapped weight -> (block, slot)
        for b in self.order:
            self.slots[b] = []
            for module in blocks[b].modules():
                for attribute, param in module.named_parameters(recurse=False):
                    if not param.requires_grad:
                        self.names[f"{prefix[id(module)]}.{attribute}"] = (b, len(self.slots[b]))
                        self.slots[b].append((module, attribute))
        self.buffers: dict[int, torch.Tensor] = {}  # block -> its host buffer (uint8)
        self.masters: dict[int, list[torch.Tensor]] = {}  # block -> views of the buffer, one per weight
        self.events: dict[int, object] = {}  # the resident blocks -> the event of their copy
        self.in_backward = False
        self.loads: list[tuple[str, int]] = []
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(torch.compiler.disable(functools.partial(self.pre_forward, index),
                                                                   reason="block swap: outside the graph"),
                                            with_kwargs=True)
            block.register_forward_hook(torch.compiler.disable(functools.partial(self.post_forward, index),
                                                               reason="block swap: outside the graph"),
                                        with_kwargs=True)

    def weights(self, block: int) -> list[nn.Parameter]:
        return [getattr(module, attribute) for module, attribute in self.slots[block]]

    @property
    def host_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    # ------------------------------------------------------------------------------------------- at the start

    @contextmanager
    def set_aside(self):
        """While `model.to_empty` allocates the model on the device: the swapped weights out of their modules (so that
        they take no device memory); then back, as device tensors of their shape without memory, with a host buffer
        per block (pageable until `pin`) for `master` to fill."""
        shapes = {b: [(p.shape, p.dtype) for p in self.weights(b)] for b in self.order}
        for b in self.order:
            for module, attribute in self.slots[b]:
                module.register_parameter(attribute, None)
        try:
            yield
        finally:
            for b in self.order:
                offsets, end = [], 0
                for shape, dtype in shapes[b]:
                    end = -(-end // ALIGN) * ALIGN
                    offsets.append(end)
                    end += shape.numel() * dtype.itemsize
                self.buffers[b] = torch.empty(end, dtype=torch.uint8)  # pageable; pages come as they are filled
                self.masters[b] = [self.buffers[b][o:o + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                                   for o, (shape, dtype) in zip(offsets, shapes[b])]
                for (module, attribute), (shape, dtype) in zip(self.slots[b], shapes[b]):
                    weight = torch.empty(shape, dtype=dtype, device=self.device)
                    weight.untyped_storage().resize_(0)
                    module.register_parameter(attribute, nn.Parameter(weight, requires_grad=False))

    def master(self, name: str) -> torch.Tensor | None:
        """Where the values of the model's parameter `name` go, if it is swapped."""
        if name not in self.names:
            return None
        block, slot = self.names[name]
        return self.masters[block][slot]

    def pin(self) -> None:
        """Once filled: page-lock the host buffers (CUDA)."""
        if self.register is None:
            return
        for buffer in self.buffers.values():
            self.register(buffer)
        if self.register is register_host:
            weakref.finalize(self, unregister_host, [b.data_ptr() for b in self.buffers.values()],
                             list(self.buffers.values()))

    # ------------------------------------------------------------------------------------------- the copies

    def load(self, block: int, phase: str) -> None:
        """Allocate the block's weights on the compute stream and copy them in on the side stream (unless resident)."""
        if block in self.events:
            return
        compute = self.streams.current_stream()
        with torch.no_grad():
            weights = self.weights(block)
            for weight in weights:
                weight.untyped_storage().resize_(weight.numel() * weight.element_size())
            allocated = compute.record_event()
            with self.streams.stream(self.side):
                self.side.wait_event(allocated)  # the memory's last reader, on the compute stream, is done
                for weight, master in zip(weights, self.masters[block]):
                    weight.data.copy_(master, non_blocking=True)  # .data: no version bump (same values)
                self.events[block] = self.side.record_event()
        self.loads.append((phase, block))

    def wait(self, block: int) -> None:
        self.streams.current_stream().wait_event(self.events[block])

    def evict(self, block: int) -> None:
        """Free the block's weights (resident or not), after its copy (a pass may stop before waiting for it)."""
        if block not in self.events:
            return
        self.wait(block)
        del self.events[block]
        for weight in self.weights(block):
            weight.untyped_storage().resize_(0)

    # ------------------------------------------------------------------------------------------- the schedule

    def pre_forward(self, index: int, module, args, kwargs):
        if index == 0:  # a pass starts: whatever a pass that stopped early (or a forward without backward) left goes
            for block in list(self.events):
                self.evict(block)
            self.in_backward = False
            self.load(self.order[0], "forward")
        k = self.rank.get(index)
        if k is not None:
            if index not in self.events:  # only when a pass does not start at block 0
                self.load(index, "forward")
            self.wait(index)
            if k + 1 < len(self.order):
                self.load(self.order[k + 1], "forward")
        # every block's inputs alike (a swapped block's only need it): a compiled block's graph is guarded on its
        # inputs, which come out of BackwardDone as views, and one kind of block keeps one graph
        return self.done_after_backward(index, args, kwargs) if torch.is_grad_enabled() else None

    def done_after_backward(self, index: int, args, kwargs):
        """The block's inputs that need a gradient, through `BackwardDone`: its backward frees its weights."""
        leaves, spec = tree_flatten((args, kwargs))
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if not at:
            return None
        outs = BackwardDone.apply(functools.partial(self.evict, index), *[leaves[i] for i in at])
        for i, out in zip(at, outs):
            leaves[i] = out
        return tree_unflatten(leaves, spec)

    def post_forward(self, index: int, module, args, kwargs, output) -> None:
        k = self.rank.get(index)
        if k is None:
            return
        needing = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and needing:
            register_multi_grad_hook(needing, functools.partial(self.pre_backward, index), mode="any")
            if k == len(self.order) - 1:
                return  # kept: the backward starts with it
        self.evict(index)

    def pre_backward(self, index: int, grad) -> None:
        if not self.in_backward:  # the first swapped block of this backward: free what is left when it ends
            self.in_backward = True
            Variable._execution_engine.queue_callback(self.end_of_backward)
        if index not in self.events:
            self.load(index, "backward")
        self.wait(index)
        k = self.rank[index]
        if k > 0:
            self.load(self.order[k - 1], "backward")

    def end_of_backward(self) -> None:
        for block in list(self.events):
            self.evict(block)
        self.in_backward = False


def check_block_swap(cfg, model: nn.Module) -> None:
    """More swapped blocks than the model has: named before anything is computed."""
    swapped, blocks = cfg.offload.blocks_to_swap, len(model.transformer.blocks)
    if swapped > blocks:
        raise ConfigError(f"offload.blocks_to_swap={swapped} is more than the {blocks} transformer blocks of this "
                          f"model ({cfg.model.family}); at most {blocks}")


def apply_block_swap(model: nn.Module, swapped: int, device: torch.device) -> BlockSwap | None:
    """`swapped` blocks swapped (0: a no-op). Before `materialize`, which fills their host buffers instead of the
    device."""
    global active
    active = None
    if not swapped:
        return None
    swap = active = BlockSwap(model, swapped, device)
    frozen = sum(sum(p.numel() * p.element_size() for p in swap.weights(b)) for b in swap.order)
    if device.type != "cuda":
        log.warning("offload.blocks_to_swap=%d on a %s: the weights are already in host memory, so swapping saves "
                    "nothing here (it runs, copying them, as on a GPU)", swapped, device.type)
    log.info("block swap: %d of %d blocks (%s), %.2f GiB of frozen weights in host memory, two blocks on the device "
             "at a time", swapped, len(model.transformer.blocks), swap.order, frozen / 2**30)
    return swap
