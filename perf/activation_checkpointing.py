"""Activation checkpointing: activations recomputed in the backward pass instead of stored, either whole blocks
(`full`: a block keeps only its inputs) or only their MLPs (`mlp`: the two 4x-wide hidden activations per
stream, most of a block's saved bytes at a fraction of its FLOPs; attention's are kept, as torchtitan's selective
checkpointing keeps the expensive matmuls' outputs), in every k-th block. Applied in place (a module's `forward`
is wrapped), so parameter names and state-dict keys stay diffusers-compatible. runtime/memory_plan.py counts
what each setting keeps and plan_memory.py picks the cheapest that fits.

The wrapper is a plain function that calls `torch.utils.checkpoint.checkpoint`, applied before
`torch.compile` compiles the block: dynamo traces into it and captures the checkpoint as part of the block's
graph. (Wrapping with `functools.partial(checkpoint, ...)` instead makes `checkpoint`, which dynamo does not
trace, the first frame of the block: nothing would be compiled, silently.)"""

import logging

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("mmdit")


def checkpointed(forward):
    """`forward`, with its activations recomputed in the backward pass."""
    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    checkpointed_forward.checkpointed = forward
    return checkpointed_forward


def checkpointed_modules(block: nn.Module, mode: str) -> list[nn.Module]:
    """What `mode` recomputes in one block."""
    if mode == "full":
        return [block]
    return [ff for ff in (getattr(block, "ff", None), getattr(block, "ff_context", None)) if ff is not None]


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1) -> None:
    """mode none: a no-op; mlp or full: in blocks 0, every, 2*every, ..."""
    if mode == "none":
        return
    blocks = model.transformer.blocks
    for block in list(blocks)[::every]:
        for module in checkpointed_modules(block, mode):
            module.forward = checkpointed(module.forward)
    log.info("activation checkpointing (%s): %d of %d blocks", mode, len(range(0, len(blocks), every)), len(blocks))
