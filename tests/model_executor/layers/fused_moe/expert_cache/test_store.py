"""HostStore: built from the quant method's declaration, processed per expert on the host."""
import logging

import pytest
import torch
from torch import nn

from vllm.config import (CacheConfig, DeviceConfig, MoECacheConfig, SchedulerConfig, VllmConfig,
                         set_current_vllm_config)
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.expert_cache.slots import allocate_slots
from vllm.model_executor.layers.fused_moe.expert_cache.store import PIN_FAILED_MSG, HostStore
from vllm.model_executor.layers.fused_moe.torch_ref import expert_pairs_ref
from vllm.model_executor.layers.quantization.base import FusedMoEMethodBase

E, H, I = 8, 32, 16


class Int8ScaledMethod(FusedMoEMethodBase):
    """Toy quantized method: int8 weights, per-expert per-row fp32 scales, an int32 g_idx-like
    buffer and a shared (non-expert) input scale. Loaded layout of w2 is [E, I, H]; processing
    transposes it to [H, I] per expert and folds ``input_scale`` nowhere (it must stay put)."""

    def __init__(self):
        super().__init__()
        self.processed: list[tuple[str, torch.device]] = []

    def create_weights(self, layer, shape, device):
        e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
        for name, shp, dt in (("w13_qweight", (e, 2 * i, h), torch.int8),
                              ("w13_scale", (e, 2 * i), torch.float32),
                              ("w2_qweight", (e, i, h), torch.int8),
                              ("w2_scale", (e, h), torch.float32)):
            layer.register_parameter(name, nn.Parameter(torch.zeros(shp, dtype=dt, device=device),
                                                        requires_grad=False))
        layer.register_buffer("perm", torch.zeros(e, h, dtype=torch.int32, device=device))
        layer.register_buffer("input_scale", torch.ones((), device=device))
        self.input_scale = layer.input_scale    # shared by all experts: never in the store

    def expert_tensor_names(self):
        return ("w13_qweight", "w13_scale", "w2_qweight", "w2_scale", "perm")

    def process_expert(self, tensors):
        self.processed.append((str(tensors["w2_qweight"].shape), tensors["w2_qweight"].device))
        out = dict(tensors)
        out["w2_qweight"] = tensors["w2_qweight"].t().contiguous()       # [I, H] -> [H, I]
        return out

    def apply_pairs(self, weights, x, topk_weights, topk_ids, out, max_ids=None):
        # perm permutes the input features per expert; undo it through the expert's weights.
        xs = x * self.input_scale
        w13 = weights["w13_qweight"].float() * weights["w13_scale"][..., None]   # [n, 2I, H]
        w2 = weights["w2_qweight"].float() * weights["w2_scale"][..., None]      # [n, H, I]
        inv = torch.argsort(weights["perm"].long(), dim=-1)                      # [n, H]
        w13 = torch.gather(w13, 2, inv[:, None, :].expand_as(w13))
        expert_pairs_ref(xs, w13.to(x.dtype), w2.to(x.dtype), topk_weights, topk_ids, out)


def fill(layer, g):
    layer.w13_qweight.data.copy_(torch.randint(-127, 128, (E, 2 * I, H), generator=g))
    layer.w2_qweight.data.copy_(torch.randint(-127, 128, (E, I, H), generator=g))
    layer.w13_scale.data.copy_(torch.rand(E, 2 * I, generator=g) * 0.01)
    layer.w2_scale.data.copy_(torch.rand(E, H, generator=g) * 0.01)
    layer.perm.copy_(torch.stack([torch.randperm(H, generator=g) for _ in range(E)]))
    return layer


def experts_of(layer, names):
    return {n: getattr(layer, n) for n in names}


def make_layer(method, seed=0):
    from vllm.model_executor.layers.quantization.base import MoEShape
    layer = nn.Module()
    layer.quant_method = method
    method.create_weights(layer, MoEShape(E, H, I, torch.float32), torch.device("cpu"))
    return fill(layer, torch.Generator().manual_seed(seed))


def test_store_holds_every_declared_tensor_processed_per_expert_on_host():
    method = Int8ScaledMethod()
    layer = make_layer(method)
    loaded = {n: getattr(layer, n).clone() for n in method.expert_tensor_names()}
    store = HostStore.from_experts(experts_of(layer, method.expert_tensor_names()),
                                   method.process_expert, None)
    assert list(store.tensors) == list(method.expert_tensor_names())
    assert "input_scale" not in store.tensors
    assert len(method.processed) == E                       # once per expert, never batched
    assert all(shape == str(torch.Size([I, H])) and dev.type == "cpu"
               for shape, dev in method.processed)
    assert store.tensors["w2_qweight"].shape == (E, H, I)   # processed layout
    for e in range(E):
        assert torch.equal(store.tensors["w2_qweight"][e], loaded["w2_qweight"][e].t())
        for n in ("w13_qweight", "w13_scale", "w2_scale", "perm"):
            assert torch.equal(store.tensors[n][e], loaded[n][e])
            assert store.tensors[n].dtype == loaded[n].dtype
    want = sum(loaded[n][0].numel() * loaded[n].element_size() for n in loaded)
    assert store.bytes_per_expert == want
    assert not store.pinned


def test_slots_take_the_declared_names_and_kinds():
    method = Int8ScaledMethod()
    layer = make_layer(method)
    store = HostStore.from_experts(experts_of(layer, method.expert_tensor_names()),
                                   method.process_expert, None)
    slots = allocate_slots(store, 3, torch.device("cpu"))
    assert list(slots) == list(method.expert_tensor_names())
    for n, t in slots.items():
        assert t.shape == (3, *store.tensors[n].shape[1:]) and t.dtype == store.tensors[n].dtype
        assert t.data_ptr() != store.tensors[n].data_ptr()
    assert layer.input_scale.shape == ()                    # non-expert tensor untouched


def test_layer_holds_its_providers_slots_under_the_declared_names_and_kinds():
    layer = _moe(3)
    for n, t in layer.weight_provider.slot_weights().items():
        assert getattr(layer, n) is t and t.shape[0] == 3
    assert "perm" in layer._buffers and "w13_scale" in layer._parameters
    assert layer.input_scale.shape == ()


@pytest.mark.parametrize("bad", [0, E + 1])
def test_slot_count_out_of_range_is_rejected(bad):
    method = Int8ScaledMethod()
    layer = make_layer(method)
    store = HostStore.from_experts(experts_of(layer, method.expert_tensor_names()),
                                   method.process_expert, None)
    with pytest.raises(ValueError, match=f"moe_expert_cache_size={bad}"):
        allocate_slots(store, bad, torch.device("cpu"))


def test_bad_process_expert_is_rejected():
    method = Int8ScaledMethod()
    layer = make_layer(method)
    experts = experts_of(layer, method.expert_tensor_names())
    with pytest.raises(ValueError, match="exactly the declared names"):
        HostStore.from_experts(experts, lambda t: {"w13_qweight": t["w13_qweight"]}, None)
    calls = []

    def ragged(t):  # expert-dependent shape: not storable as one [E, ...] tensor
        calls.append(1)
        return {**t, "perm": t["perm"][: len(calls)]}
    with pytest.raises(ValueError, match="same for all"):
        HostStore.from_experts(experts, ragged, None)
    with pytest.raises(ValueError, match="declares no expert-indexed tensors"):
        HostStore.from_experts({}, method.process_expert, None)
    with pytest.raises(ValueError, match="is not a tensor"):
        HostStore.from_experts({"nope": None}, method.process_expert, None)


def test_pin_failure_falls_back_to_pageable_and_warns_once(vllm_log):
    calls = []

    def fail(shape, dtype):
        calls.append(shape)
        raise torch.OutOfMemoryError("simulated: cannot page-lock 4096 bytes of host memory")
    method = Int8ScaledMethod()
    names = method.expert_tensor_names()
    layers = [make_layer(method, s) for s in range(3)]
    stores = [HostStore.from_experts(experts_of(layer, names), method.process_expert, fail)
              for layer in layers]
    assert len(calls) == 3 and not any(s.pinned for s in stores)
    warnings = [r for r in vllm_log.records if r.getMessage() == PIN_FAILED_MSG]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    for layer, store in zip(layers, stores):  # the pageable store holds the same experts
        ref = HostStore.from_experts(experts_of(layer, names), method.process_expert, None)
        assert all(torch.equal(store.tensors[n], ref.tensors[n]) for n in names)


@pytest.mark.parametrize("error", [
    RuntimeError("empty_pinned: cudaHostAlloc of 4096 bytes failed with a CUDA error: an "
                 "illegal memory access was encountered"),
    RuntimeError("empty_pinned: an earlier CUDA call failed and its error is still pending"),
])
def test_a_pin_error_other_than_out_of_memory_propagates(vllm_log, error):
    """A CUDA fault surfacing in the pinned allocation (an earlier kernel's illegal address) is
    not a full machine: the store must not hide it behind a quiet pageable fallback."""
    made = []

    def fault_on_second(shape, dtype):
        if made:
            raise error
        made.append(torch.empty(shape, dtype=dtype))
        return made[-1]
    method = Int8ScaledMethod()
    layer = make_layer(method)
    with pytest.raises(RuntimeError) as info:
        HostStore.from_experts(experts_of(layer, method.expert_tensor_names()),
                               method.process_expert, fault_on_second)
    assert info.value is error and len(made) == 1
    assert PIN_FAILED_MSG not in vllm_log.text


def test_a_pinned_store_is_allocated_once_at_its_size_and_filled_in_place():
    """Each store tensor comes from ``empty_pinned`` at its final [E, ...] shape and dtype, and
    the store holds exactly those tensors, filled (no pageable copy pinned afterwards)."""
    made = []

    def fake_empty_pinned(shape, dtype):  # a CPU build cannot pin; record what would be
        t = torch.full(shape, 7, dtype=dtype)
        made.append(t)
        return t
    method = Int8ScaledMethod()
    names = method.expert_tensor_names()
    layer = make_layer(method)
    store = HostStore.from_experts(experts_of(layer, names), method.process_expert,
                                   fake_empty_pinned)
    ref = HostStore.from_experts(experts_of(layer, names), method.process_expert, None)
    assert store.pinned and not ref.pinned
    assert [t.data_ptr() for t in made] == [store.tensors[n].data_ptr() for n in names]
    for n in names:
        assert store.tensors[n].shape == ref.tensors[n].shape
        assert torch.equal(store.tensors[n], ref.tensors[n])


def _moe(cache_size):
    cfg = VllmConfig(None, CacheConfig(), SchedulerConfig(), MoECacheConfig(cache_size=cache_size),
                     DeviceConfig("cpu"))
    with set_current_vllm_config(cfg):
        layer = FusedMoE(E, 2, H, I, quant_method=Int8ScaledMethod())
        fill(layer, torch.Generator().manual_seed(3))
        layer.finish_loading(torch.device("cpu"))
    return layer


@pytest.mark.parametrize("n", [1, 3, 7])
def test_quantized_cached_layer_equals_uncached_bitwise(n):
    """Scales, the int g_idx-like buffer and the processed weights all follow their expert into
    its slot (bug #2 of the upstream proposal: scales indexed by global id, weights by slot)."""
    ref, cached = _moe(0), _moe(n)
    assert ref.w2_qweight.shape == (E, H, I) and cached.w2_qweight.shape == (n, H, I)
    g = torch.Generator().manual_seed(0)
    for T in (1, 6, 30, 2, 1):
        x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
        assert torch.equal(cached(x, logits), ref(x, logits))
