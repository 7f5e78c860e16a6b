"""torch.compile, applied in place (`nn.Module.compile`), so state-dict keys stay those of the eager model.

Scope `blocks` compiles each transformer block (one graph reused by identical blocks, short compile);
`model` compiles the whole transformer (more fusion, longer compile). A compilation failure falls back to
eager for the failing frame, with dynamo's warning naming the reason, instead of stopping the run.
"""

import logging

import torch
import torch.nn as nn

log = logging.getLogger("mmdit")


def apply_compile(model: nn.Module, enabled: bool, mode: str = "default", scope: str = "blocks",
                  backend="inductor") -> None:
    if not enabled:
        return
    torch._dynamo.config.suppress_errors = True  # a failing compile runs that code eagerly
    targets = list(model.transformer.transformer_blocks) if scope == "blocks" else [model.transformer]
    for module in targets:
        module.compile(mode=None if mode == "default" else mode, backend=backend)
    log.info("torch.compile (%s, mode %s): %d module(s); failures fall back to eager", scope, mode, len(targets))
