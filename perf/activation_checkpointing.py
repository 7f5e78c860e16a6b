"""Activation checkpointing per transformer block: activations of every k-th block are recomputed in the
backward pass instead of stored. Applied in place (the block's `forward` is wrapped), so parameter names and
state-dict keys stay diffusers-compatible.

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


def apply_activation_checkpointing(model: nn.Module, every: int) -> None:
    """every=0: off; every=k: blocks 0, k, 2k, ... recompute their activations in backward."""
    if every <= 0:
        return
    blocks = model.transformer.transformer_blocks
    for i, block in enumerate(blocks):
        if i % every == 0:
            block.forward = checkpointed(block.forward)
    log.info("activation checkpointing: %d of %d blocks", len(range(0, len(blocks), every)), len(blocks))
