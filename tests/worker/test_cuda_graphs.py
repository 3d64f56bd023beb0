"""CUDA decode graphs (``vllm/worker/cuda_graphs.py``). Without a GPU the module runs on CPU with
``EagerCapturer`` (a replay re-runs the captured function over the static buffers), which checks
everything but the capture itself: padded sizes, static buffers and their staging, padding rows,
eager steps above the largest size, the expert cache inside, eligibility and the config. The
tests marked ``gpu`` capture real CUDA graphs."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch
from graph_checks import check_replays_against_eager, record_block_ids

from vllm import LLM, SamplingParams
from vllm.config import SchedulerConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.attention.torch_sdpa import TorchSdpaAttention
from vllm.model_executor.layers.fused_moe.registry import GroupedMMExperts, TorchExperts
from vllm.worker import cuda_graphs
from vllm.worker.cuda_graphs import CudaDecodeGraphs, cuda_graph_refusal
from vllm.worker.graph_capture import GraphCapturer


@pytest.fixture
def on_cpu(monkeypatch):
    """Decode graphs on CPU are CudaDecodeGraphs (with the eager capturer), not CPU graphs."""
    monkeypatch.setattr(cuda_graphs, "uses_cuda_graphs", lambda device: True)


def _requests(n: int = 6):
    """n requests admitted together that finish one after another: the decode batch shrinks
    n, n-1, ..., 1 (greedy and seeded sampling alternate)."""
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 200, (int(L),), generator=g).tolist()}
               for L in torch.randint(2, 30, (n,), generator=g)]
    params = [SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True,
                             temperature=0.0 if i % 2 else 0.9, top_p=0.9, seed=i)
              for i in range(n)]
    return prompts, params


def _generate(path, prompts, params, **kwargs):
    llm = LLM(path, device="cpu", max_num_seqs=6, **kwargs)
    runner = llm.llm_engine.runner
    steps: list[tuple[int, bool]] = []           # (decode batch size, replayed)
    graphs = runner.decode_graphs
    if graphs is not None:
        orig = graphs.logits

        def spy(input_ids, positions, md, ids=None):
            out = orig(input_ids, positions, md, ids=ids)
            if md.num_decodes == md.num_seqs:
                steps.append((input_ids.shape[0], out is not None))
            return out
        graphs.logits = spy
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs], runner, steps


def _cache_state(runner):
    return [(m.expert_cache.stats(), m.expert_cache.residency.slot_of_expert.tolist(),
             {k: v.tolist() for k, v in m.expert_cache.residency.policy_state.items()})
            for m in runner.moe_layers]


@pytest.mark.parametrize("arch,dtype,cache", [("Qwen3MoeForCausalLM", "float32", None),
                                              ("Qwen3MoeForCausalLM", "bfloat16", (2, "lru")),
                                              ("Qwen3MoeForCausalLM", "float32", (1, "lrfu")),
                                              ("MixtralForCausalLM", "float32", (2, "lfu")),
                                              ("Qwen3ForCausalLM", "float32", None)])
def test_graph_decode_equals_eager(tiny_model_factory, on_cpu, arch, dtype, cache):
    """Sizes [2, 4] under max_num_seqs=6: batches 1 and 3 replay padded graphs, 2 and 4 exact
    ones, 5 and 6 run eagerly; tokens (and the expert cache's state) equal enforce_eager's."""
    path = tiny_model_factory(arch)
    prompts, params = _requests()
    kw = dict(dtype=dtype)
    if cache is not None:
        kw.update(moe_expert_cache_size=cache[0], moe_expert_cache_policy=cache[1])
    eager, eager_runner, _ = _generate(path, prompts, params, enforce_eager=True, **kw)
    assert eager_runner.decode_graphs is None
    got, runner, steps = _generate(path, prompts, params, cuda_graph_sizes=[4, 2, 4], **kw)
    graphs = runner.decode_graphs
    assert isinstance(graphs, CudaDecodeGraphs) and graphs.refused is None
    assert graphs.sizes == [2, 4] and graphs.captured_sizes == [2, 4]
    assert {(1, True), (2, True), (3, True), (4, True), (5, False), (6, False)} <= set(steps)
    assert got == eager
    if cache is not None:
        assert _cache_state(runner) == _cache_state(eager_runner)


def test_replayed_logits_equal_eager_logits_bitwise(tiny_model_factory, on_cpu):
    """Each replay (padded or exact) against the eager forward of the same step's B rows."""
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    llm = LLM(path, device="cpu", max_num_seqs=6, cuda_graph_sizes=[1, 4, 6])
    checked = check_replays_against_eager(llm)
    llm.generate(*_requests())
    assert {2, 3, 5} <= set(checked) and {1, 4, 6} <= set(checked)


def test_padding_rows_leave_the_kv_cache_alone(tiny_model_factory, on_cpu):
    """Three sequences replay the graph of four rows: the padding row writes no KV (every block
    the engine did not hand out stays zero) and the tokens are the eager ones."""
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]},
               {"prompt_token_ids": [10, 11, 12, 13]}]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eager, _, _ = _generate(path, prompts, params, enforce_eager=True)
    llm = LLM(path, device="cpu", max_num_seqs=6, cuda_graph_sizes=[4])
    runner = llm.llm_engine.runner
    used = record_block_ids(runner)
    outs = llm.generate(prompts, params)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs] == eager
    assert runner.decode_graphs.captured_sizes == [4]
    for attn in runner.attn_layers:
        untouched = [b for b in range(attn.kv_cache.shape[1]) if b not in used]
        assert untouched and attn.kv_cache[:, untouched].abs().sum() == 0


class _FailingCapturer(GraphCapturer):
    def __init__(self):
        self.failures = 0

    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    def after_failure(self):
        self.failures += 1


def test_a_failed_capture_runs_decode_eagerly_from_then_on(tiny_model_factory, on_cpu,
                                                           monkeypatch, vllm_log):
    monkeypatch.setattr(cuda_graphs, "default_capturer", lambda device: _FailingCapturer())
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts, params = _requests()
    eager, _, _ = _generate(path, prompts, params, enforce_eager=True)
    got, runner, steps = _generate(path, prompts, params)
    assert got == eager
    graphs = runner.decode_graphs
    assert "stream is capturing" in graphs.refused and graphs.captured_sizes == []
    assert sum(replayed for _, replayed in steps) == 1       # the warm-up step's own logits
    assert vllm_log.text.count("capturing a CUDA graph of batch size") == 1


def test_a_failed_capture_drops_what_the_aborted_forward_left(tiny_model_factory, on_cpu,
                                                              monkeypatch):
    """The capturer drains once, and every cached layer forgets the prefetch the aborted
    forward forked (its copy never ran); tokens still equal eager's."""
    from vllm.model_executor.layers.fused_moe.expert_cache.provider import \
        CachedWeightProvider
    capturer = _FailingCapturer()
    monkeypatch.setattr(cuda_graphs, "default_capturer", lambda device: capturer)
    forgot = []
    orig = CachedWeightProvider.forget_capture

    def spy(self):
        self._prefetch_in_flight = "in flight"
        orig(self)
        forgot.append((self._prefetch_in_flight, self._settled))
    monkeypatch.setattr(CachedWeightProvider, "forget_capture", spy)
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts, params = _requests()
    eager, _, _ = _generate(path, prompts, params, enforce_eager=True, moe_expert_cache_size=2)
    got, runner, _ = _generate(path, prompts, params, moe_expert_cache_size=2)
    assert got == eager and capturer.failures == 1
    assert forgot == [(None, False)] * len(runner.moe_layers) and len(forgot) > 0


@pytest.mark.parametrize("kwargs,reason", [
    (dict(moe_backend="torch"), "MoE backend 'torch' is not cuda_graph_safe"),
    (dict(attention_backend="torch_sdpa"), "attention backend 'torch_sdpa' is not"),
    (dict(moe_routing_trace_path="TRACE"), "routing trace")])
def test_refused_models_decode_eagerly(tiny_model_factory, on_cpu, tmp_path, vllm_log, kwargs,
                                       reason):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    kwargs = {k: str(tmp_path / "t.npz") if v == "TRACE" else v for k, v in kwargs.items()}
    assert LLM(path, device="cpu", **kwargs).llm_engine.runner.decode_graphs is None
    assert "no CUDA graphs" in vllm_log.text and reason in vllm_log.text
    assert LLM(path, device="cpu", enforce_eager=True).llm_engine.runner.decode_graphs is None


# ---- eligibility, with stubs --------------------------------------------------------------
def _attn(impl="safe"):
    if impl == "safe":
        impl = SimpleNamespace(name="triton_paged", cuda_graph_safe=True)
    return SimpleNamespace(prefix="layers.0.attn", impl=impl)


class _Cache:
    def __init__(self, reason=None, reads_on_host=False):
        self.reason, self.reads_on_host = reason, reads_on_host

    def cuda_graph_refusal(self):
        return self.reason


def _moe(kernel=None, cache=None, observer=None):
    kernel = kernel or GroupedMMExperts.__new__(GroupedMMExperts)
    return SimpleNamespace(prefix="layers.0.mlp.experts", routing_observer=observer,
                           expert_cache=cache, quant_method=SimpleNamespace(kernel=kernel))


@pytest.mark.parametrize("layers,reason", [
    (dict(state_layers=[object()]), "1 recurrent-state layers"),
    (dict(attn_layers=[_attn(None)]), "no KV cache is bound"),
    (dict(attn_layers=[_attn(TorchSdpaAttention(4, 8, 2, 1.0))]),
     "attention backend 'torch_sdpa' is not cuda_graph_safe"),
    (dict(moe_layers=[_moe(observer=print)]), "routing trace"),
    (dict(moe_layers=[_moe(kernel=TorchExperts.__new__(TorchExperts))]),
     "MoE backend 'torch' is not cuda_graph_safe"),
    (dict(moe_layers=[_moe(cache=_Cache("no copy kernel"))]), "expert cache: no copy kernel"),
    (dict(moe_layers=[_moe(kernel=TorchExperts.__new__(TorchExperts), cache=_Cache())]),
     "MoE backend 'torch' is not cuda_graph_safe"),
    (dict(moe_layers=[_moe(cache=_Cache())]), None),
    # moe_expert_cpu_compute: the layer runs between the graph's pieces, whatever its backend.
    (dict(moe_layers=[_moe(kernel=TorchExperts.__new__(TorchExperts),
                           cache=_Cache(reads_on_host=True))]), None),
    (dict(), None)])
def test_refusal_reasons(layers, reason):
    args = dict(attn_layers=[_attn()], moe_layers=[_moe()], state_layers=[])
    args.update(layers)
    got = cuda_graph_refusal(**args)
    assert got == reason if reason is None else reason in got


def _cached_layer():
    """A loaded float32 FusedMoE (8 experts, top-2) with 3 cache slots on CPU."""
    from vllm.config import (CacheConfig, DeviceConfig, MoECacheConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    E, H, I = 8, 32, 16
    cfg = VllmConfig(None, CacheConfig(), SchedulerConfig(), MoECacheConfig(cache_size=3),
                     DeviceConfig("cpu"))
    with set_current_vllm_config(cfg):
        layer = FusedMoE(E, 2, H, I, params_dtype=torch.float32)
    layer.load_expert_weight("w13_weight", torch.randn(E, 2 * I, H), None, None)
    layer.load_expert_weight("w2_weight", torch.randn(E, H, I), None, None)
    layer.finish_loading(torch.device("cpu"))
    return layer


def test_provider_refusal_names_the_step_and_the_copy(monkeypatch):
    """A cached layer is capturable with the fused residency step and a sync-free copy: not the
    tensor-op reference step, nor a copy that reads the plan on the host."""
    from vllm.model_executor.layers.fused_moe.expert_cache import copy as copy_mod
    from vllm.model_executor.layers.fused_moe.expert_cache.residency_step import ReferenceStep
    from vllm.platforms import native_kernels, platform_for
    if not native_kernels(torch.float32, torch.device("cpu")):
        pytest.skip("the C kernels are not built")
    provider = _cached_layer().expert_cache
    assert provider.cuda_graph_refusal() is None                  # C step, C copy
    provider.copy = copy_mod.CopyEngine(provider.store, copy_mod._copy_torch_fallback, False)
    assert "reads the load plan on the host" in provider.cuda_graph_refusal()
    provider.step = ReferenceStep(on_host=True)
    assert "tensor-op reference" in provider.cuda_graph_refusal()
    cuda_copy = copy_mod.CudaKernelCopy(provider.store)
    monkeypatch.setattr(copy_mod, "_cuda_copy_kernel", None)
    monkeypatch.setattr(type(platform_for("cuda")), "expert_copy_kernel", lambda self: None)
    assert not cuda_copy.sync_free
    copy_mod.register_cuda_copy_kernel(lambda *a: None)
    assert cuda_copy.sync_free


# ---- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("max_num_seqs,sizes,want", [
    (256, None, [1, 2, 4] + list(range(8, 257, 8))), (6, None, [1, 2, 4, 6]), (1, None, [1]),
    (8, [4, 1, 4, 2], [1, 2, 4]), (8, (8,), [8])])
def test_cuda_graph_sizes_default_and_normalisation(max_num_seqs, sizes, want):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, cuda_graph_sizes=sizes)
    assert cfg.cuda_graph_sizes == want


@pytest.mark.parametrize("sizes,needle", [
    ([], "non-empty list"), ("1,2", "non-empty list"), ([0, 2], "integer >= 1, not 0"),
    ([1, 2.5], "not 2.5"), ([True], "not True"), ([1, 16, 32], "<= max_num_seqs=8"),
    (4, "non-empty list")])
def test_cuda_graph_sizes_refused(sizes, needle):
    with pytest.raises(ValueError, match="cuda_graph_sizes=") as e:
        SchedulerConfig(max_num_seqs=8, cuda_graph_sizes=sizes)
    assert needle in str(e.value)


def test_cuda_graph_sizes_engine_argument_and_flag(tiny_model_factory):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    cfg = EngineArgs.from_kwargs(model=path, max_num_seqs=16,
                                 cuda_graph_sizes=[8, 1]).create_engine_config()
    assert cfg.scheduler_config.cuda_graph_sizes == [1, 8]
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--cuda-graph-sizes", "1", "2", "4"])
    assert EngineArgs.from_cli_args(ns).cuda_graph_sizes == [1, 2, 4]
    assert parser.parse_args([]).cuda_graph_sizes is None
    with pytest.raises(ValueError, match="<= max_num_seqs=16"):
        EngineArgs.from_kwargs(model=path, max_num_seqs=16,
                               cuda_graph_sizes=[32]).create_engine_config()


def test_padded_size_is_shared_with_cpu_graphs():
    from vllm.config.graph_sizes import default_graph_sizes, padded_size
    from vllm.worker.cpu_graphs import padded_size as cpu_padded
    ladder = default_graph_sizes(1024)
    assert all(padded_size(b, ladder) == cpu_padded(b) for b in range(1, 1025))
    assert padded_size(3, [2, 4]) == 4 and padded_size(5, [2, 4]) is None


# ---- on a GPU --------------------------------------------------------------------------------
def _gpu_run(path, **kw):
    llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=6, **kw)
    runner = llm.llm_engine.runner
    replays = []
    graphs = runner.decode_graphs
    if graphs is not None:
        orig = graphs.logits

        def check(input_ids, positions, md, ids=None):
            """A replay equals an eager run over the same static buffers, bit for bit."""
            P = cuda_graphs.padded_size(input_ids.shape[0], graphs.sizes)
            entry = graphs._entries.get(P)
            replayed = entry is not None and entry.replay is not None
            got = orig(input_ids, positions, md, ids=ids)
            if got is not None and replayed:
                got = got.clone()
                assert torch.equal(got, graphs._run(P, entry)[:input_ids.shape[0]])
                replays.append(input_ids.shape[0])
            return got
        graphs.logits = check
    prompts, params = _requests()
    params = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, temperature=0.0)
              for p in params]
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], runner, replays


def _mirror_copy_kernel():
    """A sync-free stand-in for the CUDA build's expert gather (``UvaCopyKernel``): each store
    tensor mirrored on the device at its first (eager) call, then one masked row copy per plan
    entry, in stream order, with no host read."""
    mirrors: dict[int, torch.Tensor] = {}

    def kernel(src, dst, experts, slots, valid):
        mirror = mirrors.get(src.data_ptr())
        if mirror is None:                     # only eagerly: a copy would sync in a capture
            mirror = mirrors[src.data_ptr()] = src.to(dst.device)
        for i in range(experts.shape[0]):
            e = experts[i:i + 1].clamp(0, mirror.shape[0] - 1)
            s = slots[i:i + 1].clamp(0, dst.shape[0] - 1)
            keep = valid[i:i + 1].view(-1, *[1] * (dst.dim() - 1))
            dst.index_copy_(0, s, torch.where(keep, mirror.index_select(0, e),
                                              dst.index_select(0, s)))
    return kernel


@pytest.mark.gpu
@pytest.mark.parametrize("cache", [0, 2])
def test_cuda_graph_replay_equals_eager_on_gpu(tiny_model_factory, monkeypatch, cache):
    """Real CUDA graphs (passed on an H100, 2026-11-26): tokens equal enforce_eager's, and
    every replay equals an eager forward over the same static inputs. With the cache, the
    residency step must be the Triton kernel; the copy is the build's gather kernel, else a
    sync-free stand-in (without either the layer is refused)."""
    from vllm.model_executor.layers.fused_moe.expert_cache import copy as copy_mod
    from vllm.platforms import platform_for
    if cache and platform_for("cuda").expert_copy_kernel() is None:
        monkeypatch.setattr(copy_mod, "_cuda_copy_kernel", _mirror_copy_kernel())
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    kw = dict(moe_expert_cache_size=cache, cuda_graph_sizes=[2, 4])
    eager, _, _ = _gpu_run(path, enforce_eager=True, **kw)
    got, runner, replays = _gpu_run(path, **kw)
    refusal = cuda_graph_refusal(runner.attn_layers, runner.moe_layers, runner.state_layers)
    assert runner.decode_graphs is not None, refusal
    if cache:
        assert all(m.expert_cache.step.name == "triton" for m in runner.moe_layers)
    assert runner.decode_graphs.refused is None and runner.decode_graphs.captured_sizes == [2, 4]
    assert {1, 2, 3, 4} <= set(replays)
    assert got == eager
