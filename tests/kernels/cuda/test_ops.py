"""Without a GPU: how the compiled CUDA ops are found and handed to the expert cache (the ops
themselves run in test_expert_gather.py, on a GPU)."""
from __future__ import annotations

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
    store = HostStore.from_experts(weights, lambda t: t, pin=False)
    slots = {n: torch.zeros(2, *t.shape[1:]) for n, t in weights.items()}
    plan = LoadPlan(slots=torch.tensor([1, 0]), experts=torch.tensor([3, -1]),
                    valid=torch.tensor([True, False]))
    return store, slots, plan


def test_cuda_copy_calls_the_platform_kernel_once_per_tensor(monkeypatch):
    calls = []

    def fake(src, dst, experts, slots, valid):
        calls.append((src, dst, experts, slots, valid))
    monkeypatch.setattr(type(platform_for("cuda")), "expert_copy_kernel", lambda self: fake)
    store, slots, plan = _store_slots_plan()
    copy_mod._copy_cuda(store, slots, plan)
    assert [(c[0] is store.tensors[n], c[1] is slots[n]) for c, n in zip(calls, store.tensors)] \
        == [(True, True)] * 2
    assert all(c[2] is plan.experts and c[3] is plan.slots and c[4] is plan.valid for c in calls)


def test_cuda_copy_without_a_kernel_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(type(platform_for("cuda")), "expert_copy_kernel", lambda self: None)
    store, slots, plan = _store_slots_plan()
    copy_mod._copy_cuda(store, slots, plan)
    assert torch.equal(slots["w13_weight"][1], store.tensors["w13_weight"][3])
    assert torch.equal(slots["w13_scale"], torch.tensor([[0.], [3.]]))
    assert torch.equal(slots["w13_weight"][0], torch.zeros(2, 3))
