"""The CUDA decode path rehearsed on CPU with a capturer that keeps a graph's semantics
(``graph_recorder.RecordingCapturer``: a capture executes nothing, a replay runs only the
recorded kernels and ops, none of the step's Python). Bugs that ``EagerCapturer`` hides, such
as Python state a real replay would not recompute, fail here as on a GPU."""
from __future__ import annotations

import pytest
import torch
from graph_recorder import RecordingCapturer, recording
from host_sync_audit import HostSync
from side_streams import hand_out_side_streams
from test_cuda_path_on_cpu import QUANT_SCHEMES, RehearsalPlatform, _run, quantized_tiny

from vllm.platforms import _PLATFORMS

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]


@pytest.fixture
def recorded(monkeypatch):
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    with recording(monkeypatch) as capturer:
        yield capturer


def test_the_recorder_runs_nothing_at_capture_and_only_the_record_at_replay():
    """A write runs at each replay and not at capture; a computation reads its inputs' values
    at replay, while a Python value it used is the one the capture saw; a break's function runs
    at its point of each replay."""
    from vllm.model_executor.graph_break import break_graph
    capturer = RecordingCapturer()
    buf, x, scale, order = torch.zeros(3), torch.ones(3), [2.0], []

    def fn():
        buf.add_(1)
        y = break_graph(lambda: order.append(buf[0].item()) or buf * 10, x)
        return x * scale[0] + y
    replay = capturer.capture(fn)
    assert buf.tolist() == [0.0] * 3 and order == [] and capturer.breaks == 1
    x.fill_(3.0)
    scale[0] = 5.0
    assert replay().tolist() == [16.0] * 3 and buf.tolist() == [1.0] * 3
    assert replay().tolist() == [26.0] * 3 and order == [1.0, 2.0]


def test_the_recorder_refuses_a_host_read():
    with pytest.raises(HostSync):
        RecordingCapturer().capture(lambda: torch.ones(2).sum().item())


def _stats(runner):
    return [m.expert_cache.stats() for m in runner.moe_layers if m.expert_cache is not None]


@pytest.mark.parametrize("arch,kw", [
    ("Qwen3MoeForCausalLM", {}),
    ("Qwen3MoeForCausalLM", dict(moe_expert_cache_size=2, moe_expert_cache_policy="lrfu_next")),
    ("DeepseekV2ForCausalLM", {}),
    ("DeepseekV2ForCausalLM", dict(moe_expert_cache_size=3)),
    ("Qwen3MoeForCausalLM", dict(moe_expert_cache_size=2, moe_expert_prefetch="next-layer")),
    ("Qwen3MoeForCausalLM", dict(moe_expert_cache_size=2, moe_expert_overlap=True)),
    ("MixtralForCausalLM", dict(moe_expert_cache_size=1, moe_expert_cache_policy="lfu")),
    ("GptOssForCausalLM", dict(moe_expert_cache_size=2)),
    ("DeepseekV3ForCausalLM", dict(moe_expert_cache_size=3, moe_expert_prefetch="next-layer")),
    ("Qwen3MoeForCausalLM", dict(dtype="bfloat16", moe_expert_cache_size=2,
                                 moe_expert_link_compression="exp12",
                                 moe_expert_prefetch="next-layer", moe_expert_overlap=True))])
def test_replays_that_run_no_python_equal_eager(tiny_model_factory, recorded, monkeypatch, arch,
                                                kw):
    """Tokens and every cache counter equal enforce_eager's when replays run only what the
    capture recorded."""
    hand_out_side_streams(monkeypatch, RehearsalPlatform)
    path = tiny_model_factory(arch)
    kw = {"dtype": "float32", **kw}
    eager, eager_runner = _run(path, enforce_eager=True, **kw)
    got, runner = _run(path, **kw)
    assert runner.decode_graphs.refused is None, runner.decode_graphs.refused
    assert recorded.replays > 0 and recorded.breaks == 0
    assert got == eager
    assert _stats(runner) == _stats(eager_runner)


@pytest.mark.parametrize("mode,prefetch,whole,exp12", [
    ("always", "off", False, False), ("auto", "off", False, False),
    ("auto", "next-layer", False, False), ("auto", "off", True, False),
    ("auto", "next-layer", False, True)])
def test_cpu_compute_runs_between_graph_pieces(tiny_model_factory, recorded, monkeypatch, mode,
                                               prefetch, whole, exp12):
    """``moe_expert_cpu_compute`` reads each step's routing on the host: a decode graph runs
    each MoE layer's split and CPU pairs eagerly between its pieces and captures the device's
    waves between them (two breaks per MoE layer and capture), or, where the waves cannot be
    captured (``whole``: the provider's ``capture_refusal`` says why), the whole layer (one).
    Tokens and every counter (CPU pairs included: graph padding rows stay off the CPU) equal
    enforce_eager's, batches 3 and 1 padded to 4 and 1, with next-layer prefetch too, and with
    exp12 link compression (bf16) beside it. "auto"
    gets a fixed cost model (a measured one differs between the two runs): an expert is
    rented twice, then bought."""
    from vllm.model_executor.layers.fused_moe.expert_cache import host_compute
    from vllm.model_executor.layers.fused_moe.expert_cache.provider import CachedWeightProvider
    if whole:
        monkeypatch.setattr(CachedWeightProvider, "capture_refusal", lambda self: "a test's")
    cost = host_compute.HostCostModel(copy_seconds=1.0, cpu_fixed=0.4, cpu_per_token=0.0,
                                      concurrent=True)
    monkeypatch.setattr(host_compute, "_COST_MODELS", {})
    monkeypatch.setattr(host_compute, "measure_cost_model", lambda *a, **k: cost)
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    kw = dict(dtype="bfloat16" if exp12 else "float32", moe_expert_cache_size=2,
              moe_expert_cpu_compute=mode, moe_expert_prefetch=prefetch,
              moe_expert_link_compression="exp12" if exp12 else "off")
    eager, eager_runner = _run(path, enforce_eager=True, **kw)
    got, runner = _run(path, **kw)
    graphs = runner.decode_graphs
    assert graphs.refused is None, graphs.refused
    assert recorded.replays > 0
    per_layer = 1 if whole else 2
    assert recorded.breaks == per_layer * len(runner.moe_layers) * len(graphs.captured_sizes)
    assert got == eager
    stats = _stats(runner)
    assert stats == _stats(eager_runner)
    if mode == "always" or exp12:
        assert sum(s["cpu_pairs"] for s in stats) > 0
    if exp12:
        assert 0 < sum(s["link_bytes_copied"] for s in stats) < sum(s["bytes_copied"]
                                                                    for s in stats)


@QUANT_SCHEMES
def test_quantized_replays_that_run_no_python_equal_eager(tiny_model_factory, recorded, tmp_path,
                                                          scheme):
    """The Triton FP8 / INT4 kernels on slot weights and slot scales, cached, replayed from
    the record: enforce_eager's tokens and counters."""
    path = quantized_tiny(tiny_model_factory, tmp_path, scheme)
    kw = dict(dtype="float32", moe_expert_cache_size=2)
    eager, eager_runner = _run(path, enforce_eager=True, **kw)
    got, runner = _run(path, **kw)
    assert runner.decode_graphs.refused is None and recorded.replays > 0
    assert got == eager and _stats(runner) == _stats(eager_runner)
