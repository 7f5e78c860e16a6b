"""torch.compile, applied in place (`nn.Module.compile`), so state-dict keys stay those of the eager model.

Scope `blocks` compiles each transformer block (one graph reused by identical blocks, short compile) with
`fullgraph=True`: a block is one graph, so inductor fuses everything between its matmuls. A graph break in a
block (code dynamo cannot trace, added by a wrapper or a plugin) stops the run with dynamo's message naming it,
instead of silently compiling the block in pieces. `model` compiles the whole transformer (more fusion,
longer compile; not held to one graph). A failure of the compiler backend (inductor's code generation, a
missing toolchain) runs that graph eagerly, with a warning naming the reason, instead of stopping the run.
"""

import logging

import torch
import torch.nn as nn

log = logging.getLogger("mmdit")


def apply_compile(model: nn.Module, cfg) -> None:
    """`cfg` is the config's `compile` section."""
    if not cfg.enabled:
        return
    targets = list(model.transformer.blocks) if cfg.scope == "blocks" else [model.transformer]
    backend = EagerIfFailing(cfg.backend, cfg.mode)  # one object: identical blocks share the compiled code
    for module in targets:
        module.compile(backend=backend, fullgraph=cfg.scope == "blocks")
    log.info("torch.compile (%s, mode %s, %s): %d module(s); a graph the backend fails on runs eagerly", cfg.scope,
             cfg.mode, cfg.backend, len(targets))


def torch_backend(name: str, mode: str):
    """The backend object torch.compile itself builds for (backend, mode)."""
    mode = None if mode == "default" else mode
    if name == "inductor":
        return torch._TorchCompileInductorWrapper(mode, None, None)
    return torch._TorchCompileWrapper(name, mode, None, None)


class EagerIfFailing:
    """torch.compile's backend for (name, mode), except that a graph it fails to compile runs as traced, eagerly:
    the same torch ops as the eager model, so the same numbers. (dynamo's `suppress_errors` does not apply
    under fullgraph.) Anything else dynamo asks of the backend (its config, reset) goes to torch's object."""

    def __init__(self, name: str, mode: str):
        self.name, self.backend = name, torch_backend(name, mode)

    def __call__(self, graph, example_inputs, **kwargs):
        try:
            return self.backend(graph, example_inputs, **kwargs)
        except Exception as e:  # the backend's failure, whatever its type: the model itself traced fine
            log.warning("torch.compile: the %s backend failed on a graph (%s: %s); it runs eagerly", self.name,
                        type(e).__name__, str(e).split("\n")[0])
            return graph.forward

    def __getattr__(self, name: str):
        return getattr(self.backend, name)
