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
"""

import warnings
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

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
        # Nothing is tracked before the first mark (the trained parameters): the set-up before it swaps
        # parameters (FSDP's materialization), which a weak reference to them would forbid.
        self.armed = False
        self.mark(device_tensors)

    def mark(self, tensors) -> None:
        for t in tree_flatten(list(tensors))[0]:
            if isinstance(t, torch.Tensor):
                self.on_device[t] = self.armed = True

    def count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
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
        with self, self.tracker:
            yield self


def is_place(arg) -> bool:
    """An argument of `.to` that names a device (a device, a string, or a tensor whose device it takes)."""
    return isinstance(arg, (torch.device, str, torch.Tensor))


class DeviceTracker(TorchDispatchMode):
    """Marks an op's outputs, and the tensors it writes into (`out=` buffers, in-place ops, collectives), as
    device values when any of its inputs is one."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = tree_flatten((args, kwargs))[0]
        if any(self.counter.on_the_device(t) for t in inputs):
            written = [value for argument, value in zip(func._schema.arguments, [*args, *kwargs.values()])
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
