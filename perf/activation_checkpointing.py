"""Activation checkpointing per transformer block: activations of every k-th block are recomputed in the
backward pass instead of stored. Applied in place (the block's `forward` is wrapped), so state-dict keys
stay diffusers-compatible."""

import functools
import logging

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("mmdit")


def apply_activation_checkpointing(model: nn.Module, every: int) -> None:
    """every=0: off; every=k: blocks 0, k, 2k, ... recompute their activations in backward."""
    if every <= 0:
        return
    blocks = model.transformer.transformer_blocks
    for i, block in enumerate(blocks):
        if i % every == 0:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    log.info("activation checkpointing: %d of %d blocks", len(range(0, len(blocks), every)), len(blocks))
