"""Edge cases of the cached forward: skipped (negative) ids, empty batches, out-of-range ids."""
from __future__ import annotations

import pytest
import torch

from vllm.config import (CacheConfig, DeviceConfig, KernelConfig, MoECacheConfig, SchedulerConfig,
                         VllmConfig, set_current_vllm_config)
from vllm.model_executor.layers.fused_moe.grouped_mm import expert_pairs_grouped
from vllm.model_executor.layers.fused_moe.layer import FusedMoE

E, H, I = 8, 32, 16


def _layer(n, backend, w):
    cfg = VllmConfig(None, CacheConfig(), SchedulerConfig(), MoECacheConfig(cache_size=n),
                     DeviceConfig("cpu"), kernel_config=KernelConfig(backend))
    with set_current_vllm_config(cfg):
        layer = FusedMoE(E, 2, H, I)
        layer.load_expert_weight("w13_weight", w[0], None, None)
        layer.load_expert_weight("w2_weight", w[1], None, None)
        layer.finish_loading(torch.device("cpu"))
    return layer


@pytest.fixture
def weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
def test_negative_ids_are_skipped_like_uncached(weights, backend):
    ref, cached = _layer(0, backend, weights), _layer(3, backend, weights)
    x = torch.randn(3, H)
    ids = torch.tensor([[0, -1], [1, 2], [-1, 3]])
    w = torch.rand(3, 2)
    want = ref.forward_experts(x, w, ids)
    got = cached.forward_experts(x, w, ids)
    assert torch.equal(got, want)
    # Expert E-1 was never needed, so it must not have been loaded.
    assert E - 1 not in cached.expert_cache.residency.expert_of_slot.tolist()


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
@pytest.mark.parametrize("n", [0, 3])
def test_empty_batch(weights, backend, n):
    layer = _layer(n, backend, weights)
    out = layer(torch.zeros(0, H), torch.zeros(0, E))
    assert out.shape == (0, H)


def test_grouped_skips_out_of_range_ids(weights):
    x = torch.randn(2, H)
    out = torch.full((2, 2, H), 5.0)
    expert_pairs_grouped(x, weights[0], weights[1], torch.ones(2, 2),
                         torch.tensor([[0, E], [E + 3, 1]]), out)
    assert torch.equal(out[0, 1], torch.full((H,), 5.0))
    assert torch.equal(out[1, 0], torch.full((H,), 5.0))


def test_unknown_activation_rejected():
    with pytest.raises(ValueError, match="activation='relu'"):
        FusedMoE(E, 2, H, I, activation="relu")
