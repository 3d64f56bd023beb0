"""The cache layouts of Attention's options (one plane for a shared K=V layer), what the runner
allocates and counts for them, the registry's refusal of a backend without a feature, and CPU
graph replay of the kernel's new arguments."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.kernels.cpu.graph import CpuGraph, capture
from vllm.model_executor.forward_context import set_forward_context
from vllm.model_executor.layers.attention import (Attention, AttentionBackend,
                                                  register_attention_backend,
                                                  select_attention_backend)
from vllm.model_executor.layers.attention.registry import AttentionQuery, _REGISTRY
from vllm.model_executor.layers.attention.torch_sdpa import TorchSdpaAttention
from vllm.platforms import platform_for
from vllm.worker.model_runner import ModelRunner, kv_bytes_per_block

from .test_attention_options import make_layer, paged_case, reference, run_paged


def test_shared_layer_has_one_plane_and_checks_bound_caches():
    plain, shared = Attention(6, 8, 2, 1.0), Attention(6, 8, 2, 1.0, "l.attn", kv_shared=True)
    assert plain.kv_cache_shape(5, 4) == (2, 5, 4, 2, 8)
    assert shared.kv_cache_shape(5, 4) == (1, 5, 4, 2, 8)
    with pytest.raises(ValueError, match=r"l.attn: kv_cache \(2, 5, 4, 2, 8\) is invalid: must "
                                         r"be \[1, num_blocks, block_size, 2, 8\]"):
        shared.kv_cache = torch.zeros(2, 5, 4, 2, 8)
    with pytest.raises(ValueError, match=r"must be \[2, num_blocks"):
        plain.kv_cache = torch.zeros(1, 5, 4, 2, 8)
    shared.kv_cache = torch.zeros(shared.kv_cache_shape(5, 4))
    assert shared.impl is not None


def test_v_is_given_exactly_when_not_shared():
    x, kv = torch.zeros(3, 48), torch.zeros(3, 16)
    with pytest.raises(ValueError, match="l.attn: v must be None exactly when kv_shared"):
        Attention(6, 8, 2, 1.0, "l.attn", kv_shared=True)(x, kv, kv)
    with pytest.raises(ValueError, match="v must be None exactly when kv_shared"):
        Attention(6, 8, 2, 1.0)(x, kv)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_sdpa"])
def test_shared_output_is_attention_with_values_equal_to_keys(backend):
    """softmax(q K^T) K per query, the keys written once (plane 0), MLA's shape: one kv head."""
    attn = make_layer(backend, 8, 1, 24, kv_shared=True)
    md, q, k, v, _ = paged_case(attn, [(9, 1), (6, 1), (12, 4), (5, 5)], 2, seed=3)
    assert v is None and attn.kv_cache.shape[0] == 1
    out = run_paged(attn, md, q, k, None)
    cache = attn.kv_cache[0].view(-1, 1, 24)
    refs = []
    for i, (s, e) in enumerate(zip(md.query_start_loc_cpu[:-1], md.query_start_loc_cpu[1:])):
        ctx, table = md.seq_lens_cpu[i], md.block_tables[i].tolist()
        keys = cache[[table[p // 4] * 4 + p % 4 for p in range(ctx)]]        # [ctx, 1, 24]
        refs.append(reference(q[s:e].view(e - s, 8, 24), keys, keys,
                              range(ctx - (e - s), ctx), attn.scale))
    torch.testing.assert_close(out.double(), torch.cat(refs), atol=1e-5, rtol=1e-5)
    assert torch.equal(cache[md.slot_mapping], k.view(-1, 1, 24))


def test_runner_counts_and_allocates_one_plane_for_shared_layers():
    layers = [Attention(6, 8, 2, 1.0), Attention(8, 24, 1, 1.0, kv_shared=True),
              Attention(4, 16, 4, 1.0, sliding_window=8, use_sinks=True)]
    per_block = kv_bytes_per_block(layers, 16, torch.bfloat16)
    assert per_block == 2 * 16 * (2 * 2 * 8 + 1 * 1 * 24 + 2 * 4 * 16)
    runner = ModelRunner.__new__(ModelRunner)          # only the KV cache part of a runner
    runner.attn_layers, runner.block_size, runner.dtype = layers, 16, torch.bfloat16
    runner.device = torch.device("cpu")
    runner.config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=3),
                                    model_config=None, scheduler_config=None)
    assert runner.kv_bytes_per_block() == per_block
    assert runner._allocate_kv_cache() == 3
    assert [tuple(a.kv_cache.shape) for a in layers] == [(2, 3, 16, 2, 8), (1, 3, 16, 1, 24),
                                                         (2, 3, 16, 4, 16)]
    assert sum(a.kv_cache.nbytes for a in layers) == 3 * per_block


def test_default_layer_has_no_sinks_parameter():
    assert dict(Attention(6, 8, 2, 1.0).named_parameters()) == {}
    sinks = dict(Attention(6, 8, 2, 1.0, use_sinks=True).named_parameters())["sinks"]
    assert sinks.shape == (6,) and sinks.dtype == torch.float32 and not sinks.requires_grad
    with pytest.raises(ValueError, match="sliding_window=0 must be >= 1"):
        Attention(6, 8, 2, 1.0, sliding_window=0)


def test_a_backend_without_a_feature_is_refused_by_name():
    backend = AttentionBackend("no_features", TorchSdpaAttention)
    register_attention_backend(backend)
    try:
        q = AttentionQuery(platform_for("cpu"), torch.float32, 8, True,
                           frozenset({"sinks", "sliding_window"}))
        with pytest.raises(ValueError, match=r"'no_features' cannot run a contiguous "
                                             r"torch.float32 KV cache on cpu \(head_dim=8\) with "
                                             r"sinks, sliding_window: it does not implement "
                                             r"\['sinks', 'sliding_window'\]"):
            select_attention_backend(q, "no_features")
        assert backend.refusal(AttentionQuery(platform_for("cpu"), torch.float32, 8, True)) \
            is None
        assert select_attention_backend(q).name == "cpu_paged"
    finally:
        _REGISTRY.unregister("no_features")


def test_cpu_graph_replays_window_sinks_and_shared_cache():
    """The kernel's sink pointer, window and plane count are recorded with the call: a replay
    on new inputs written into the captured tensors equals the eager call bit for bit."""
    attn = make_layer("cpu_paged", 4, 2, 64, sliding_window=6, use_sinks=True, kv_shared=True)
    md, q, k, _, _ = paged_case(attn, [(9, 1), (17, 1), (3, 1)], 3, dtype=torch.bfloat16)
    graph = CpuGraph()
    with set_forward_context(md), capture(graph):
        out = attn(q, k)
    graph.finish()
    captured = out.clone()
    q2, k2 = torch.randn_like(q), torch.randn_like(k)
    q.copy_(q2), k.copy_(k2)
    graph.replay()
    assert not torch.equal(out, captured)
    with set_forward_context(md):
        assert torch.equal(out, attn(q2, k2))


def test_kernel_wrappers_check_the_new_arguments():
    from vllm.kernels.cpu.ops import paged_attention, write_kv_cache
    cache, one_plane = torch.zeros(2, 4, 4, 2, 8), torch.zeros(1, 4, 4, 2, 8)
    q, tables, lens = torch.randn(3, 4, 8), torch.zeros(3, 1, dtype=torch.long), torch.ones(3)
    with pytest.raises(ValueError, match=r"l.attn: paged_attention: .*sinks \(3,\)"):
        paged_attention(q, cache, tables, lens, 1.0, 2, None, "l.attn", sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="window 0"):
        paged_attention(q, cache, tables, lens, 1.0, 2, window=0)
    k = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match=r"write_kv_cache: .*v None.*\(2, 4, 4, 2, 8\)"):
        write_kv_cache(k, None, torch.arange(3), cache)
    with pytest.raises(ValueError, match=r"write_kv_cache: .*\(1, 4, 4, 2, 8\)"):
        write_kv_cache(k, k, torch.arange(3), one_plane)
    write_kv_cache(k, None, torch.tensor([5, -1, 0]), one_plane)
    assert torch.equal(one_plane[0].view(-1, 2, 8)[[5, 0]], k[[0, 2]])
    assert one_plane.view(16, -1).abs().sum(1).nonzero().flatten().tolist() == [0, 5]
