"""Misses computed on the CPU from the host store (``expert_cache/host_compute.py``,
``moe_expert_cpu_compute``).

On a CPU device both sides run the layer's own kernel, so outputs must equal the uncached
layer's bit for bit whatever the split; the split itself and the cost model's rule are checked
against hand-written expectations. What a GPU adds (the device kernels beside the CPU) has not
run on a GPU."""
from __future__ import annotations

import math

import pytest
import torch

from tools.quantize_checkpoint import main as quantize_main
from vllm import LLM, SamplingParams
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.fused_moe.expert_cache import host_experts as host_experts_module
from vllm.model_executor.layers.fused_moe.expert_cache.host_compute import (
    HostCostModel, HostMissCompute, balance, measure_cost_model, rent_or_buy)
from vllm.model_executor.layers.fused_moe.expert_cache.host_experts import (HostExperts,
                                                                         host_experts)
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.registry import CpuKernelExperts
from vllm.model_executor.model_loader import get_model
from model_executor.layers.quantization.published_ckpt import TINY
from model_executor.tiny_checkpoints import layer_config, make_vllm_config

E, H, I = 8, 32, 16
RESIDENT = torch.tensor([-1, 0, -1, 1, -1, -1, 2, -1])     # experts 1, 3, 6 in slots 0, 1, 2


def build(cache_size, dtype=torch.float32, cpu_compute="off", moe_backend="auto", top_k=2):
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.2).to(dtype)
    with set_current_vllm_config(layer_config(cache_size, moe_backend=moe_backend,
                                              cpu_compute=cpu_compute)):
        layer = FusedMoE(E, top_k, H, I, params_dtype=dtype)
        layer.load_expert_weight("w13_weight", w13, None, None)
        layer.load_expert_weight("w2_weight", w2, None, None)
        layer.finish_loading(torch.device("cpu"))
    return layer


def _split(hc, ids):
    """``hc.split`` with stand-in step inputs (x [T, H] = row index, weights 0.5)."""
    T = ids.shape[0]
    x = torch.arange(T, dtype=torch.float32)[:, None].expand(T, H).contiguous()
    return hc.split(ids, RESIDENT, x, torch.full(ids.shape, 0.5))


def test_split_sends_missing_experts_pairs_to_the_cpu():
    hc = HostMissCompute("always", experts=None, store_tensors={}, cost=None)
    ids = torch.tensor([[1, 0], [3, 2], [-1, 6], [0, 5], [8, 3]], dtype=torch.int32)
    split = _split(hc, ids)
    # Resident 1, 3, 6, the skipped pair and an id past E stay on the device (the residency step
    # routes the last nowhere); 0, 2, 5 go to the CPU: pairs 1, 3, 6, 7 of rows 0, 1, 3.
    assert split.device_ids.tolist() == [[1, -1], [3, -1], [-1, 6], [-1, -1], [8, 3]]
    assert split.device_ids.dtype == torch.int32
    assert split.pair_index.tolist() == [1, 3, 6, 7]
    assert split.host_ids.tolist() == [[-1, 0], [-1, 2], [0, 5]]
    assert split.x.device.type == "cpu" and split.x[:, 0].tolist() == [0, 1, 3]
    assert split.x.shape == (3, H) and split.x.is_contiguous()
    assert split.topk_weights.tolist() == [[0.5, 0.5]] * 3
    assert hc.stats() == {"cpu_pairs": 4, "cpu_expert_calls": 3}
    assert _split(hc, torch.tensor([[1, 3], [6, -1]])) is None    # all hits
    assert hc.stats()["cpu_pairs"] == 4
    hc.reset_stats()
    assert hc.stats() == {"cpu_pairs": 0, "cpu_expert_calls": 0}


def test_a_large_steps_inputs_are_read_after_the_split(monkeypatch):
    """Past ``EARLY_READ_BYTES`` the CPU's rows are gathered on the device and read after the
    routing (prefill), below it all rows come with the routing (decode): the same split."""
    from vllm.model_executor.layers.fused_moe.expert_cache import host_compute
    ids = torch.tensor([[1, 0], [3, 2], [-1, 6], [0, 5], [8, 3]])
    splits = []
    for limit in (1 << 18, 0):
        monkeypatch.setattr(host_compute, "EARLY_READ_BYTES", limit)
        splits.append(_split(HostMissCompute("always", None, {}, None), ids))
    for name in ("device_ids", "pair_index", "host_ids", "x", "topk_weights"):
        a, b = (getattr(s, name) for s in splits)
        assert torch.equal(a, b) and a.is_contiguous() and b.is_contiguous(), name
    assert splits[0].x[:, 0].tolist() == [0, 1, 3]


def test_compute_writes_only_the_cpus_pairs():
    class Doubler:       # stands in for a kernel: out[t, k] = 2 * x[t] * w[t, k] where ids >= 0
        def apply_pairs(self, weights, x, w, ids, out, max_ids=None):
            assert set(ids[ids >= 0].tolist()) == {0, 2, 5}
            out[ids >= 0] = (2 * x[:, None, :] * w[..., None]).expand_as(out)[ids >= 0]

    hc = HostMissCompute("always", experts=Doubler(), store_tensors={}, cost=None)
    ids = torch.tensor([[1, 0], [3, 2], [-1, 6], [0, 5], [8, 3]])
    out = torch.full((5, 2, H), 7.0)          # what the waves left: the CPU's pairs are 0 there
    hc.compute(_split(hc, ids), out)
    rows = out[:, :, 0]
    assert rows.tolist() == [[7, 0], [7, 1], [7, 7], [3, 3], [7, 7]]      # 2 * row * 0.5


def test_rent_or_buy_is_ski_rental():
    # Expert 0: 0.3 s on the CPU per step against a 1.0 s copy: rented 3 times (0.3, 0.6,
    # 0.9 spent), bought on the 4th (1.2 >= 1.0), after which it starts from 0 again.
    # Expert 1: 1.1 s: bought at once. Expert 2: not missing: its 0.5 s spent stays.
    spent = torch.tensor([0.0, 0.0, 0.5], dtype=torch.float64)
    tokens = torch.tensor([1, 5, 0])
    cpu = torch.tensor([0.3, 1.1, 0.0], dtype=torch.float64)
    rents = []
    for _ in range(5):
        rent, spent = rent_or_buy(spent, cpu, tokens, 1.0)
        rents.append(rent.tolist())
    assert rents == [[True, False, False]] * 3 + [[False, False, False], [True, False, False]]
    assert spent.tolist() == pytest.approx([0.3, 0.0, 0.5])


def test_auto_rents_each_missing_expert_until_a_copy_would_have_been_cheaper():
    # CPU: 0.1 + 0.2 t seconds; copy: 1.0 s. Expert 4 (1 token: 0.3 s) is rented three steps,
    # then copied; expert 2 (4 tokens: 0.9 s) one step in two; expert 0 (6 tokens: 1.3 s)
    # never. (The residency here stays as it was: a copied expert misses again next step.)
    cost = HostCostModel(copy_seconds=1.0, cpu_fixed=0.1, cpu_per_token=0.2)
    assert cost.cpu_seconds(torch.tensor([0, 1, 5])).tolist() == pytest.approx([0.1, 0.3, 1.1])
    hc = HostMissCompute("auto", experts=None, store_tensors={}, cost=cost)
    ids = torch.tensor([[0, 2]] * 5 + [[0, 1]] * 1)        # expert 0: 6 tokens, 1: a hit
    ids[0, 1] = 4                                           # expert 2: 4 tokens, 4: 1 token
    on_cpu = []
    for _ in range(4):
        split = _split(hc, ids)
        host = split.host_ids if split is not None else torch.full_like(ids, -1)
        on_cpu.append(sorted(set(host[host >= 0].tolist())))
        if split is not None:
            assert (split.device_ids[ids == 0] == 0).all()
            assert (split.device_ids[ids == 1] == 1).all()
    assert on_cpu == [[2, 4], [4], [2, 4], []]
    assert hc.stats() == {"cpu_pairs": 5 + 1 + 5, "cpu_expert_calls": 5}


def test_auto_starts_renting_afresh_once_an_expert_was_resident():
    # Expert 0 is rented (0.3 of a 1.0 s copy spent), then arrives by prefetch and is evicted
    # again: its next misses rent from 0, three of them before it is copied.
    cost = HostCostModel(copy_seconds=1.0, cpu_fixed=0.1, cpu_per_token=0.2)
    hc = HostMissCompute("auto", experts=None, store_tensors={}, cost=cost)
    ids = torch.tensor([[0, 1]])
    assert hc.host_pairs(ids, RESIDENT)[1].tolist() == [[True, False]]
    assert hc.spent[0].item() == pytest.approx(0.3)
    resident0 = RESIDENT.clone()
    resident0[0] = 3
    assert hc.host_pairs(ids, resident0)[1].tolist() == [[False, False]]
    rented = [hc.host_pairs(ids, RESIDENT)[1][0, 0].item() for _ in range(4)]
    assert rented == [True, True, True, False]


def test_balance_moves_the_least_used_misses_while_that_shortens_the_step():
    f64 = dict(dtype=torch.float64)
    buy = torch.tensor([True, True, True, True, False])
    use = torch.tensor([3.0, 0.0, 2.0, 0.0, 0.0], **f64)     # order: 1, 3 (ties: id), 2, 0
    cpu = torch.tensor([0.3] * 5, **f64)
    # Copies 1.0 s each. Taking k of the 4: the step waits max(0.3 k, 4 - k): 4, 3, 2, 1, 1.2.
    assert balance(buy, use, cpu, 1.0, 0.0).tolist() == [False, True, True, True, False]
    # The CPU already busy 2.5 s with rentals: max(2.5 + 0.3 k, 4 - k) = 4, 3, 3.1, ...
    assert balance(buy, use, cpu, 1.0, 2.5).tolist() == [False, True, False, False, False]
    # A tie keeps the copy (it serves later uses too): one miss, 1.0 s either way.
    one = torch.tensor([False, False, True, False, False])
    assert not balance(one, use, torch.ones(5, **f64), 1.0, 0.0).any()
    assert not balance(torch.zeros(5, dtype=torch.bool), use, cpu, 1.0, 0.0).any()
    # Expert 4 is no candidate (not to be copied) however little it was used.
    assert not balance(buy, use, cpu, 1.0, 0.0)[4]
    # A candidate too slow on the CPU (expert 1: 5 s) is copied; the next one is still taken:
    # the wait max(2 - 1, 0.2) = 1 against 2.
    two = torch.tensor([False, True, True, False, False])
    slow = torch.tensor([0.3, 5.0, 0.2, 0.3, 0.3], **f64)
    assert balance(two, use, slow, 1.0, 0.0).tolist() == [False, False, True, False, False]


@pytest.mark.parametrize("concurrent", [False, True])
def test_auto_balances_only_where_copies_run_beside_the_cpu(concurrent):
    # One token costs the CPU 1.2 s against a 1.0 s copy: ski rental alone never rents. Side by
    # side, three misses take 3.0 s copied, 2.0 s with one on the CPU (1.2 s beside 2 copies):
    # the least used of them goes to the CPU.
    cost = HostCostModel(copy_seconds=1.0, cpu_fixed=1.1, cpu_per_token=0.1,
                         concurrent=concurrent)
    hc = HostMissCompute("auto", experts=None, store_tensors={}, cost=cost)
    for warm in ([[0, 5]], [[0, 1]], [[5, 1]]):          # resident 1: 0 and 5 used twice each
        hc.host_pairs(torch.tensor([[1, 3]]), RESIDENT)      # hits only: nothing rented
        hc.host_pairs(torch.tensor(warm), RESIDENT.clone().fill_(0))   # "all resident"
    ids, on_cpu = hc.host_pairs(torch.tensor([[0, 2], [5, 1]]), RESIDENT)
    assert on_cpu.tolist() == ([[False, True], [False, False]] if concurrent else
                               [[False, False], [False, False]])
    assert hc.spent.tolist() == pytest.approx([0.0, 0.0, 1.2 if concurrent else 0.0] + [0.0] * 5)


def test_modes_are_checked():
    with pytest.raises(ValueError, match=r"moe_expert_cpu_compute='off' is invalid here"):
        HostMissCompute("off", None, {}, None)
    with pytest.raises(ValueError, match="'auto' needs a cost model"):
        HostMissCompute("auto", None, {}, None)
    with pytest.raises(ValueError, match=r"moe_expert_cpu_compute='sometimes' is invalid: must "
                                         r"be one of \['off', 'auto', 'always'\]"):
        layer_config(2, cpu_compute="sometimes")


@pytest.mark.parametrize("moe_backend", ["cpu_kernel", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["always", "auto"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_cached_with_cpu_compute_equals_uncached_bitwise(moe_backend, dtype, mode, n):
    ref = build(0, dtype, moe_backend=moe_backend)
    layer = build(n, dtype, mode, moe_backend)
    assert layer.expert_cache.host_compute.mode == mode
    g = torch.Generator().manual_seed(1)
    pairs = 0
    for T in [1, 7, 64, 1, 300, 3]:
        x = torch.randn(T, H, generator=g).to(dtype)
        logits = torch.randn(T, E, generator=g) + torch.arange(E) * 0.3
        assert torch.equal(layer(x, logits), ref(x, logits)), T
        pairs += 2 * T
    stats = layer.expert_cache.stats()
    assert stats["hits"] + stats["misses"] + stats["cpu_pairs"] >= 0
    if mode == "always":          # nothing is ever loaded: every pair ran on the CPU
        assert stats["cpu_pairs"] == pairs and stats["hits"] == stats["misses"] == 0
        assert stats["bytes_copied"] == 0


@pytest.mark.parametrize("n", [1, 2, 4])
def test_balanced_cpu_compute_equals_uncached_bitwise(n):
    """'auto' with a cost model whose copies run beside the CPU (a GPU's, injected: on a CPU
    device they do not): the misses split between copies and the CPU, same bits."""
    ref, layer = build(0), build(n)
    cost = HostCostModel(copy_seconds=1.0, cpu_fixed=0.9, cpu_per_token=0.05, concurrent=True)
    layer.expert_cache.enable_host_compute("auto", layer.quant_method, H, torch.float32, cost)
    g = torch.Generator().manual_seed(2)
    for T in [1, 1, 2, 1, 5, 1, 1, 3]:
        x = torch.randn(T, H, generator=g)
        logits = torch.randn(T, E, generator=g)
        assert torch.equal(layer(x, logits), ref(x, logits)), T
    stats = layer.expert_cache.stats()
    assert stats["cpu_pairs"] > 0 and stats["misses"] > 0, stats


def test_the_measured_cost_model_is_finite_and_non_negative():
    layer = build(2)
    cache = layer.expert_cache
    cost = measure_cost_model(cache.store.tensors, cache.slots, layer.quant_method.kernel, H,
                              torch.float32)
    values = (cost.copy_seconds, cost.cpu_fixed, cost.cpu_per_token)
    assert all(math.isfinite(v) and v >= 0 for v in values) and cost.copy_seconds > 0
    assert not cost.concurrent       # a CPU device's copies take the CPU's own cores


def test_layers_of_one_layout_share_one_measurement(monkeypatch):
    """'auto' measures the cost model once per store layout (not once per layer): the layers of
    a model get the same numbers; another dtype is measured again."""
    from vllm.model_executor.layers.fused_moe.expert_cache import host_compute
    calls = []
    real = host_compute.measure_cost_model
    monkeypatch.setattr(host_compute, "_COST_MODELS", {})
    monkeypatch.setattr(host_compute, "measure_cost_model",
                        lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    layers = [build(2, cpu_compute="auto") for _ in range(3)]
    costs = {layer.expert_cache.host_compute.cost for layer in layers}
    assert calls == [torch.float32] and len(costs) == 1
    build(2, torch.bfloat16, cpu_compute="auto")
    assert calls == [torch.float32, torch.bfloat16]
    # Another copy engine (exp12's moves fewer bytes) is measured again, not given the other's.
    cache = build(2).expert_cache

    class OtherCopy:
        def __call__(self, slots, plan):
            cache.copy(slots, plan)
    host_compute.cost_model_for(cache.store.tensors, cache.slots, layers[0].quant_method.kernel,
                                H, torch.float32, copy=OtherCopy())
    assert calls == [torch.float32, torch.bfloat16, torch.float32]


def test_auto_measures_its_cost_model_only_while_the_slots_are_empty():
    layer = build(2)
    x, logits = torch.randn(3, H), torch.randn(3, E)
    layer(x, logits)                                     # now slots hold experts
    with pytest.raises(ValueError, match="measures its cost model in an empty slot"):
        layer.expert_cache.enable_host_compute("auto", layer.quant_method, H, torch.float32)


def test_graphs_leave_a_layer_with_cpu_compute_eager():
    """Decode graphs run such a layer between their pieces (``graph_break``) instead of
    refusing the step; CPU graphs have no pieces and leave the step eager."""
    cache = build(2, cpu_compute="always").expert_cache
    assert cache.reads_on_host and cache.cuda_graph_refusal() is None
    assert not cache.cpu_graph_safe
    plain = build(2).expert_cache                        # the same layer without it
    assert plain.cpu_graph_safe and not plain.reads_on_host


def test_host_experts_per_device_and_backend():
    cpu_layer = build(2, moe_backend="cpu_kernel")
    assert host_experts(cpu_layer.quant_method, torch.device("cpu")) is \
        cpu_layer.quant_method.kernel
    assert isinstance(cpu_layer.quant_method.kernel, CpuKernelExperts)
    with pytest.raises(ValueError, match="the 'cpu_kernel' MoE backend keeps the experts in a "
                                         "layout of its own"):
        host_experts(cpu_layer.quant_method, torch.device("cuda"))
    torch_layer = build(2, moe_backend="torch")
    got = host_experts(torch_layer.quant_method, torch.device("cuda"))
    assert isinstance(got, HostExperts) and got is not torch_layer.quant_method.kernel


@pytest.mark.parametrize("scheme,args", [("fp8-block", ["--block-size", "16", "32"]),
                                         ("fp8-channel", []), ("fp8-tensor", []),
                                         ("w4a16-gptq", ["--asym", "--group-size", "32"])])
@pytest.mark.parametrize("gemv", [True, False])
def test_quantized_misses_on_the_cpu_read_the_scheme_layout(tiny_model_factory, tmp_path,
                                                           monkeypatch, scheme, args, gemv):
    """Off a CPU device the CPU side reads the host store in the scheme's layout: through the
    CPU's quantized matrix product (``qgemv``, f32 sums: within rounding of the uncached torch
    backend's dequantize-then-matmul), or, without it, the torch loop dequantizing each expert,
    whose pairs equal the torch backend's bit for bit."""
    src = tiny_model_factory("Qwen3MoeForCausalLM", **TINY)
    path = str(tmp_path / scheme)
    quantize_main(["--model", src, "--out", path, "--scheme", scheme, *args])

    def layer(cache_size):
        cfg = make_vllm_config(path)
        cfg.moe_cache_config.cache_size = cache_size
        cfg.kernel_config.moe_backend = "torch"
        return next(m for m in get_model(cfg).modules() if isinstance(m, FusedMoE))
    cached, twin = layer(2), layer(0)
    experts = host_experts(cached.quant_method, torch.device("cuda"))
    assert experts.rows is not None
    if not gemv:
        experts.rows = None
    calls = []
    real = host_experts_module.qgemv
    monkeypatch.setattr(host_experts_module, "qgemv", lambda x, w: calls.append(w) or real(x, w))
    hc = HostMissCompute("always", experts, cached.expert_cache.store.tensors, None)
    empty = torch.full((cached.num_experts,), -1)            # nothing resident: all to the CPU
    g = torch.Generator().manual_seed(0)
    T, K = 5, cached.top_k
    x = torch.randn(T, cached.hidden_size, generator=g)
    w = torch.rand(T, K, generator=g)
    ids = torch.randint(0, cached.num_experts, (T, K), generator=g)
    ids[1, 0] = -1
    want = torch.zeros(T, K, cached.hidden_size)
    twin.quant_method.apply_pairs(twin.weight_provider.slot_weights(), x, w, ids, want)
    split = hc.split(ids, empty, x, w)
    assert torch.equal(split.host_ids, ids)                  # every row has a CPU pair
    got = torch.zeros(T, K, cached.hidden_size)
    hc.compute(split, got)
    if gemv:    # two products per expert the step uses
        assert len(calls) == 2 * len(set(ids[ids >= 0].tolist()))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert not torch.equal(got, torch.zeros_like(got))
    else:
        assert not calls and torch.equal(got, want)


def _outputs(llm, prompts, params):
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                       for d in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params)]


def test_engine_outputs_bitwise_equal_with_cpu_compute(tiny_model_factory, vllm_log):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 150, (int(n),), generator=g).tolist() for n in (2, 9, 17, 4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    ref = _outputs(LLM(path), prompts, params)
    for mode in ("always", "auto"):
        llm = LLM(path, moe_expert_cache_size=2, moe_expert_cpu_compute=mode)
        assert _outputs(llm, prompts, params) == ref, mode
        stats = llm.get_moe_cache_stats()
        assert "cpu_pairs" in stats and "cpu_expert_calls" in stats["per_layer"]
        if mode == "always":
            assert stats["cpu_pairs"] > 0 and stats["misses"] == 0
    assert '"moe_expert_cpu_compute": "always"' in vllm_log.text
    assert "moe_expert_cpu_compute='auto': HostCostModel(copy_seconds=" in vllm_log.text


def test_engine_refuses_a_bad_mode(tiny_model_factory):
    with pytest.raises(ValueError, match=r"moe_expert_cpu_compute='yes' is invalid"):
        LLM(tiny_model_factory("Qwen3MoeForCausalLM"), moe_expert_cache_size=2,
            moe_expert_cpu_compute="yes")

