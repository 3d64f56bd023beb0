"""Without a GPU: how the compiled CUDA ops are found and handed to the expert cache (the ops
themselves run in test_expert_gather.py, on a GPU)."""
from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from vllm.kernels.cuda import ops
from vllm.model_executor.layers.fused_moe.expert_cache import copy as copy_mod
from vllm.model_executor.layers.fused_moe.expert_cache.residency import LoadPlan
from vllm.model_executor.layers.fused_moe.expert_cache.store import HostStore
from vllm.platforms import platform_for


@pytest.fixture
def fresh_loader():
    ops.load_cuda_ops.cache_clear()
    yield
    ops.load_cuda_ops.cache_clear()


def _triton_gather():
    """The copy kernel the CUDA platform hands out without vllm._C: the Triton gather, or None
    where triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    from vllm.kernels.triton.expert_gather import expert_gather
    return expert_gather


@pytest.mark.skipif(importlib.util.find_spec("vllm._C") is not None, reason="vllm._C is built")
def test_without_a_cuda_build_there_are_no_ops(fresh_loader):
    assert ops.load_cuda_ops() is False
    assert platform_for("cuda").expert_copy_kernel() is _triton_gather()
    many = platform_for("cuda").expert_copy_many_kernel()
    if importlib.util.find_spec("triton") is None:
        assert many is None
    else:
        from vllm.kernels.triton.expert_gather_many import expert_gather_many
        assert many is expert_gather_many


def test_vllm_cuda_ops_0_turns_them_off(fresh_loader, monkeypatch):
    monkeypatch.setenv("VLLM_CUDA_OPS", "0")
    assert ops.load_cuda_ops() is False
    assert platform_for("cuda").expert_copy_kernel() is _triton_gather()


def test_cpu_platform_copies_with_its_c_kernel():
    from vllm.kernels.cpu import moe_cache
    assert platform_for("cpu").expert_copy_kernel() is moe_cache.expert_copy


def _store_slots_plan():
    weights = {"w13_weight": torch.arange(4 * 6.).view(4, 2, 3),
               "w13_scale": torch.arange(4.).view(4, 1)}
    store = HostStore.from_experts(weights, lambda t: t, None)
    slots = {n: torch.zeros(2, *t.shape[1:]) for n, t in weights.items()}
    plan = LoadPlan(slots=torch.tensor([1, 0]), experts=torch.tensor([3, -1]),
                    valid=torch.tensor([True, False]))
    return store, slots, plan


def test_cuda_copy_calls_the_platform_kernel_once_per_tensor(monkeypatch):
    calls = []

    def fake(src, dst, experts, slots, valid):
        calls.append((src, dst, experts, slots, valid))
    monkeypatch.setattr(type(platform_for("cuda")), "expert_copy_kernel", lambda self: fake)
    monkeypatch.setattr(type(platform_for("cuda")), "expert_copy_many_kernel", lambda self: None)
    store, slots, plan = _store_slots_plan()
    copy_mod._copy_cuda(store, slots, plan)
    assert [(c[0] is store.tensors[n], c[1] is slots[n]) for c, n in zip(calls, store.tensors)] \
        == [(True, True)] * 2
    assert all(c[2] is plan.experts and c[3] is plan.slots and c[4] is plan.valid for c in calls)


def test_cuda_copy_launches_once_for_all_tensors_with_the_many_kernel(monkeypatch):
    """With ``expert_gather_many`` (a CUDA build) a layer's tensors go in one call, in the
    store's order, paired with their slots; the one-tensor kernel is not called."""
    many_calls, one_calls = [], []
    cuda = type(platform_for("cuda"))
    monkeypatch.setattr(cuda, "expert_copy_many_kernel",
                        lambda self: lambda *args: many_calls.append(args))
    monkeypatch.setattr(cuda, "expert_copy_kernel",
                        lambda self: lambda *args: one_calls.append(args))
    store, slots, plan = _store_slots_plan()
    copy_mod._copy_cuda(store, slots, plan)
    assert len(many_calls) == 1 and not one_calls
    srcs, dsts, experts, slot_ids, valid = many_calls[0]
    assert [s is store.tensors[n] for s, n in zip(srcs, store.tensors)] == [True, True]
    assert [d is slots[n] for d, n in zip(dsts, store.tensors)] == [True, True]
    assert experts is plan.experts and slot_ids is plan.slots and valid is plan.valid


def test_a_registered_copy_kernel_takes_precedence_over_the_many_kernel(monkeypatch):
    many_calls, registered = [], []
    monkeypatch.setattr(type(platform_for("cuda")), "expert_copy_many_kernel",
                        lambda self: lambda *args: many_calls.append(args))
    copy_mod.register_cuda_copy_kernel(lambda *args: registered.append(args))
    try:
        store, slots, plan = _store_slots_plan()
        copy_mod._copy_cuda(store, slots, plan)
    finally:
        copy_mod.register_cuda_copy_kernel(None)
    assert len(registered) == 2 and not many_calls


def test_cuda_copy_without_a_kernel_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(type(platform_for("cuda")), "expert_copy_kernel", lambda self: None)
    monkeypatch.setattr(type(platform_for("cuda")), "expert_copy_many_kernel", lambda self: None)
    store, slots, plan = _store_slots_plan()
    copy_mod._copy_cuda(store, slots, plan)
    assert torch.equal(slots["w13_weight"][1], store.tensors["w13_weight"][3])
    assert torch.equal(slots["w13_scale"], torch.tensor([[0.], [3.]]))
    assert torch.equal(slots["w13_weight"][0], torch.zeros(2, 3))


def test_a_build_that_fails_to_load_is_refused_with_a_warning(fresh_loader, monkeypatch,
                                                              vllm_log):
    """Not only ImportError: a .so that raises while registering (e.g. a duplicate op) leaves
    the torch and Triton paths running, and says why."""
    import sys

    class Broken:
        def find_spec(self, name, path=None, target=None):
            if name == "vllm._C":
                raise RuntimeError("Tried to register an operator with the same name twice")
            return None
    monkeypatch.delitem(sys.modules, "vllm._C", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    assert ops.load_cuda_ops() is False
    assert "vllm._C failed to load (RuntimeError: Tried to register" in vllm_log.text


_COMPILE_OPAQUE = r"""
import torch
lib = torch.library.Library("_C", "DEF")
lib.define("expert_gather(Tensor src, Tensor(a!) dst, Tensor experts, Tensor slots, "
           "Tensor valid) -> ()")

def gather(src, dst, experts, slots, valid):      # stand-in body on CPU
    for i in range(experts.shape[0]):
        if bool(valid[i]):
            dst[int(slots[i])] = src[int(experts[i])]
lib.impl("expert_gather", gather, "CPU")

def step(src, dst, experts, slots, valid):
    torch.ops._C.expert_gather(src, dst, experts, slots, valid)
    return dst * 2

src, dst = torch.arange(12.).view(4, 3), torch.zeros(2, 3)
args = (torch.tensor([3, 1]), torch.tensor([1, 0]), torch.tensor([True, False]))
try:
    out = torch.compile(step, fullgraph=True, backend="eager")(src, dst, *args)
    print("compiled", out.tolist())
except Exception as e:
    print("failed", type(e).__name__)
"""


def test_torch_compile_traces_the_gather_op_whole():
    """``_C::expert_gather`` (schema as csrc/torch_bindings.cpp: it only writes ``dst``, returns
    nothing) needs no fake implementation: a fullgraph compile keeps it as one opaque call, and
    runs it. A fresh interpreter, for the stand-in op library."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _COMPILE_OPAQUE], capture_output=True,
                         text=True, timeout=300).stdout
    assert "compiled [[0.0, 0.0, 0.0], [18.0, 20.0, 22.0]]" in out, out


def test_cuda_store_pinning_uses_the_exact_size_op_when_built(monkeypatch, vllm_log):
    made = []

    def fake(shape, dtype, device):
        made.append((tuple(shape), dtype, device))
        return torch.empty(shape, dtype=dtype)
    monkeypatch.setattr(ops, "has_empty_pinned", lambda: True)
    monkeypatch.setattr(ops, "empty_pinned", fake)
    t = platform_for("cuda").empty_pinned((3, 5), torch.bfloat16, torch.device("cuda:1"))
    assert made == [((3, 5), torch.bfloat16, torch.device("cuda:1"))] and t.shape == (3, 5)
    from vllm.platforms.cuda import PINNED_ROUNDING_MSG
    assert PINNED_ROUNDING_MSG not in vllm_log.text


def test_cuda_store_pinning_without_the_op_is_torch_s_and_says_it_rounds(monkeypatch,
                                                                         vllm_log):
    """Without vllm._C the store is pinned by torch (torch.empty(pin_memory=True)) after one
    warning that names why the exact-size allocator is not there."""
    from vllm.platforms.cuda import PINNED_ROUNDING_MSG
    monkeypatch.setattr(ops, "has_empty_pinned", lambda: False)
    monkeypatch.setattr(ops, "empty_pinned", None)
    monkeypatch.setattr(ops, "empty_pinned_missing_reason", lambda: "REASON")
    requests = []
    real_empty = torch.empty

    def recording_empty(*shape, **kw):
        requests.append(kw.get("pin_memory"))
        return real_empty(*shape, **{k: v for k, v in kw.items() if k != "pin_memory"})
    monkeypatch.setattr(torch, "empty", recording_empty)
    for _ in range(2):
        platform_for("cuda").empty_pinned((2, 2), torch.float32)
    assert requests == [True, True]
    assert vllm_log.text.count(PINNED_ROUNDING_MSG.format(reason="REASON")) == 1


def test_the_rounding_warning_names_each_cause(fresh_loader, monkeypatch):
    """VLLM_CUDA_OPS=0, no vllm._C (or one that fails to load), and a build older than the
    allocator are fixed differently, so the warning says which it is."""
    monkeypatch.setenv("VLLM_CUDA_OPS", "0")
    assert ops.empty_pinned_missing_reason() == "VLLM_CUDA_OPS=0 turns vllm._C's ops off"
    monkeypatch.delenv("VLLM_CUDA_OPS")
    monkeypatch.setattr(ops, "_load_failure", ["vllm._C failed to load (OSError: bad)"])
    monkeypatch.setattr(ops, "load_cuda_ops", lambda: False)
    assert ops.empty_pinned_missing_reason() == "vllm._C failed to load (OSError: bad)"
    monkeypatch.setattr(ops, "load_cuda_ops", lambda: True)
    assert "predates the exact-size allocator" in ops.empty_pinned_missing_reason()


@pytest.mark.skipif(importlib.util.find_spec("vllm._C") is not None, reason="vllm._C is built")
def test_without_a_cuda_build_the_reason_is_the_missing_module(fresh_loader):
    assert ops.empty_pinned_missing_reason().startswith("vllm._C is not built (import failed: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA torch can pin")
def test_torch_s_pin_without_an_accelerator_is_out_of_memory_for_the_store():
    """A CPU build of torch has no pinned allocator: that is "no lockable memory" to the store,
    which then goes pageable (it falls back on torch.OutOfMemoryError only)."""
    with pytest.raises(torch.OutOfMemoryError, match="cannot page-lock"):
        platform_for("cuda").empty_pinned((2, 2), torch.float32)


class _AcceleratorError(RuntimeError):
    """torch.AcceleratorError as torch's pinned allocator raises it: the CUDA code attached."""

    def __init__(self, msg, code):
        super().__init__(msg)
        self.error_code = code


@pytest.mark.parametrize("error,oom", [
    (_AcceleratorError("CUDA error: out of memory", 2), True),
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors ..."), True),  # torch < 2.8
    (_AcceleratorError("CUDA error: an illegal memory access was encountered", 700), False),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
])
def test_torch_s_pin_failure_is_out_of_memory_only_for_want_of_memory(monkeypatch, error, oom):
    """The fallback pinning (torch's allocator) raises torch.OutOfMemoryError only when no
    memory is left to lock; a CUDA fault propagates as raised, so the store does not hide it."""
    from vllm.platforms import interface
    monkeypatch.setattr(ops, "has_empty_pinned", lambda: False)
    monkeypatch.setattr(interface, "_has_accelerator", lambda: True)

    def failing_empty(*shape, **kw):
        raise error
    monkeypatch.setattr(torch, "empty", failing_empty)
    with pytest.raises(RuntimeError) as info:
        platform_for("cuda").empty_pinned((2, 2), torch.float32)
    if oom:
        assert isinstance(info.value, torch.OutOfMemoryError)
        assert info.value.__cause__ is error and "cannot page-lock (2, 2)" in str(info.value)
    else:
        assert info.value is error


# ---- the Python side of the compiled ops: checks first, failures as statuses ---------------


def test_the_gathers_refuse_bad_arguments_before_calling_the_op(monkeypatch):
    """Bad input never reaches the C++ checks (whose exception crashed the H100 image's
    process): a ValueError naming the value comes first, and the op is not called."""
    called = []
    for name in ("expert_gather", "expert_gather_many"):
        monkeypatch.setattr(torch.ops._C, name, lambda *a: called.append(a), raising=False)
    ids = torch.zeros(2, dtype=torch.int64)
    ok = torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"expert_gather: dst on cpu, src on cpu: dst must be "
                                         r"a CUDA tensor$"):
        ops.expert_gather(torch.zeros(4, 8), torch.zeros(2, 8), ids, ids, ok)
    with pytest.raises(ValueError, match="expert_gather: src dtype torch.float32 != dst dtype "
                                         "torch.float16"):
        ops.expert_gather(torch.zeros(4, 8), torch.zeros(2, 8, dtype=torch.float16), ids, ids,
                          ok)
    with pytest.raises(ValueError, match="expert_gather_many: needs as many srcs as dsts, at "
                                         "least one: got 0 and 0"):
        ops.expert_gather_many([], [], ids, ids, ok)
    with pytest.raises(ValueError, match="expert_gather_many: dst on cpu, src on cpu"):
        ops.expert_gather_many([torch.zeros(4, 8)], [torch.zeros(2, 8)], ids, ids, ok)
    assert called == []


@pytest.fixture
def fake_pinned_op(monkeypatch):
    """``torch.ops._C.try_empty_pinned`` answering the statuses queued in the returned list
    (csrc/memory/pinned_host.h: 0 ok, 1 out of memory, 2 another CUDA error)."""
    answers = []

    def try_empty_pinned(size, dtype):
        status, error = answers.pop(0)
        return torch.empty(size if status == 0 else (0,), dtype=dtype), status, error
    monkeypatch.setattr(torch.ops._C, "try_empty_pinned", try_empty_pinned, raising=False)
    monkeypatch.setattr(torch.ops._C, "cuda_error_string", lambda code: f"<cuda error {code}>",
                        raising=False)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return answers


def test_empty_pinned_turns_the_op_status_into_the_right_error(fake_pinned_op):
    fake_pinned_op += [(1, 2), (2, 999), (0, 0)]
    with pytest.raises(torch.OutOfMemoryError, match=r"^empty_pinned: cannot page-lock 12 bytes "
                                                     r"of host memory: <cuda error 2>$"):
        ops.empty_pinned((3,), torch.float32)
    with pytest.raises(RuntimeError, match=r"^empty_pinned: cudaHostAlloc of 12 bytes failed "
                                           r"with a CUDA error: <cuda error 999>$") as fault:
        ops.empty_pinned((3,), torch.float32)
    assert not isinstance(fault.value, torch.OutOfMemoryError)   # a fault is not a full machine
    assert ops.empty_pinned((2, 5), torch.bfloat16).shape == (2, 5)


@pytest.mark.parametrize("shape,match", [((3, -1), r"non-negative integers, got \[3, -1\]"),
                                         ((2.0,), r"non-negative integers, got \[2.0\]"),
                                         ((True,), r"non-negative integers, got \[True\]"),
                                         ((1 << 31, 1 << 31), "more than 2\\^63")])
def test_empty_pinned_refuses_bad_sizes_without_calling_the_op(fake_pinned_op, shape, match):
    with pytest.raises(ValueError, match=match):
        ops.empty_pinned(shape, torch.float32)      # no answer queued: a call would fail
