"""torchao, imported only where a run uses it (float8, perf/float8.py; optimizer.name=adamw8bit), and without its
start-up noise.

transformers and peft import torchao whenever it is installed (`make test` installs it): transformers at its own
import, peft again whenever it wraps a layer. Importing torchao logs warnings that say nothing about the run, in
the run's own log format: CUDA kernels for other GPUs that it cannot load ("Failed to load ..._C_mxfp8...so"),
"Detected no triton", and torch's deprecation of pytree registrations its modules make as they are imported. So
an entry point runs with torchao looking uninstalled unless the run uses it, and a run that uses it keeps those
warnings out of its log.
"""

import logging
import sys
from contextlib import contextmanager

# torchao's own loggers, and torch's pytree module, which warns about the registrations torchao's modules make
NOISY_AT_IMPORT = ("torchao", "torch.utils._pytree")


@contextmanager
def torchao_only_if(used: bool):
    """For the block: where the run uses torchao, its modules import without their warnings in the log (errors
    still show); otherwise torchao looks uninstalled to every import and availability check (importlib reads a
    None in sys.modules as "not installed"), unless it is imported already."""
    if "torchao" in sys.modules:
        yield
    elif used:
        with quiet(NOISY_AT_IMPORT):
            yield
    else:
        sys.modules["torchao"] = None
        try:
            yield
        finally:
            sys.modules.pop("torchao", None)


@contextmanager
def quiet(names: tuple[str, ...]):
    """The named loggers log errors only in the block."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
