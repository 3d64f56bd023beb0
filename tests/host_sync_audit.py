"""Find host reads of device data in code meant to run inside a CUDA graph, on CPU.

A CUDA graph capture fails (or records a wrong graph) when the captured code reads device values
on the host: ``.item()``, ``.tolist()``, ``bool(t)``, shapes that depend on data (``nonzero``,
boolean indexing, ``unique``...), or copies Python data in (``torch.tensor(list)`` is a pageable
host-to-device copy). On CPU every tensor is a host tensor, so nothing fails by itself; this
audit makes those ops raise while it is active. It knows which aten ops read data on CUDA (the
list below, from the ops' CUDA implementations, which call ``cudaStreamSynchronize`` or
``_local_scalar_dense``; composite ops such as ``item`` reach the mode undecomposed under
``torch.inference_mode``, so both forms are listed), plus ``Tensor.tolist``, ``numpy``, ``cpu``
and ``to("cpu")``, which do not dispatch on CPU. Kernels run by Triton's interpreter are exempt: the interpreter reads its arguments on the
host by design, a compiled kernel does not.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops whose CUDA implementation reads device data on the host (shape or value).
_ALWAYS = {
    aten._local_scalar_dense.default: "reads a value on the host (.item(), int(), bool())",
    aten.item.default: "reads a value on the host (.item(), int(), bool())",
    aten.allclose.default: "returns a Python bool",
    aten.nonzero_numpy.default: "its output shape depends on the data",
    aten.nonzero.default: "its output shape depends on the data",
    aten.nonzero.out: "its output shape depends on the data",
    aten.argwhere.default: "its output shape depends on the data",
    aten.masked_select.default: "its output shape depends on the data",
    aten._unique2.default: "its output shape depends on the data",
    aten.unique_dim.default: "its output shape depends on the data",
    aten.unique_consecutive.default: "its output shape depends on the data",
    aten.equal.default: "returns a Python bool",
    aten.is_nonzero.default: "returns a Python bool",
    aten.bincount.default: "its output size depends on the data's maximum",
}
# torch.tensor(data): a pageable host-to-device copy, unless 0-dim (a CPU scalar is a kernel
# argument, and a constant in a graph).
_LIFT = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
_BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                 aten._index_put_impl_.default}


class HostSync(RuntimeError):
    """A host read of device data inside an audited region."""


def host_read_reason(func, args, kwargs) -> str | None:
    """Why ``func(*args, **kwargs)`` would read device data on the host on CUDA, or None."""
    reason = _ALWAYS.get(func)
    if reason is not None:
        return reason
    if func in _LIFT and args[0].dim() > 0:
        return "torch.tensor(data) copies pageable host data in"
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) \
            and kwargs.get("output_size") is None:
        return "without output_size its output size depends on the data"
    if func in _BOOL_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype == torch.bool for i in indices):
            return "a boolean mask index has a data-dependent number of elements"
    return None


class HostSyncAudit(TorchDispatchMode):
    """Raises ``HostSync`` on the first host read while active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            reason = host_read_reason(func, args, kwargs)
            if reason is not None:
                raise HostSync(f"{func}: {reason}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def audit_host_syncs():
    """Everything run inside raises ``HostSync`` on a host read (Triton interpreted launches
    exempt)."""
    mode = HostSyncAudit()
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu", "to")}
    own = {name for name in saved if name in vars(torch.Tensor)}

    def guarded(name):
        def method(self, *a, **k):
            if not mode.paused and (name != "to" or _to_host(a, k)):
                raise HostSync(f"Tensor.{name}(): reads device data on the host")
            return saved[name](self, *a, **k)
        return method

    grid_call = _interpreter_grid_call()
    try:
        for name in saved:
            setattr(torch.Tensor, name, guarded(name))
        if grid_call is not None:
            _set_grid_call(_paused_while(mode, grid_call))
        with mode:
            yield mode
    finally:
        for name, fn in saved.items():
            if name in own:
                setattr(torch.Tensor, name, fn)
            else:
                delattr(torch.Tensor, name)
        if grid_call is not None:
            _set_grid_call(grid_call)


def _to_host(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names the host as its target."""
    targets = list(args) + [kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu"
               for t in targets)


def _interpreter_grid_call():
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:
        return None
    return GridExecutor.__call__


def _set_grid_call(fn) -> None:
    from triton.runtime.interpreter import GridExecutor
    GridExecutor.__call__ = fn


def _paused_while(mode: HostSyncAudit, call):
    def wrapped(self, *args, **kwargs):
        mode.paused += 1
        try:
            with torch.utils._python_dispatch._disable_current_modes():
                return call(self, *args, **kwargs)
        finally:
            mode.paused -= 1
    return wrapped
