"""CachedWeightProvider on one FusedMoE: cached == uncached bitwise, waves, eviction safety, stats,
pinning fallback, compile (no host sync), and device allocations while loading."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vllm.config import MoECacheConfig, set_current_vllm_config
from vllm.model_executor.layers.fused_moe.expert_cache import policy as policy_mod
from vllm.model_executor.layers.fused_moe.expert_cache.provider import (CPU_NO_SAVING_MSG,
                                                                        CachedWeightProvider)
from vllm.model_executor.layers.fused_moe.expert_cache.store import PIN_FAILED_MSG
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.platforms.interface import Platform
from tiny_checkpoints import layer_config as vllm_config

E, H, I = 8, 32, 16


def weights(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dtype),
            (torch.randn(E, H, I, generator=g) * 0.2).to(dtype))


def build(cache_size, w, top_k=2, policy="auto", device="cpu", finish=True, moe_backend="auto"):
    with set_current_vllm_config(vllm_config(cache_size, policy, moe_backend)):
        layer = FusedMoE(E, top_k, H, I, params_dtype=w[0].dtype)
        layer.load_expert_weight("w13_weight", w[0], None, None)
        layer.load_expert_weight("w2_weight", w[1], None, None)
        if finish:
            layer.finish_loading(torch.device(device))
    return layer


def routing(T, seed, dtype):
    """Skewed router logits (a few hot experts, like real traces) and hidden states."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.randn(E, generator=g) * 2
    return (torch.randn(T, H, generator=g).to(dtype), torch.randn(T, E, generator=g) + hot)


def expect_waves(T, top_k, n):
    return math.ceil(min(E, T * top_k) / n)


def slot_holds(layer, s, w, e):
    """Slot s holds exactly expert e's weights, as the backend lays them out after loading."""
    want = layer.quant_method.prepare_expert({"w13_weight": w[0][e], "w2_weight": w[1][e]})
    return (torch.equal(layer.w13_weight[s], want["w13_weight"])
            and torch.equal(layer.w2_weight[s], want["w2_weight"]))


def check_slots_hold_their_experts(layer, w):
    """Every occupied slot holds exactly the original weights of the expert the map names."""
    for s, e in enumerate(layer.expert_cache.residency.expert_of_slot.tolist()):
        if e >= 0:
            assert slot_holds(layer, s, w, e), (s, e)


TOPK_SLOTS = [(2, 1), (2, 2), (2, 4), (2, 7), (3, 1), (3, 3), (3, 4), (3, 7)]  # N: 1, K, E/2, E-1


@pytest.mark.parametrize("moe_backend", ["cpu_kernel", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k,n", TOPK_SLOTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_equals_uncached_bitwise(dtype, top_k, n, seed, moe_backend):
    w = weights(dtype, seed)
    ref = build(0, w, top_k, moe_backend=moe_backend)
    cached = build(n, w, top_k, moe_backend=moe_backend)
    assert cached.w13_weight.shape[0] == n and ref.w13_weight.shape[0] == E
    prev = cached.expert_cache.stats()
    for step, T in enumerate([1, 7, 64, 1100, 1, 7, 1]):  # state carries across forwards
        x, logits = routing(T, 100 * seed + step, dtype)
        want = ref(x, logits)
        got = cached(x, logits)
        assert got.dtype == want.dtype and torch.equal(got, want), (step, T)
        ids = torch.topk(logits.softmax(-1), top_k, dim=-1).indices
        st = cached.expert_cache.stats()
        d = {k: st[k] - prev[k] for k in ("hits", "misses", "experts_copied", "waves")}
        assert d["hits"] + d["misses"] == ids.unique().numel()
        assert d["experts_copied"] == d["misses"]
        assert d["waves"] == math.ceil(ids.unique().numel() / n)     # the non-empty ones
        check_slots_hold_their_experts(cached, w)
        prev = st


class MRUPolicy(policy_mod.EvictionPolicy):
    """Adversary: evict the most recently used expert first, i.e. exactly the ones a wave needs."""
    name = "test_mru"

    def init_state(self, num_experts, device):
        return {"last_use": torch.full((num_experts,), -1, dtype=torch.int64, device=device)}

    def on_access(self, state, used, clock):
        state["last_use"].copy_(torch.where(used, clock, state["last_use"]))

    def keep_score(self, state, clock):
        return -state["last_use"].float()


@pytest.fixture
def mru_policy():
    policy_mod.register_policy(MRUPolicy())
    yield "test_mru"
    policy_mod._REGISTRY.pop("test_mru", None)


class ApplySpy:
    """Wraps the layer's apply_pairs: at every call checks that each slot the kernel is about to
    read holds exactly the expert its pairs were routed to, that the pass has no more distinct
    slots than its ``max_ids`` bound, and counts how often each pair is computed (must be once
    per forward)."""

    def __init__(self, layer, w, monkeypatch):
        self.layer, self.w, self.ids = layer, w, None
        self.inner = layer.quant_method.apply_pairs
        monkeypatch.setattr(layer.quant_method, "apply_pairs", self)

    def start(self, ids):
        self.ids, self.covered, self.calls = ids, torch.zeros_like(ids), 0

    def __call__(self, weights, x, topk_weights, slot_ids, out, max_ids=None):
        self.calls += 1
        valid = slot_ids >= 0
        self.covered += valid.long()
        pairs = torch.stack([slot_ids[valid], self.ids[valid]], 1).unique(dim=0).tolist()
        slots_used = [s for s, _ in pairs]
        assert len(slots_used) == len(set(slots_used)), f"a slot serves two experts: {pairs}"
        assert max_ids is not None and len(slots_used) <= max_ids, (pairs, max_ids)
        for s, e in pairs:
            assert slot_holds(self.layer, s, self.w, e), f"slot {s} is not expert {e}"
        self.inner(weights, x, topk_weights, slot_ids, out, max_ids=max_ids)


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru", "lrfu_next", "test_mru"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_wave_never_reads_an_evicted_or_foreign_slot(policy, n, mru_policy, monkeypatch):
    w = weights(torch.float32, 5)
    ref, cached = build(0, w, 2), build(n, w, 2, policy=policy)
    spy = ApplySpy(cached, w, monkeypatch)
    g = torch.Generator().manual_seed(7)
    for step in range(12):
        T = [1, 3, 5, 40][step % 4]
        x = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])  # distinct per row
        tw = torch.rand(T, 2, generator=g)
        spy.start(ids)
        got = cached.forward_experts(x, tw, ids)
        assert torch.equal(got, ref.forward_experts(x, tw, ids))
        assert torch.equal(spy.covered, torch.ones_like(ids)), "each pair exactly once"
        # Eager CPU steps stop after the last non-empty wave (of the static expect_waves).
        assert spy.calls == max(1, math.ceil(ids.unique().numel() / n)) <= expect_waves(T, 2, n)


def test_waves_when_batch_needs_every_expert(monkeypatch):
    n = 3
    w = weights(torch.float32, 9)
    ref, cached = build(0, w, 2), build(n, w, 2)
    plans = []
    provider = cached.expert_cache
    real_step = provider.step

    class Spy(type(real_step)):
        """Records each wave's experts as the provider receives the wave (the fused step plans
        them all in one call: wave_of_expert is then the step's, fixed by wave 0)."""
        def __init__(self):
            self.__dict__.update(real_step.__dict__)

        def waves(self, res, topk_ids, row_slots, num_waves):
            for wave, out in enumerate(real_step.waves(res, topk_ids, row_slots, num_waves)):
                plans.append(res.wave_of_expert == wave)
                yield out
    monkeypatch.setattr(provider, "step", Spy())
    ids = torch.tensor([[e, (e + 1) % E] for e in range(E)])            # all E experts needed
    x, tw = torch.randn(E, H), torch.rand(E, 2)
    got = cached.forward_experts(x, tw, ids)
    assert torch.equal(got, ref.forward_experts(x, tw, ids))
    assert len(plans) == math.ceil(E / n)
    waves = torch.stack(plans)                                            # [W, E]
    assert (waves.sum(1) <= n).all() and torch.equal(waves.sum(0), torch.ones(E, dtype=torch.long))
    st = cached.expert_cache.stats()
    assert st["hits"] + st["misses"] == E and st["misses"] == E and st["evictions"] == E - n


def test_stats_are_consistent():
    w = weights(torch.bfloat16, 3)
    cached = build(3, w, 2)
    assert cached.expert_cache.stats() == {"hits": 0, "misses": 0, "evictions": 0,
                                           "experts_copied": 0, "bytes_copied": 0,
                                           "link_bytes_copied": 0, "hit_rate": 0.0,
                                           "waves": 0}
    for step in range(6):
        cached(*routing(5, step, torch.bfloat16))
    st = cached.expert_cache.stats()
    per_expert = (w[0][0].numel() + w[1][0].numel()) * 2                 # bf16: 2 bytes
    assert st["bytes_copied"] == st["link_bytes_copied"] == st["misses"] * per_expert
    assert st["hit_rate"] == pytest.approx(st["hits"] / (st["hits"] + st["misses"]))
    assert st["evictions"] == st["misses"] - 3                          # slots fill, then evict
    assert all(isinstance(v, (int, float)) for v in st.values())
    cached.expert_cache.reset_stats()
    assert cached.expert_cache.stats()["misses"] == 0


def test_pin_failure_falls_back_warns_once_and_stays_exact(vllm_log, monkeypatch):
    asked = []

    def fail(self, shape, dtype, device=None):
        asked.append(device)
        raise torch.OutOfMemoryError("simulated pin failure: no lockable memory left")
    monkeypatch.setattr(Platform, "empty_pinned", fail)
    w = weights(torch.float32, 4)
    ref = build(0, w)
    caches = []
    for _ in range(2):
        layer = build(2, w, finish=False)
        loaded = {n: getattr(layer, n) for n in layer.quant_method.expert_tensor_names()}
        layer.weight_provider = CachedWeightProvider.from_experts(
            loaded, layer.quant_method.prepare_expert, MoECacheConfig(2), "cpu", pin=True)
        caches.append(layer)
        x, logits = routing(9, 1, torch.float32)
        assert torch.equal(layer(x, logits), ref(x, logits))
    assert all(not c.expert_cache.store.pinned and not c.expert_cache.non_blocking for c in caches)
    msgs = [r.getMessage() for r in vllm_log.records]
    assert msgs.count(PIN_FAILED_MSG) == 1
    assert msgs.count(CPU_NO_SAVING_MSG) == 1
    assert asked and set(asked) == {torch.device("cpu")}   # the store is pinned for its device


def test_auto_policy_resolves_to_default():
    layer = build(2, weights(torch.float32))
    assert layer.expert_cache.policy_name == getattr(policy_mod, "DEFAULT_POLICY", "lru")


def _compiled_matches_eager(backend, n, sizes, moe_backend="torch", dtype=torch.float32):
    w = weights(dtype, 11)
    ref, eager, cached = (build(c, w, moe_backend=moe_backend) for c in (0, n, n))
    compiled = torch.compile(cached, fullgraph=True, backend=backend, dynamic=False)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad(), torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        for step, T in enumerate(sizes):
            x, logits = routing(T, step, dtype)
            want = ref(x, logits)
            torch.testing.assert_close(compiled(x, logits), want, rtol=tol, atol=tol)
            assert torch.equal(eager(x, logits), want)
            assert cached.expert_cache.stats() == eager.expert_cache.stats()
            check_slots_hold_their_experts(cached, w)
    torch._dynamo.reset()


@pytest.mark.parametrize("moe_backend,dtype", [("torch", torch.float32),
                                               ("grouped_mm", torch.bfloat16)])
def test_cached_forward_compiles_fullgraph(moe_backend, dtype):
    # fullgraph=True fails on any graph break, so .item()/.tolist()/data-dependent branching in
    # the cached forward would fail here. "aot_eager" also functionalizes the in-place updates
    # of slots and residency state. capture_dynamic_output_shape_ops: the CPU copy (and the
    # torch reference kernel) use nonzero, whose length is data dependent. grouped_mm is traced
    # in bf16 only: torch's fake-tensor rule for _grouped_mm rejects other dtypes.
    _compiled_matches_eager("aot_eager", 3, [2, 2, 2], moe_backend, dtype)  # W = 2: waves traced


@pytest.mark.slow
def test_cached_forward_compiles_with_inductor():
    _compiled_matches_eager("inductor", 4, [1, 1, 1], "torch", torch.float32)


class DeviceAllocations(TorchDispatchMode):
    """Bytes of every new tensor created on ``device_type`` (views and in-place results skipped)."""

    def __init__(self, device_type):
        super().__init__()
        self.device_type, self.sizes = device_type, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            self.sizes += [t.numel() * t.element_size() for t in tree_leaves(out)
                           if isinstance(t, torch.Tensor) and t.device.type == self.device_type]
        return out


def test_loading_allocates_only_slots_on_the_device():
    """"meta" stands in for the accelerator: every tensor that finish_loading creates there is
    seen by the dispatcher. Proves: no all-experts tensor is ever created on the compute device
    while building the cache (processing happens on the host); the device receives N slots plus
    O(E) bookkeeping. Does not model a real allocator's caching or fragmentation."""
    n = 2
    w = weights(torch.float32)
    per_expert = (w[0][0].numel() + w[1][0].numel()) * 4
    layer = build(n, w, finish=False)
    assert layer.w13_weight.device.type == "cpu"                         # created in host memory
    # Under a default-device context too (as while a model is built): the store stays on host.
    with DeviceAllocations("meta") as seen, set_current_vllm_config(vllm_config(n)), \
            torch.device("meta"):
        layer.finish_loading(torch.device("meta"))
    assert layer.w13_weight.device.type == "meta" and layer.w13_weight.shape[0] == n
    assert all(t.device.type == "cpu" for t in layer.expert_cache.store.tensors.values())
    assert sum(seen.sizes) >= n * per_expert
    # Bookkeeping only: O(E) tensors, plus O(E^2) for the default policy's predictor (lrfu_next:
    # [E, E] f64 weights; the policy state is allocated twice while building, once a temporary).
    assert sum(seen.sizes) - n * per_expert <= 64 * (E + n) + 24 * E * E
    assert max(seen.sizes) <= n * w[0][0].numel() * 4                   # never [E, ...]
    # The counter is able to see a full materialisation: moving an uncached layer does.
    with DeviceAllocations("meta") as seen_full:
        build(0, w).to("meta")
    assert sum(seen_full.sizes) >= E * per_expert
