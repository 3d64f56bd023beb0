"""The CUDA decode path rehearsed on CPU, before any GPU sees it.

The CPU device is given the CUDA platform's choices (``RehearsalPlatform``: its "auto" orders
pick the ``triton`` MoE backend and ``triton_paged`` attention; the Triton residency step, the
Triton expert gather and the Triton RMSNorm/activation/rotary kernels), the kernels run under
Triton's interpreter, and decode steps go through ``CudaDecodeGraphs`` with a capturer that runs
every captured step under ``audit_host_syncs``: an op that reads device data on the host (which a
CUDA graph capture refuses) fails the test. What this cannot check: the capture itself, streams,
pinned memory and the compiled kernels (the ``gpu`` tests in test_cuda_graphs.py do)."""
from __future__ import annotations

import pytest
import torch
from host_sync_audit import HostSync, audit_host_syncs
from rehearsal import RehearsalPlatform
from side_streams import hand_out_side_streams

from vllm import LLM, SamplingParams
from vllm.platforms import _PLATFORMS, elementwise_ops
from vllm.worker import cuda_graphs
from vllm.worker.graph_capture import EagerCapturer

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]


class AuditingCapturer(EagerCapturer):
    """A replay re-runs the captured step under the host-sync audit."""

    def __init__(self):
        self.replays = 0

    def capture(self, fn):
        def replay():
            self.replays += 1
            with audit_host_syncs():
                return fn()
        return replay


@pytest.fixture
def rehearsal(monkeypatch):
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    monkeypatch.setattr(cuda_graphs, "uses_cuda_graphs", lambda device: True)
    capturer = AuditingCapturer()
    monkeypatch.setattr(cuda_graphs, "default_capturer", lambda device: capturer)
    return capturer


def _run(path, **kw):
    llm = LLM(path, device="cpu", max_num_seqs=4, cuda_graph_sizes=[1, 2, 4], **kw)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 3], [250, 7], [11] * 9)]
    params = [SamplingParams(max_tokens=3 + i, ignore_eos=True) for i in range(3)]
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.runner


@pytest.mark.parametrize("arch,dtype,cache", [
    ("Qwen3MoeForCausalLM", "float32", None),
    ("Qwen3MoeForCausalLM", "float32", (2, "lrfu_next")),
    ("Qwen3MoeForCausalLM", "float16", (5, "lru")),
    ("MixtralForCausalLM", "float32", (1, "lfu")),
    ("GptOssForCausalLM", "float32", (2, "lrfu")),
    ("DeepseekV2ForCausalLM", "float32", (3, "lrfu_next")),
    ("DeepseekV3ForCausalLM", "float32", None)])
def test_cuda_decode_path_has_no_host_reads(tiny_model_factory, rehearsal, arch, dtype, cache):
    """Every layer on its CUDA choice, the expert cache inside the graphs: the replays (batches
    3, 2, 1 padded to 4, 2, 1) read nothing on the host and give enforce_eager's tokens."""
    from vllm.kernels.triton.expert_gather import expert_gather
    path = tiny_model_factory(arch)
    kw = dict(dtype=dtype)
    if cache is not None:
        kw.update(moe_expert_cache_size=cache[0], moe_expert_cache_policy=cache[1])
    eager, _ = _run(path, enforce_eager=True, **kw)
    got, runner = _run(path, **kw)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.refused is None, graphs and graphs.refused
    assert graphs.captured_sizes == [1, 2, 4] and rehearsal.replays > 0
    assert elementwise_ops(runner.dtype, runner.device) is not None
    assert {a.impl.name for a in runner.attn_layers} == {"triton_paged"}
    assert {m.quant_method.kernel.name for m in runner.moe_layers} == {"triton"}
    if cache is not None:
        for m in runner.moe_layers:
            assert m.expert_cache.step.name == "triton"
            assert m.expert_cache.copy.kernel is expert_gather
            assert m.expert_cache.cuda_graph_refusal() is None
    assert got == eager


QUANT_SCHEMES = pytest.mark.parametrize(
    "scheme", [["--scheme", "fp8-block", "--block-size", "16", "32"],
               ["--scheme", "w4a16-gptq", "--asym", "--desc-act", "--group-size", "16"]],
    ids=["fp8-block", "w4a16-gptq"])


def quantized_tiny(tiny_model_factory, tmp_path, scheme: list[str]) -> str:
    """A tiny Qwen3-MoE quantized by tools/quantize_checkpoint.py with ``scheme``'s arguments."""
    from tools.quantize_checkpoint import main as quantize_main
    src = tiny_model_factory("Qwen3MoeForCausalLM", moe_intermediate_size=32)
    quantize_main(["--model", src, "--out", str(tmp_path), *scheme])
    return str(tmp_path)


@QUANT_SCHEMES
def test_quantized_experts_on_the_cuda_path_have_no_host_reads(tiny_model_factory, rehearsal,
                                                               tmp_path, scheme):
    """The Triton FP8 / INT4 MoE kernels on the slot weights and slot scales, cached, in the
    graphs: no host read, enforce_eager's tokens."""
    path = quantized_tiny(tiny_model_factory, tmp_path, scheme)
    kw = dict(dtype="float32", moe_expert_cache_size=2)
    eager, _ = _run(path, enforce_eager=True, **kw)
    got, runner = _run(path, **kw)
    assert runner.decode_graphs.refused is None and rehearsal.replays > 0
    assert {m.quant_method.kernel.name for m in runner.moe_layers} == {"triton"}
    assert got == eager


@pytest.mark.parametrize("overlap,prefetch", [(True, "off"), (False, "next-layer"),
                                              (True, "next-layer")])
def test_overlap_and_prefetch_on_the_cuda_path_have_no_host_reads(tiny_model_factory, rehearsal,
                                                                  monkeypatch, overlap,
                                                                  prefetch):
    """``moe_expert_overlap`` (the hit/miss split, forked copies) and next-layer prefetch (its
    hooks: the next router, ``Residency.load``, the copy) inside the graphs read nothing on the
    host; tokens and every cache counter equal enforce_eager's."""
    streams = hand_out_side_streams(monkeypatch, RehearsalPlatform)
    path = tiny_model_factory("Qwen3MoeForCausalLM", num_hidden_layers=3)
    kw = dict(dtype="float32", moe_expert_cache_size=2, moe_expert_prefetch=prefetch)

    def forked(role):
        return any(("fork", role) in st.roles for st in streams)
    eager, eager_runner = _run(path, enforce_eager=True, **kw)
    assert not forked("misses") and forked("account")   # the residency step's account only
    got, runner = _run(path, moe_expert_overlap=overlap, **kw)
    assert runner.decode_graphs.refused is None and rehearsal.replays > 0
    assert forked("misses") == overlap
    assert got == eager
    stats = [m.expert_cache.stats() for m in runner.moe_layers]
    assert stats == [m.expert_cache.stats() for m in eager_runner.moe_layers]
    if prefetch != "off":
        assert stats[1]["prefetch_loads"] > 0


def _replayed_launches(tiny_model_factory, monkeypatch, batch: int):
    """(launch counts of each replayed decode step, MoE layers) of the tiny Qwen3-MoE (E = 6,
    top-2) with 2 cache slots at ``batch`` sequences, on the CUDA path rehearsed here."""
    from launch_count import count_launches
    counts = []

    class Counting(EagerCapturer):
        def capture(self, fn):
            def replay():
                with count_launches() as n:
                    out = fn()
                counts.append(n)
                return out
            return replay
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    monkeypatch.setattr(cuda_graphs, "uses_cuda_graphs", lambda device: True)
    monkeypatch.setattr(cuda_graphs, "default_capturer", lambda device: Counting())
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    llm = LLM(path, device="cpu", max_num_seqs=batch, cuda_graph_sizes=[batch], dtype="float32",
              moe_expert_cache_size=2)
    prompts = [{"prompt_token_ids": [5, 17, 99]}, {"prompt_token_ids": [250, 7]}][:batch]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert counts
    return counts, len(llm.llm_engine.runner.moe_layers)


def test_a_replayed_cached_decode_step_launches_few_kernels(tiny_model_factory, monkeypatch):
    """What a replayed decode step (cache on) would launch on a GPU, counted here: Triton
    launches plus the aten ops outside them that run a kernel. At most 26 per layer (about 22
    today: norms (the residual adds fused into them), rotary (Qwen3's q/k norms fused into it),
    KV write, attention and its reduce, router, residency step (route and account), two
    gathers, the align, two
    GEMMs, the activation, projections (q/k/v as one), the sum over k);
    before the one-launch align and router it was about 67, most of them the align's 30 small
    torch ops."""
    counts, L = _replayed_launches(tiny_model_factory, monkeypatch, 1)
    assert L == 2
    for n in counts:
        assert n.triton["_align_kernel"] == n.triton["_topk_softmax_kernel"] == L
        # One wave: its route, and its account on a side stream (off the way to the experts).
        assert n.triton["_residency_step_kernel"] == 2 * L
        # Two norms per layer and the final one; q/k norms ride in the rotary launch.
        assert n.triton["_rms_norm_kernel"] == 2 * L + 1 and n.triton["_rotary_kernel"] == L
        # One q/k/v GEMM, o_proj and the router gate per layer, and the LM head.
        assert n.torch["linear"] == 3 * L + 1, n.torch
        assert sum(n.triton.values()) + sum(n.torch.values()) <= 26 * L, (n.triton, n.torch)
        assert sum(n.torch.values()) <= 10 * L, n.torch
        assert "add" not in n.torch, n.torch       # residual adds ride in the norms' launches


def test_a_replayed_step_of_two_waves_has_one_residency_step_per_layer(tiny_model_factory,
                                                                        monkeypatch):
    """Batch 2 x top-2 with 2 slots: two waves a layer by shape (issue 26: one residency step
    per layer, its route and its account for the side stream, as at batch 1). The second wave
    still launches its align and expert kernels; nothing else of the layer repeats."""
    one, L = _replayed_launches(tiny_model_factory, monkeypatch, 1)
    monkeypatch.undo()
    two, L2 = _replayed_launches(tiny_model_factory, monkeypatch, 2)
    assert L == L2 == 2
    for n in one + two:
        assert n.triton["_residency_step_kernel"] == 2 * L
    for n in two:
        assert n.triton["_align_kernel"] == 2 * L and n.triton["_topk_softmax_kernel"] == L
    # What a wave adds per layer (2026-11-27): its align, two GEMMs, the activation and its
    # copy (here the Triton gather, a launch per tensor: 2; vllm._C's gathers all in one).
    extra = (sum(two[0].triton.values()) + sum(two[0].torch.values())) - \
        (sum(one[0].triton.values()) + sum(one[0].torch.values()))
    assert 0 < extra <= 6 * L, (two[0].triton, two[0].torch, one[0].triton, one[0].torch)


def test_the_audit_catches_a_host_read_in_a_captured_step(tiny_model_factory, rehearsal,
                                                           monkeypatch):
    """The same run with one ``.item()`` slipped into the MoE layer fails at the first replay,
    naming the op (a CUDA graph capture would refuse it)."""
    from vllm.model_executor.layers.fused_moe import layer as moe_layer
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    forward = moe_layer.FusedMoE.forward

    def leaky(self, hidden_states, *a, **k):
        hidden_states.abs().max().item()
        return forward(self, hidden_states, *a, **k)
    monkeypatch.setattr(moe_layer.FusedMoE, "forward", leaky)
    with pytest.raises(HostSync, match="aten.item"):
        _run(path, dtype="float32")


@pytest.mark.parametrize("read,needle", [
    (lambda y: y.max().item(), "aten.item"), (lambda y: int(y[2]), "aten.item"),
    (lambda y: bool(y[1] > 0), "is_nonzero"), (lambda y: y.nonzero(), "nonzero"),
    (lambda y: torch.nonzero(y, as_tuple=True), "nonzero"), (lambda y: y[y > 1], "boolean mask"),
    (lambda y: y.unique(), "_unique2"), (lambda y: torch.repeat_interleave(y.long()), "output_size"),
    (lambda y: torch.tensor([1, 2]), "torch.tensor"), (lambda y: y.tolist(), "tolist"),
    (lambda y: y.cpu(), "cpu"), (lambda y: y.to("cpu"), "Tensor.to")])
def test_the_audit_names_each_kind_of_host_read(read, needle):
    with torch.inference_mode():
        y = torch.arange(6.0)
        read(y)                                         # outside the audit: allowed
        with pytest.raises(HostSync, match=needle), audit_host_syncs():
            read(y)
        with audit_host_syncs():                        # device-side work is not flagged
            (y * 2).topk(2), y.masked_fill(y > 2, 0), y.to(torch.float16), torch.tensor(3.0)
