"""torch.compile, applied in place (`nn.Module.compile`), so state-dict keys stay those of the eager model.

Scope `blocks` compiles each transformer block (one graph reused by identical blocks, short compile) with
`fullgraph=True`: a block is one graph, so inductor fuses everything between its matmuls. A graph break in a
block (code dynamo cannot trace, added by a wrapper or a plugin) stops the run with dynamo's message naming it,
instead of silently compiling the block in pieces. `model` compiles the whole transformer (more fusion,
longer compile; not held to one graph). A failure of the compiler backend falls back to eager for the
failing frame, with dynamo's warning naming the reason, instead of stopping the run.
"""

import logging

import torch
import torch.nn as nn

log = logging.getLogger("mmdit")


def apply_compile(model: nn.Module, cfg) -> None:
    """`cfg` is the config's `compile` section."""
    if not cfg.enabled:
        return
    torch._dynamo.config.suppress_errors = True  # a failing compile runs that code eagerly
    targets = list(model.transformer.transformer_blocks) if cfg.scope == "blocks" else [model.transformer]
    for module in targets:
        module.compile(mode=None if cfg.mode == "default" else cfg.mode, backend=cfg.backend,
                       fullgraph=cfg.scope == "blocks")
    log.info("torch.compile (%s, mode %s, %s): %d module(s); failures fall back to eager", cfg.scope, cfg.mode,
             cfg.backend, len(targets))
