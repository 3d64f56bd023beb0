"""A CPU stand-in for a CUDA graph that keeps a graph's semantics: capturing records the work
and executes none of it; a replay runs exactly the recorded work over the same tensors and no
Python of the captured function. ``EagerCapturer`` re-runs the function at each replay, so
Python state that a real replay would not recompute (a flag, a counter, a choice made on the
host) is recomputed there and bugs of that kind pass; here they fail as they would on a GPU.

Recorded, in order:
- every Triton launch (interpreted): not run at capture, run at replay;
- every aten op outside a launch that computes something: not run at capture, which allocates
  its outputs (shapes and strides from the op run on meta tensors, as a graph's pool would);
  each replay runs it and copies its result into those tensors; an op that writes its
  arguments (``copy_``, ``index_put_``, ``out=``) returns them and runs at each replay;
- views and allocations run at capture only (a view of a recorded tensor stays one; an op
  that may be a view, ``reshape`` or ``contiguous``, is recorded as a computation where it
  copied);
- a graph break (``vllm.model_executor.graph_break``): its function is not run at capture; at
  each replay it runs eagerly at that point of the order, and its result is copied into the
  tensor the capture handed to the work after it (a break without one writes in place).
A host read of device data (``.item()``, ``.numpy()``, ``nonzero``: ``host_sync_audit``) raises
``HostSync`` during a capture, as a CUDA capture fails. Not
covered: work that bypasses the dispatcher (a ctypes kernel) would run at capture and never at
replay, so a test comparing with eager output catches it."""
from __future__ import annotations

import contextlib

import torch
from host_sync_audit import audit_host_syncs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from vllm.model_executor.graph_break import graph_breaks
from vllm.worker import cuda_graphs
from vllm.worker.graph_capture import GraphCapturer

def _is_view(func) -> bool:
    """All returns alias an input without writing it (a view, ``detach``, ``split``)."""
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write
                              for r in rets)


def _written_args(func, args, kwargs) -> list:
    """(argument schema, value) of each argument the op writes."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append((a, args[i] if i < len(args) else kwargs.get(a.name)))
    return out


def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0]
            if isinstance(t, torch.Tensor)}


def _meta(t):
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _allocated_like_meta(func, args, kwargs):
    """The op's outputs allocated (not computed) on the inputs' device: shapes, strides and
    dtypes from running it on meta tensors, as a capture allocates without computing."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        return func(*args, **kwargs)           # a factory (zeros, arange): no input data
    device = tensors[0].device
    margs, mkwargs = tree_map(_meta, (args, kwargs))
    out = func(*margs, **mkwargs)
    return tree_map(lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype,
                                                  device=device)
                    if isinstance(m, torch.Tensor) else m, out)


def _returns_of_write(func, written):
    """What an op that writes its arguments returns, without running it: the written
    arguments its returns alias (``add_`` returns self, ``out=`` ops their out)."""
    by_set = {frozenset(a.alias_info.before_set): v for a, v in written}
    rets = [by_set.get(frozenset(r.alias_info.before_set)) if r.alias_info is not None else None
            for r in func._schema.returns]
    if any(r is None for r in rets):
        return None
    return rets[0] if len(rets) == 1 else tuple(rets)


class _Recorder(TorchDispatchMode):
    def __init__(self, work: list):
        super().__init__()
        self.work = work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name.startswith("empty") or name == "new_empty":
            return func(*args, **kwargs)
        if func.is_view or _is_view(func):
            out = func(*args, **kwargs)
            # ``reshape`` and ``contiguous`` return a view when they can and a copy otherwise.
            if _storages(out) <= _storages((args, kwargs)):
                return out
            out = _allocated_like_meta(func, args, kwargs)
            self.work.append(("compute", func, args, kwargs, out))
            return out
        written = _written_args(func, args, kwargs)
        if written:
            out = _returns_of_write(func, written)
            if out is None:
                raise NotImplementedError(f"{func}: writes its arguments and returns others")
            self.work.append(("write", func, args, kwargs, None))
            return out
        out = _allocated_like_meta(func, args, kwargs)
        self.work.append(("compute", func, args, kwargs, out))
        return out


class RecordingCapturer(GraphCapturer):
    """``capture`` records (module docstring); ``replay`` runs the record. ``replays`` counts
    them; ``breaks`` counts the graph breaks met by captures."""

    def __init__(self):
        self.replays = 0
        self.breaks = 0

    def capture(self, fn):
        import triton.runtime.interpreter as interp
        work: list = []
        run = interp.InterpretedFunction.run

        def record_launch(kernel, *args, **kwargs):
            work.append(("launch", kernel, args, kwargs, None))

        def record_break(fn_, out_like):
            self.breaks += 1
            out = None
            if out_like is not None:
                with torch.inference_mode(False):
                    out = torch.empty_like(out_like)
            work.append(("break", fn_, (), {}, out))
            return out

        interp.InterpretedFunction.run = record_launch
        try:
            with graph_breaks(record_break), _Recorder(work), audit_host_syncs():
                out = fn()
        finally:
            interp.InterpretedFunction.run = run

        def replay():
            self.replays += 1
            for kind, f, args, kwargs, dst in work:
                if kind == "launch":
                    run(f, *args, **kwargs)
                elif kind == "break":
                    got = f()
                    if dst is not None:
                        dst.copy_(got)
                elif kind == "write":
                    f(*args, **kwargs)
                else:
                    _copy_into(dst, f(*args, **kwargs))
            return out
        return replay


def _copy_into(dst, src) -> None:
    for d, s in zip(tree_flatten(dst)[0], tree_flatten(src)[0]):
        if isinstance(d, torch.Tensor):
            d.copy_(s)


@contextlib.contextmanager
def recording(monkeypatch):
    """Decode graphs on CPU through a ``RecordingCapturer`` (yielded)."""
    capturer = RecordingCapturer()
    monkeypatch.setattr(cuda_graphs, "uses_cuda_graphs", lambda device: True)
    monkeypatch.setattr(cuda_graphs, "default_capturer", lambda device: capturer)
    yield capturer
