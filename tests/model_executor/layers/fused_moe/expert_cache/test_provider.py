"""The weight-provider seam: the layer's one call path with and without a cache, and what the
CachedWeightProvider owns."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from vllm.config import (CacheConfig, DeviceConfig, MoECacheConfig, SchedulerConfig, VllmConfig,
                         set_current_vllm_config)
from vllm.model_executor.layers.fused_moe.expert_cache import (CachedWeightProvider,
                                                               IdentityProvider)
from vllm.model_executor.layers.fused_moe.layer import FusedMoE

E, H, I, K = 8, 32, 16, 2


def build(cache_size: int, policy: str = "auto") -> FusedMoE:
    """A float32 FusedMoE layer with random experts, loaded (``test_prefetch.py`` uses it too)."""
    g = torch.Generator().manual_seed(0)
    cfg = VllmConfig(None, CacheConfig(), SchedulerConfig(),
                     MoECacheConfig(cache_size=cache_size, policy=policy), DeviceConfig("cpu"))
    with set_current_vllm_config(cfg):
        layer = FusedMoE(E, K, H, I, params_dtype=torch.float32)
    layer.load_expert_weight("w13_weight", torch.randn(E, 2 * I, H, generator=g), None, None)
    layer.load_expert_weight("w2_weight", torch.randn(E, H, I, generator=g), None, None)
    layer.finish_loading(torch.device("cpu"))
    return layer


@pytest.mark.parametrize("cache_size,kind", [(0, IdentityProvider), (E, IdentityProvider),
                                             (3, CachedWeightProvider)])
def test_one_call_path_for_every_provider(cache_size, kind, monkeypatch):
    """forward = route -> provider.prepare -> quant_method.apply(provider.slot_weights(), waves):
    the same calls whatever the provider (no branch in the layer)."""
    layer = build(cache_size)
    provider = layer.weight_provider
    assert type(provider) is kind and (layer.expert_cache is provider) == provider.cached
    calls = []
    real_prepare, real_apply = provider.prepare, layer.quant_method.apply

    def prepare(ids, row_slots=None):
        calls.append(("prepare", ids))
        return real_prepare(ids, row_slots)

    def apply(weights, x, topk_weights, waves, host_pairs=None):
        calls.append(("apply", weights))
        return real_apply(weights, x, topk_weights, waves, host_pairs=host_pairs)
    monkeypatch.setattr(provider, "prepare", prepare)
    monkeypatch.setattr(layer.quant_method, "apply", apply)
    layer(torch.randn(4, H), torch.randn(4, E))
    assert [c[0] for c in calls] == ["prepare", "apply"]
    assert calls[1][1] is provider.slot_weights()


def test_identity_provider_passes_ids_through():
    layer = build(0)
    ids = torch.tensor([[0, 7], [3, -1]])
    waves = layer.weight_provider.prepare(ids)
    assert len(waves) == 1 and waves[0].ids is ids and waves[0].max_ids is None
    weights = layer.weight_provider.slot_weights()
    assert weights["w13_weight"].shape[0] == E and layer.w13_weight is weights["w13_weight"]


@pytest.mark.parametrize("n,T", [(3, 1), (3, 4), (1, 3), (7, 8)])
def test_cached_plan_waves_cover_every_pair_once_with_slot_ids(n, T):
    layer = build(n)
    provider = layer.expert_cache
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[0, 1] = -1                                                     # a skipped pair stays -1
    plan = provider.prepare(ids)
    assert len(plan) == math.ceil(min(E, T * K) / n)
    covered = torch.zeros_like(ids)
    for w, wave in enumerate(plan):
        slot_ids = wave.ids
        assert ((slot_ids >= -1) & (slot_ids < n)).all()
        # the bound the kernels size their grids by holds, and is the ranks left for wave w
        assert slot_ids[slot_ids >= 0].unique().numel() <= wave.max_ids
        assert wave.max_ids == min(n, min(E, T * K) - w * n)
        hit = slot_ids >= 0
        covered += hit.long()
        # each slot the wave names holds the weights of the expert its pairs were routed to,
        # right now (the maps already hold the last wave's residency: the fused step plans
        # all waves in one call; the copies run wave by wave)
        for name, slot in provider.slot_weights().items():
            assert torch.equal(slot[slot_ids[hit]], provider.store.tensors[name][ids[hit]])
    assert torch.equal(covered, (ids >= 0).long())


@pytest.mark.parametrize("n,T", [(3, 4), (1, 3), (7, 8)])
def test_one_residency_call_per_step_however_many_waves(n, T):
    """Issue 26: the fused step is one kernel call per layer and step; it plans every wave,
    and the copies of each wave still run before that wave's kernels (the outputs equal the
    uncached layer's)."""
    layer, ref = build(n), build(0)
    provider = layer.expert_cache
    calls, kernel = [], provider.step.kernel

    def counting_kernel(*args, **kwargs):
        calls.append(kwargs.get("num_waves", 1))
        kernel(*args, **kwargs)
    provider.step.kernel = counting_kernel
    g = torch.Generator().manual_seed(n + T)
    for _ in range(4):
        x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
        calls.clear()
        assert torch.equal(layer(x, logits), ref(x, logits))
        assert calls == [math.ceil(min(E, T * K) / n)] and calls[0] > 1


def test_a_step_stopped_part_way_leaves_no_uncopied_slot_trusted(monkeypatch):
    """The fused step plans all waves first; a wave's kernels raising stops the step before
    the later waves' copies. The next step must not hit on those experts (their slots hold
    other weights): it equals the uncached layer's."""
    layer, ref = build(3), build(0)
    g = torch.Generator().manual_seed(5)
    x, logits = torch.randn(4, H, generator=g), torch.randn(4, E, generator=g)
    real = layer.quant_method.apply_pairs

    def failing(*args, **kwargs):
        raise RuntimeError("a wave's kernel failed")
    monkeypatch.setattr(layer.quant_method, "apply_pairs", failing)
    with pytest.raises(RuntimeError, match="kernel failed"):
        layer(x, logits)
    assert (layer.expert_cache.residency.slot_of_expert == -1).all()
    monkeypatch.setattr(layer.quant_method, "apply_pairs", real)
    assert torch.equal(layer(x, logits), ref(x, logits))


@pytest.mark.parametrize("n,T", [(7, 1), (7, 2), (3, 1), (3, 4), (1, 3)])
def test_the_copy_gets_only_the_entries_a_wave_can_load(n, T):
    """Each wave's copy gets the plan's first min(N, D - w N) entries (D = min(E, T*K) experts
    at most, ranked into waves of N), the most wave w can load (a GPU copy's grid covers them
    all), and every expert the wave loads is among them."""
    layer = build(n)
    provider = layer.expert_cache
    inner, sizes = provider.copy, []

    def recording_copy(slots, plan):
        sizes.append(plan.valid.numel())
        inner(slots, plan)
    provider.copy = recording_copy
    g = torch.Generator().manual_seed(n * 10 + T)
    D = min(E, T * K)
    per_step = [min(n, D - w * n) for w in range(math.ceil(D / n))]
    for _ in range(6):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        sizes.clear()
        for wave in provider.prepare(ids):
            slot_ids = wave.ids
            hit = slot_ids >= 0
            # every slot the wave reads holds its expert: the copy loaded all the misses
            for name, slot in provider.slot_weights().items():
                store = provider.store.tensors[name]
                assert torch.equal(slot[slot_ids[hit]], store[ids[hit]])
        # on the host the waves past the step's own count are skipped: a prefix of the bound's
        assert sizes and sizes == per_step[:len(sizes)]


def test_cached_provider_owns_store_slots_and_state_not_the_layer():
    layer = build(3)
    provider = layer.expert_cache
    assert isinstance(provider, CachedWeightProvider) and not isinstance(provider, nn.Module)
    assert not any(isinstance(v, nn.Module) for v in vars(provider).values())
    assert provider.names == ("w13_weight", "w2_weight")
    for name, slot in provider.slot_weights().items():
        assert getattr(layer, name) is slot and slot.shape[0] == 3
        assert provider.store.tensors[name].shape[0] == E
    assert provider.num_slots == 3 and provider.num_experts == E


def test_unknown_policy_rejected_when_the_layer_is_built():
    with pytest.raises(ValueError, match=r"moe_expert_cache_policy='belady' is invalid"):
        cfg = VllmConfig(None, CacheConfig(), SchedulerConfig(),
                         MoECacheConfig(cache_size=3, policy="belady"), DeviceConfig("cpu"))
        with set_current_vllm_config(cfg):
            layer = FusedMoE(E, K, H, I, params_dtype=torch.float32)
        layer.finish_loading(torch.device("cpu"))
