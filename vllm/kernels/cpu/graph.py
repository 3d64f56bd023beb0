"""CPU graphs: record the C kernel calls of one forward pass, then replay them from one C call.

What CUDA graphs do for a GPU step, for the CPU kernels: a decode step of the small default
model is a few ms of kernels and about 1 ms of Python around them (module calls, argument
checks, ``torch.empty``, ctypes), and the Python part does not shrink with more threads.

Capture runs the forward once, eagerly (its results are the step's results), while
- every kernel call made through ``launch`` is appended to the graph as a node, with its
  pointers and sizes as they were;
- a ``TorchDispatchMode`` sees every torch op: views and allocations need no node (the
  graph keeps every tensor it saw alive, so their memory stays put), the few computing ops of
  a decode step become nodes with a C equivalent (``graph.c``: add, dtype conversion, zero
  fill, embedding), and any other op refuses the capture (``GraphCaptureError``), because
  replay would not run it.

Replay (``CpuGraph.replay``) is then exact when the caller keeps the contract: the same
modules and weights, and new inputs written into the very tensors the capture read (static
buffers), with no Python-side decision of the forward depending on what changed (the runner
only captures decode-only steps of one batch size, without the expert cache or routing
observers, whose per-step state is Python's). Kernels return the same bits for the same
inputs whether called from Python or the graph.
"""
from __future__ import annotations

import contextlib
import ctypes
import struct

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vllm.kernels.cpu.build import SIGNATURES, load_cpu_kernels

_aten = torch.ops.aten
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_ACTIVE: "CpuGraph | None" = None
"""The graph being captured, if any (captures do not nest; one forward runs at a time)."""


class GraphCaptureError(RuntimeError):
    """The forward did something a replay would not repeat; it must run eagerly."""


def capturing() -> bool:
    """Whether a CPU graph capture is running (code whose Python decides what runs, e.g. how many
    expert-cache waves, must then take its static path)."""
    return _ACTIVE is not None


def launch(name: str, *args) -> int:
    """Call kernel ``name`` (the ctypes function, so a profiler that wraps it still sees the
    call) and, during a capture, append the call to the graph."""
    rc = getattr(load_cpu_kernels(), name)(*args)
    if _ACTIVE is not None and not rc:
        _ACTIVE.add_kernel(name, args)
    return rc


def _float_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _op_codes() -> dict[str, int]:
    names = load_cpu_kernels().graph_op_names().decode().split(",")
    return {n: i for i, n in enumerate(names)}


class CpuGraph:
    """One recorded forward: a program for ``run_graph`` plus every tensor it points into."""

    def __init__(self):
        self._codes = _op_codes()
        self._prog: list[int] = []
        self._names: list[str] = []       # node index -> op name, for error messages
        self._keep: list[torch.Tensor] = []
        self._buf: torch.Tensor | None = None
        self.nbytes = 0
        """Bytes of the tensors allocated during the capture, by ``empty*`` or by an op that
        became a node (what keeping the graph costs)."""

    def add_kernel(self, name: str, args: tuple) -> None:
        if name not in self._codes:
            raise GraphCaptureError(f"kernel {name} has no CPU graph node")
        types = SIGNATURES[name]
        vals = [_float_bits(a) if t is ctypes.c_float else int(a or 0) for a, t in zip(args, types)]
        self._add(name, vals)

    def _add(self, name: str, vals: list[int]) -> None:
        if self._buf is not None:
            raise RuntimeError("CpuGraph: cannot add nodes to a finished graph")
        self._prog += [self._codes[name], len(vals), *vals]
        self._names.append(name)

    def keep(self, tensors) -> None:
        self._keep.extend(t for t in tensors if isinstance(t, torch.Tensor))

    def finish(self) -> None:
        self._buf = torch.tensor(self._prog, dtype=torch.int64)

    @property
    def num_nodes(self) -> int:
        return len(self._names)

    def replay(self) -> None:
        """Run every node in order (raises if one fails, naming it)."""
        if self._buf is None:
            raise RuntimeError("CpuGraph.replay before finish()")
        failed = ctypes.c_int64(-1)
        rc = load_cpu_kernels().run_graph(self._buf.data_ptr(), self._buf.numel(),
                                          ctypes.byref(failed))
        if rc:
            i = failed.value
            name = self._names[i] if 0 <= i < len(self._names) else "?"
            raise RuntimeError(f"CPU graph replay: node {i} ({name}) failed with code {rc}")

    # ---- torch ops seen during capture -----------------------------------------------------
    def torch_op(self, func, args: tuple, kwargs: dict, out) -> None:
        """Add the node that repeats ``func`` (already run), or refuse the capture."""
        if func in _ALLOCATING:
            self.nbytes += out.untyped_storage().nbytes()
        if func in _NO_NODE:
            return
        handler = _HANDLERS.get(func)
        if handler is None:
            raise GraphCaptureError(f"torch op {func} has no CPU graph node")
        handler(self, args, kwargs, out)


def _flat(t: torch.Tensor, what: str) -> tuple[int, int]:
    """(pointer, dtype code) of a contiguous f32/bf16 tensor, else refuse."""
    if not t.is_contiguous() or t.dtype not in _DTYPE_CODES:
        raise GraphCaptureError(f"{what}: needs a contiguous f32/bf16 tensor, got {t.dtype} "
                                f"{tuple(t.shape)} strides {t.stride()}")
    return t.data_ptr(), _DTYPE_CODES[t.dtype]


def _add_node(g: CpuGraph, args, kwargs, out) -> None:
    a, b = args[0], args[1]
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    if not (isinstance(b, torch.Tensor) and a.shape == b.shape == out.shape
            and a.dtype == b.dtype == out.dtype and alpha == 1):
        raise GraphCaptureError(f"add of {tuple(a.shape)} and {getattr(b, 'shape', b)} "
                                "(only same-shape, same-dtype tensors)")
    pa, code = _flat(a, "add")
    g.nbytes += out.untyped_storage().nbytes()
    g._add("add", [pa, _flat(b, "add")[0], _flat(out, "add")[0], out.numel(), code])


def _convert_node(g: CpuGraph, args, kwargs, out) -> None:
    src = args[0]
    if out.data_ptr() == src.data_ptr() and out.dtype == src.dtype:
        return                                           # .to() of a tensor already in dtype
    ps, cs = _flat(src, "to(dtype)")
    po, co = _flat(out, "to(dtype)")
    g.nbytes += out.untyped_storage().nbytes()
    g._add("convert", [ps, po, out.numel(), cs, co])


def _zero_node(g: CpuGraph, args, kwargs, out) -> None:
    t = args[0]
    if not t.is_contiguous():
        raise GraphCaptureError("zero_ of a non-contiguous tensor")
    g._add("zero", [t.data_ptr(), t.numel() * t.element_size()])


def _embedding_node(g: CpuGraph, args, kwargs, out) -> None:
    weight, ids = args[0], args[1]
    if not (weight.dim() == 2 and weight.is_contiguous() and ids.dtype == torch.int64
            and ids.is_contiguous() and out.is_contiguous()):
        raise GraphCaptureError("embedding: needs a contiguous 2-d weight and int64 ids")
    g.nbytes += out.untyped_storage().nbytes()
    g._add("embedding", [weight.data_ptr(), ids.data_ptr(), out.data_ptr(), ids.numel(),
                         weight.stride(0) * weight.element_size(), weight.shape[0]])


_NO_NODE = {
    # Views and allocations: the graph keeps the tensors, so their memory does not move.
    _aten.view.default, _aten._unsafe_view.default, _aten.select.int, _aten.slice.Tensor,
    _aten.alias.default, _aten.detach.default, _aten.as_strided.default,
    _aten.unsqueeze.default, _aten.squeeze.dim, _aten.t.default, _aten.transpose.int,
    _aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
}
_ALLOCATING = {_aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default}
_HANDLERS = {
    _aten.add.Tensor: _add_node,
    _aten.to.dtype: _convert_node,
    _aten._to_copy.default: _convert_node,
    _aten.zero_.default: _zero_node,
    _aten.embedding.default: _embedding_node,
}


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: CpuGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.graph.keep(tree_flatten((args, kwargs, out))[0])
        self.graph.torch_op(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def capture(graph: CpuGraph):
    """Record into ``graph`` every kernel and torch op run inside the block; ``finish()`` it
    after. Raises ``GraphCaptureError`` (from the op) when the block cannot be replayed."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("CPU graph captures do not nest")
    _ACTIVE = graph
    try:
        with _Recorder(graph):
            yield graph
    finally:
        _ACTIVE = None
