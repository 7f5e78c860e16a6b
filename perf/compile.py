"""torch.compile applied per transformer block, in place, so state-dict keys stay those of the eager model."""

import logging

import torch.nn as nn

log = logging.getLogger("mmdit")


def apply_compile(model: nn.Module, enabled: bool) -> None:
    if not enabled:
        return
    blocks = model.transformer.transformer_blocks
    for block in blocks:
        block.compile()
    log.info("torch.compile: %d transformer blocks", len(blocks))
