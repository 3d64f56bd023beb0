"""Counting what a step would launch on a GPU, on CPU: Triton kernel launches (under Triton's
interpreter) and the aten ops dispatched outside them that run a kernel (views and allocations
excluded). Used by tests/worker/test_cuda_path_on_cpu.py to hold the decode step's launches."""
from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_KERNEL = frozenset((
    "empty", "new_empty", "empty_strided", "view", "_unsafe_view", "as_strided", "expand", "t",
    "transpose", "unsqueeze", "squeeze", "slice", "select", "reshape", "permute", "detach",
    "alias", "split", "split_with_sizes", "unbind", "narrow", "view_as", "_reshape_alias", "set_",
    "lift_fresh"))


class Launches:
    def __init__(self):
        self.triton = collections.Counter()
        self.torch = collections.Counter()
        self._inside = 0


class _TorchOps(TorchDispatchMode):
    def __init__(self, out: Launches):
        super().__init__()
        self.out = out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).split(".")[-1]
        if not self.out._inside and name not in NO_KERNEL:
            self.out.torch[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_launches():
    """Yields a ``Launches`` filled while the block runs (Triton interpreted)."""
    import triton.runtime.interpreter as interp
    out = Launches()
    run = interp.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        out.triton[self.fn.__name__] += 1
        out._inside += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            out._inside -= 1
    interp.InterpretedFunction.run = counted
    try:
        with _TorchOps(out):
            yield out
    finally:
        interp.InterpretedFunction.run = run
