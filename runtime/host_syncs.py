"""Counting host-device synchronisations of training steps.

A GPU runs ahead of the Python thread that queues its work; every read of a device value on the host
(`.item()`, `bool(t)`, `.tolist()`, `.cpu()`, printing a tensor) and every blocking copy from pageable host
memory waits until the queue has drained, and the GPU idles while the host catches up. The default step
makes none (tests/test_host_syncs.py counts them; `make selfcheck` on a GPU too).

- On CUDA, `cuda_sync_counter` uses `torch.cuda.set_sync_debug_mode("warn")`, CUDA's own report of every
  synchronising call.
- On the CPU there is no device to wait for, so `HostSyncCounter` counts what would wait on one: reads of
  values computed from "device" tensors (the model's parameters, their gradients, the optimizer's and EMA's
  state, and the batch once it is moved with `.to(device)`), tracked through every op, and copies to the device
  that are not `non_blocking`. Host-only values (a flag agreed over a gloo group, the batch before its copy)
  are not counted, as they cost nothing on a GPU either.

Compiled code (torch.compile) is counted too. Dynamo refuses to compile a frame while a dispatch mode is active
unless the mode ignores compile internals, as `DeviceTracker` does: compilation runs without it. A graph
compiled with `fullgraph=True` holds no read of a value on the host (a read is a graph break, which fullgraph
refuses), so what matters is that its outputs and the gradients it computes stay known as device values: the
compiled callable that a backend returns is wrapped with `marking_outputs` (perf/compile.py does so), which
marks its outputs when one of its inputs is a device value, and every marked parameter marks its gradient
when autograd accumulates it. (A copy to the host inside a compiled graph, `.cpu()`, is not seen on the CPU;
CUDA's sync debug mode sees it on a GPU.) While dynamo traces, `torch.compiler.is_compiling()` is true and the
counter passes every call through, so the traced graph is the model's own.
"""

import warnings
from contextlib import contextmanager

import torch
from torch._ops import HigherOrderOperator
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

COUNTING: list["HostSyncCounter"] = []  # the counters inside `counting()`, innermost last

READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
         torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__format__,
         torch.Tensor.__repr__, torch.Tensor.__array__}


class HostSyncCounter(TorchFunctionMode):
    """Counts, by kind, the operations that synchronise host and device on a GPU (see the module docstring)."""

    def __init__(self, device_tensors=()):
        super().__init__()
        self.on_device = WeakTensorKeyDictionary()
        self.counts: dict[str, int] = {}
        self.tracker = DeviceTracker(self)
        self.grad_hooks = WeakTensorKeyDictionary()  # marked leaves -> hooks marking their gradient (counting)
        # Nothing is tracked before the first mark (the trained parameters): the set-up before it swaps
        # parameters (FSDP's materialization), which a weak reference to them would forbid.
        self.armed = False
        self.mark(device_tensors)

    def mark(self, tensors) -> None:
        for t in tree_flatten(list(tensors))[0]:
            if isinstance(t, torch.Tensor):
                self.on_device[t] = self.armed = True
                if self in COUNTING:
                    self.mark_gradients_of(t)

    def mark_gradients_of(self, t: torch.Tensor) -> None:
        """A trained leaf's gradient is a device value, also when a compiled backward made it."""
        if t.is_leaf and t.requires_grad and t not in self.grad_hooks:
            self.grad_hooks[t] = t.register_post_accumulate_grad_hook(lambda leaf: self.mark([leaf.grad]))

    def count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # dynamo traces through: the graph holds the call as the model made it
            if args and getattr(type(args[0]), getattr(func, "__name__", ""), None) is func:
                # a tensor method, called as one: dynamo fails to inline some called as functions (the super() call
                # in Tensor.unflatten's Python body)
                return getattr(args[0], func.__name__)(*args[1:], **kwargs)
            return func(*args, **kwargs)
        if func in READS and args and self.on_the_device(args[0]):
            self.count(func.__name__)
        elif self.is_blocking_upload(func, args, kwargs):
            self.count("blocking copy to the device")
        result = func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda) and isinstance(result, torch.Tensor) and self.armed \
                and (func is torch.Tensor.cuda or "device" in kwargs or any(is_place(a) for a in args[1:])):
            self.on_device[result] = True  # the batch, once copied, lives on the device
        return result

    def is_blocking_upload(self, func, args, kwargs) -> bool:
        """A host tensor copied to the device (`.to(device)`, `.cuda()`, `device_tensor.copy_(host)`) without
        `non_blocking=True`: from pageable memory that copy waits for the device."""
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            blocking = not kwargs.get("non_blocking", len(args) > 2 and args[2])
            return blocking and self.on_the_device(dst) and not self.on_the_device(src)
        if func not in (torch.Tensor.to, torch.Tensor.cuda) or self.on_the_device(args[0]):
            return False
        places = func is torch.Tensor.cuda or "device" in kwargs or any(is_place(a) for a in args[1:])
        return places and not kwargs.get("non_blocking", False)

    def on_the_device(self, value) -> bool:
        """A device value: marked, or a DTensor (sharded parameters and their gradients, made by FSDP)."""
        return self.armed and isinstance(value, torch.Tensor) and (value in self.on_device or
                                                                   isinstance(value, DTensor))

    @contextmanager
    def counting(self):
        COUNTING.append(self)
        for t in list(self.on_device.keys()):
            self.mark_gradients_of(t)
        try:
            with self, self.tracker:
                yield self
        finally:
            COUNTING.remove(self)
            for hook in list(self.grad_hooks.values()):
                hook.remove()
            self.grad_hooks = WeakTensorKeyDictionary()


def marking_outputs(compiled):
    """`compiled`, a graph's callable as a torch.compile backend returns it, marking its outputs as device
    values while a counter counts and one of its inputs is one: inductor's kernels run below the dispatcher,
    where `DeviceTracker` sees nothing of what they make."""
    def run(*args):
        outputs = compiled(*args)
        for counter in COUNTING:
            if any(counter.on_the_device(t) for t in tree_flatten(args)[0]):
                counter.mark(tree_flatten(outputs)[0])
        return outputs
    return run


def is_place(arg) -> bool:
    """An argument of `.to` that names a device (a device, a string, or a tensor whose device it takes)."""
    return isinstance(arg, (torch.device, str, torch.Tensor))


class DeviceTracker(TorchDispatchMode):
    """Marks an op's outputs, and the tensors it writes into (`out=` buffers, in-place ops, collectives), as
    device values when any of its inputs is one. Higher-order ops (in compiled graphs: a checkpointed region's
    `run_and_save_rng_state`, say) are functional: their outputs are marked."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while dynamo compiles (it compiles nothing under a mode that wants to see every op), on while the
        compiled code runs."""
        return True

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = tree_flatten((args, kwargs))[0]
        if any(self.counter.on_the_device(t) for t in inputs):
            arguments = [] if isinstance(func, HigherOrderOperator) else func._schema.arguments
            written = [value for argument, value in zip(arguments, [*args, *kwargs.values()])
                       if argument.alias_info is not None and argument.alias_info.is_write]
            self.counter.mark(tree_flatten([result, written])[0])
        return result


@contextmanager
def cuda_sync_counter(counts: dict):
    """On CUDA: counts synchronising calls (CUDA's sync debug mode warns at each) into `counts["cuda sync"]`."""
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        start = len(caught)  # switching on warns of a sync of its own (seen on an H100): not the code's
        try:
            yield counts
        finally:
            syncs = sum("synchroniz" in str(w.message) for w in caught[start:])
            torch.cuda.set_sync_debug_mode(before)
    counts["cuda sync"] = counts.get("cuda sync", 0) + syncs
