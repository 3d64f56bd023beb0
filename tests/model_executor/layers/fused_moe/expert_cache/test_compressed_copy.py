"""exp12 link compression in the cache (expert_cache/compressed_copy.py): with misses moved as
exp12 planes the slots hold exactly the experts they would hold without it, step after step, on
the CUDA path rehearsed on CPU (Triton interpreted); where a platform has no exp12 kernel,
asking for it names why."""
from __future__ import annotations

import pytest
import torch
from rehearsal import RehearsalPlatform

from vllm.model_executor.layers.fused_moe.expert_cache.compressed_copy import (
    Exp12Copy, link_compression_refusal)
from vllm.model_executor.layers.fused_moe.expert_cache.policy import get_policy
from vllm.model_executor.layers.fused_moe.expert_cache.provider import CachedWeightProvider
from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency
from vllm.model_executor.layers.fused_moe.expert_cache.slots import allocate_slots
from vllm.model_executor.layers.fused_moe.expert_cache.store import HostStore
from vllm.platforms import _PLATFORMS

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

E, H, I, K, N = 8, 32, 16, 2, 3


def _store(extra: bool = False, inf: bool = False) -> HostStore:
    g = torch.Generator().manual_seed(0)
    t = {"w13_weight": torch.randn(E, 2 * I, H, generator=g).mul_(0.1).to(torch.bfloat16),
         "w2_weight": torch.randn(E, H, I, generator=g).mul_(0.1).to(torch.bfloat16)}
    t["w13_weight"][2, 0, :2] = torch.tensor([1e-30, 0.0], dtype=torch.bfloat16)  # escape, zero
    if inf:                                     # its whole block of 128 escapes
        t["w13_weight"][2, 0, 2] = float("inf")
    if extra:                                   # not exp12-shaped: the plain gather moves it
        t["w2_bias"] = torch.randn(E, H, generator=g)
    return HostStore(t, pinned=False)


def _provider(store: HostStore) -> CachedWeightProvider:
    return CachedWeightProvider(store, allocate_slots(store, N, "cpu"),
                                Residency(E, N, get_policy("lrfu"), "cpu"), "lrfu")


def _step(p: CachedWeightProvider, ids: torch.Tensor) -> None:
    for _ in p.prepare(ids):                    # each wave copies its misses
        pass


@pytest.mark.triton
@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("extra", [False, True])
def test_slots_equal_the_uncompressed_copy_step_after_step(monkeypatch, extra):
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    store = _store(extra)
    plain, packed = _provider(store), _provider(store)
    packed.enable_link_compression()
    assert isinstance(packed.copy, Exp12Copy) and packed.capture_refusal() is None
    assert set(packed.copy.plain) == ({"w2_bias"} if extra else set())
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(2)])
        _step(plain, ids)
        _step(packed, ids)
        assert torch.equal(plain.residency.expert_of_slot, packed.residency.expert_of_slot)
        for name, slot in packed.slots.items():
            assert torch.equal(slot.view(torch.uint8), plain.slots[name].view(torch.uint8))
            for s, e in enumerate(packed.residency.expert_of_slot.tolist()):
                if e >= 0:                      # against the store itself
                    assert torch.equal(slot[s].view(torch.uint8),
                                       store.tensors[name][e].view(torch.uint8))
    assert packed.stats()["misses"] == plain.stats()["misses"] > N


def test_bytes_per_expert_count_the_planes_and_the_plain_tensors(monkeypatch):
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    store = _store(extra=True)
    copy = Exp12Copy(store, torch.device("cpu"))
    n13, n2 = 2 * I * H, H * I
    X13, X2 = (copy.planes[n].esc_index.shape[1] for n in ("w13_weight", "w2_weight"))
    want = sum(n + n // 2 + n // 128 + 6 * X for n, X in ((n13, X13), (n2, X2))) + 4 * H
    assert copy.bytes_per_expert == want


def test_a_platform_without_the_kernel_refuses_by_name():
    store = _store()
    why = link_compression_refusal(store, torch.device("cpu"))
    assert "exp12 copy kernel" in why
    with pytest.raises(ValueError, match="exp12 copy kernel"):
        _provider(store).enable_link_compression()


def test_no_bf16_tensor_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    store = HostStore({"w13_weight": torch.zeros(E, 2 * I, H)}, pinned=False)
    assert "bfloat16" in link_compression_refusal(store, torch.device("cpu"))


def _generate(path, **kw):
    from vllm import LLM, SamplingParams
    llm = LLM(path, device="cpu", dtype="bfloat16", max_num_seqs=2, enforce_eager=True, **kw)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 3], [250, 7])]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.runner


@pytest.mark.triton
@pytest.mark.usefixtures("triton_interpreter")
def test_engine_option_gives_the_same_tokens_and_frees_the_bf16_store(tiny_model_factory,
                                                                      monkeypatch):
    """moe_expert_link_compression="exp12" on the CUDA path rehearsed on CPU: the tokens and
    misses of the uncompressed cache; the store keeps only the planes."""
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    want, plain = _generate(path, moe_expert_cache_size=2)
    got, runner = _generate(path, moe_expert_cache_size=2, moe_expert_link_compression="exp12")
    assert got == want
    caches = [m.expert_cache for m in runner.moe_layers]
    assert all(isinstance(c.copy, Exp12Copy) for c in caches)
    assert all(t.is_meta for c in caches for t in c.store.tensors.values())
    assert [c.stats()["misses"] for c in caches] == \
        [m.expert_cache.stats()["misses"] for m in plain.moe_layers]


@pytest.mark.triton
@pytest.mark.usefixtures("triton_interpreter")
def test_engine_option_with_cpu_compute_reads_the_planes_on_the_cpu(tiny_model_factory,
                                                                     monkeypatch):
    """With moe_expert_cpu_compute "auto" (a fixed cost model: an expert runs on the CPU twice,
    then is copied), exp12 frees the bf16 store and the CPU computes its misses from the planes
    (gemv16_exp12): the tokens, CPU pairs and misses of the run without exp12, whose CPU reads
    the bf16 store through gemv16 (``HostExperts`` in both, as on a GPU: on a CPU device the
    plain run would use the layer's own backend), and the copies read only the planes."""
    from vllm.model_executor.layers.fused_moe.expert_cache import host_compute, provider
    from vllm.model_executor.layers.fused_moe.expert_cache.link_codec import Exp12
    from vllm.model_executor.layers.fused_moe.expert_cache.host_experts import HostExperts
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    real = provider.host_experts
    monkeypatch.setattr(provider, "host_experts", lambda qm, device, planes=False:
                        real(qm, device, planes=True))
    cost = host_compute.HostCostModel(copy_seconds=1.0, cpu_fixed=0.4, cpu_per_token=0.0,
                                      concurrent=True)
    monkeypatch.setattr(host_compute, "_COST_MODELS", {})
    monkeypatch.setattr(host_compute, "measure_cost_model", lambda *a, **k: cost)
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    kw = dict(moe_expert_cache_size=2, moe_expert_cpu_compute="auto")
    want, plain = _generate(path, **kw)
    got, runner = _generate(path, moe_expert_link_compression="exp12", **kw)
    assert got == want
    caches = [m.expert_cache for m in runner.moe_layers]
    assert all(isinstance(c.copy, Exp12Copy) for c in caches)
    assert all(c.store.tensors[n].is_meta for c in caches for n in c.copy.planes)
    assert all(isinstance(c.host_compute.experts, HostExperts) and
               isinstance(c.host_compute.store_tensors["w13_weight"], Exp12)
               for c in caches)
    stats, before = [c.stats() for c in caches], [m.expert_cache.stats() for m in plain.moe_layers]
    for field in ("misses", "hits", "cpu_pairs", "bytes_copied"):
        assert [s[field] for s in stats] == [s[field] for s in before], field
    assert sum(s["cpu_pairs"] for s in stats) > 0 and sum(s["misses"] for s in stats) > 0
    assert sum(s["link_bytes_copied"] for s in stats) < sum(s["bytes_copied"] for s in stats)


def test_engine_option_refusals_name_the_reason(tiny_model_factory):
    from vllm.config import MoECacheConfig
    with pytest.raises(ValueError, match="must be one of"):
        MoECacheConfig(cache_size=2, link_compression="zstd")
    with pytest.raises(ValueError, match="exp12 copy kernel"):       # the CPU platform
        _generate(tiny_model_factory("Qwen3MoeForCausalLM"), moe_expert_cache_size=2,
                  moe_expert_link_compression="exp12")


@pytest.mark.gpu
def test_engine_option_on_cuda_gives_the_same_tokens(tiny_model_factory):
    """The compiled decode-gather on pinned planes, inside the decode graphs: the tokens of
    the uncompressed cache, at 1 and 3 slots."""
    from vllm import LLM, SamplingParams
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 3], [250, 7], [11] * 9)]
    for n in (1, 3):
        runs = []
        for mode in ("off", "exp12"):
            llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=4,
                      moe_expert_cache_size=n, moe_expert_link_compression=mode)
            outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
            runs.append([o.outputs[0].token_ids for o in outs])
            assert llm.llm_engine.runner.decode_graphs.refused is None
            del llm
        assert runs[0] == runs[1], n


@pytest.mark.gpu
def test_engine_option_with_cpu_compute_on_cuda_gives_the_same_tokens(tiny_model_factory):
    """Every miss on the CPU ("always"), from the planes with exp12 and from the bf16 store
    without it (both through HostExperts), decode graphs in pieces: the same tokens."""
    from vllm import LLM, SamplingParams
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 3], [250, 7], [11] * 9)]
    runs = []
    for mode in ("off", "exp12"):
        llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=4,
                  moe_expert_cache_size=2, moe_expert_cpu_compute="always",
                  moe_expert_link_compression=mode)
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        runs.append([o.outputs[0].token_ids for o in outs])
        assert llm.llm_engine.runner.decode_graphs.refused is None
        assert llm.get_moe_cache_stats()["cpu_pairs"] > 0
        del llm
    assert runs[0] == runs[1]


@pytest.mark.triton
@pytest.mark.usefixtures("triton_interpreter")
def test_link_bytes_count_the_planes(monkeypatch):
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    store = _store()
    p = _provider(store)
    p.enable_link_compression()
    _step(p, torch.tensor([[0, 1], [2, 0]]))          # 3 distinct experts, 3 slots
    st = p.stats()
    assert st["misses"] == 3 and st["bytes_copied"] == 3 * store.bytes_per_expert
    assert st["link_bytes_copied"] == 3 * p.copy.bytes_per_expert < st["bytes_copied"]


def test_a_tensor_whose_planes_would_not_be_smaller_moves_as_it_is(monkeypatch):
    """An infinity makes its block of 128 escape: at 1,024 weights an expert, the padded
    escape rows of w13 outgrow bf16, so w13 stays plain and w2 is encoded."""
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    store = _store(inf=True)
    copy = Exp12Copy(store, torch.device("cpu"))
    assert set(copy.planes) == {"w2_weight"} and set(copy.plain) == {"w13_weight"}
    assert copy.bytes_per_expert < store.bytes_per_expert
