"""torch.compile, applied in place (`nn.Module.compile`), so state-dict keys stay those of the eager model.

Scope `blocks` compiles each transformer block (one graph reused by identical blocks, short compile) with
`fullgraph=True`: a block is one graph, so inductor fuses everything between its matmuls. A graph break in a
block (code dynamo cannot trace, added by a wrapper or a plugin) stops the run with dynamo's message naming it,
instead of silently compiling the block in pieces. `model` compiles the whole transformer (more fusion,
longer compile; not held to one graph). A failure of the compiler backend (inductor's code generation, a
missing toolchain) runs that graph eagerly instead of stopping the run: a warning names the reason, and the
count of such graphs is in every metrics line (`compile/eager_fallbacks`) and in each benchmark row, so that a
"compiled" run that runs eagerly shows it.
"""

import logging

import torch
import torch.nn as nn

from runtime.host_syncs import marking_outputs

log = logging.getLogger("mmdit")

# The backend of the model this process trains (apply_compile's last; None when compile is off): the metrics
# line reports its fallbacks
active: "EagerIfFailing | None" = None


def apply_compile(model: nn.Module, cfg) -> None:
    """`cfg` is the config's `compile` section."""
    global active
    active = None
    if not cfg.enabled:
        return
    targets = list(model.transformer.blocks) if cfg.scope == "blocks" else [model.transformer]
    active = compile_modules(targets, cfg.backend, cfg.mode, fullgraph=cfg.scope == "blocks")
    log.info("torch.compile (%s, mode %s, %s): %d module(s); a graph the backend fails on runs eagerly", cfg.scope,
             cfg.mode, cfg.backend, len(targets))


def compile_modules(modules, backend: str, mode: str, fullgraph: bool) -> "EagerIfFailing":
    """Compile each module in place with one backend object (identical modules share the compiled code)."""
    compiler = EagerIfFailing(backend, mode)
    for module in modules:
        module.compile(backend=compiler, fullgraph=fullgraph)
    return compiler


def compile_metrics() -> dict[str, int]:
    """`compile/eager_fallbacks`: graphs that run eagerly because the backend failed on them (compiled runs)."""
    return {} if active is None else {"compile/eager_fallbacks": len(active.fallbacks)}


def torch_backend(name: str, mode: str):
    """The backend object torch.compile itself builds for (backend, mode)."""
    mode = None if mode == "default" else mode
    if name == "inductor":
        return torch._TorchCompileInductorWrapper(mode, None, None)
    return torch._TorchCompileWrapper(name, mode, None, None)


class EagerIfFailing:
    """torch.compile's backend for (name, mode), except that a graph it fails to compile runs as traced, eagerly:
    the same torch ops as the eager model, so the same numbers. (dynamo's `suppress_errors` does not apply
    under fullgraph.) `fallbacks` lists why each such graph failed. Anything else dynamo asks of the backend
    (its config, reset) goes to torch's object. What it returns keeps the CPU host-sync counter's view of device
    values (runtime/host_syncs.py)."""

    def __init__(self, name: str, mode: str):
        self.name, self.backend, self.fallbacks = name, torch_backend(name, mode), []

    def __call__(self, graph, example_inputs, **kwargs):
        try:
            return marking_outputs(self.backend(graph, example_inputs, **kwargs))
        except Exception as e:  # the backend's failure, whatever its type: the model itself traced fine
            reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            self.fallbacks.append(reason)
            log.warning("torch.compile: the %s backend failed on a graph (%s); it runs eagerly", self.name, reason)
            return marking_outputs(graph.forward)

    def __getattr__(self, name: str):
        return getattr(self.backend, name)
