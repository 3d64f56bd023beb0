"""The CPU side of ``moe_expert_cpu_compute`` off a CPU device (``expert_cache/host_compute.py``):
``host_expert_mlp`` against the reference and an expert written out here, and (``gpu``) the mode
on a CUDA GPU against the uncached engine, unquantized and quantized (``qgemv``)."""
from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.kernels.cpu.gemv16 import gemv16 as host_experts_gemv16
from vllm.model_executor.layers.fused_moe.expert_cache.host_experts import host_expert_mlp
from vllm.model_executor.layers.fused_moe.modular_kernel import MOE_ACTIVATIONS, MoEActivation


def _mlp64(x, w13, w2, act, b13, b2):
    """One expert in float64, written out: the activation on (x w13^T + b13), then w2."""
    x, w13, w2, b13, b2 = (t.double() for t in (x, w13, w2, b13, b2))
    h = x @ w13.T + b13
    if act == "relu2_no_mul":
        a = torch.relu(h) ** 2
    else:
        gate, up = h.chunk(2, dim=-1)
        if act == "silu":
            a = torch.nn.functional.silu(gate) * up
        elif act == "gelu":
            a = torch.nn.functional.gelu(gate) * up
        else:                                   # GPT-OSS: interleaved is not this layout's
            return None
    return a @ w2.T + b2


@pytest.mark.parametrize("dtype,gemv", [(torch.float32, False), (torch.bfloat16, False),
                                        (torch.bfloat16, True), (torch.float16, True)])
@pytest.mark.parametrize("act", MOE_ACTIVATIONS)
@pytest.mark.parametrize("tokens", [1, 3, 5])
def test_host_expert_mlp_is_the_expert(monkeypatch, dtype, gemv, act, tokens):
    """The CPU's expert: with ``gemv`` (the CPU kernels built) a bf16 / f16 expert of at most 4
    tokens through ``gemv16`` (twice: gate-up and down), else one token by matrix-vector
    products (F.linear is not called) and more by the reference's expert_mlp; each the expert
    written out in float64."""
    from vllm.model_executor.layers.fused_moe.expert_cache import host_experts
    from vllm.model_executor.layers.fused_moe.torch_ref import expert_mlp
    from vllm.platforms import native_kernels
    if gemv and not native_kernels(torch.float32, torch.device("cpu")):
        pytest.skip("the CPU kernels are not built")
    calls = []
    monkeypatch.setattr(host_experts, "gemv16",
                        lambda x, w: calls.append(tuple(w.shape)) or host_experts_gemv16(x, w))
    g = torch.Generator().manual_seed(3)
    n, k = 16, 32
    rows = n if act == "relu2_no_mul" else 2 * n
    w13, w2 = torch.randn(rows, k, generator=g), torch.randn(k, n, generator=g) * 0.3
    x, b13, b2 = torch.randn(tokens, k, generator=g), torch.randn(rows, generator=g), \
        torch.randn(k, generator=g)
    x, w13, w2, b13, b2 = (t.to(dtype) for t in (x, w13, w2, b13, b2))
    want = expert_mlp(x, w13, w2, MoEActivation.of(act), b13, b2)
    if tokens == 1:
        def no_linear(*a, **kw):
            raise AssertionError("F.linear on a one-token expert")
        monkeypatch.setattr(torch.nn.functional, "linear", no_linear)
    got = host_expert_mlp(x, w13, w2, MoEActivation.of(act), b13, b2, gemv=gemv)
    assert got.shape == (tokens, k) and got.dtype == dtype
    assert calls == ([(rows, k), (k, n)] if gemv and tokens <= 4 else [])
    tol = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2 * float(want.abs().max())),
           torch.float16: dict(rtol=2e-3, atol=2e-3 * float(want.abs().max())),
           torch.float32: dict(rtol=1e-5, atol=1e-4)}[dtype]
    torch.testing.assert_close(got, want, **tol)
    ref = _mlp64(x, w13, w2, act, b13, b2)
    if ref is not None:
        torch.testing.assert_close(got.double(), ref, rtol=tol["rtol"],
                                   atol=tol["atol"] + 1e-3 * float(ref.abs().max()))


@pytest.mark.parametrize("gemv", [True, False])
@pytest.mark.parametrize("tokens", [1, 4, 5])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32])
def test_an_expert_as_exp12_planes_gives_the_bf16_experts_bits(gemv, tokens, xdtype):
    """With link compression the CPU reads the planes (``Exp12Rows``): up to 4 tokens through
    gemv16_exp12 where the kernels are built, else (more tokens, or no kernels) decoded first
    (in C, or by the torch reference). Each way, the bits of the same expert given as its bf16
    tensors; a w13 that stayed a tensor beside planes of w2 too."""
    from vllm.kernels.cpu.exp12 import Exp12Rows
    from vllm.model_executor.layers.fused_moe.expert_cache.link_codec import encode
    from vllm.platforms import native_kernels
    if gemv and not native_kernels(torch.float32, torch.device("cpu")):
        pytest.skip("the CPU kernels are not built")
    if xdtype == torch.float32 and (not gemv or tokens > 4):
        pytest.skip("only gemv16 takes f32 tokens with bf16 weights (torch wants one dtype)")
    g = torch.Generator().manual_seed(7)
    n, k = 64, 128
    w13 = torch.randn(1, 2 * n, k, generator=g).mul_(0.1).bfloat16()
    w2 = torch.randn(1, k, n, generator=g).mul_(0.1).bfloat16()
    w13[0, 0, :2] = torch.tensor([1e-30, -1e-31])                      # escapes
    x = torch.randn(tokens, k, generator=g).to(xdtype)
    act = MoEActivation.of("silu")

    def rows(t):
        c = encode(t)
        return Exp12Rows(c.lo[0], c.codes[0], c.base[0], c.esc_index[0], c.esc_bits[0],
                         tuple(t.shape[1:]))
    want = host_expert_mlp(x, w13[0], w2[0], act, gemv=gemv)
    for a, b in ((rows(w13), rows(w2)), (w13[0], rows(w2))):
        got = host_expert_mlp(x, a, b, act, gemv=gemv)
        assert got.dtype == xdtype and torch.equal(got, want)


def _cuda_outputs(path, **kw):
    """Decode steps replay CUDA graphs, a layer with CPU compute between their pieces
    (``graph_break``): a capture that failed (the steps then run eagerly) fails the test."""
    llm = LLM(path, device="cuda", dtype="float32", **kw)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [[5, 17, 99, 3], [250, 7], list(range(40, 90)), [11] * 9]
    outs = [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                      for d in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params)]
    graphs = llm.llm_engine.runner.decode_graphs
    if not kw.get("enforce_eager"):
        assert graphs is not None and graphs.refused is None, graphs and graphs.refused
    return outs, llm.get_moe_cache_stats()


@pytest.mark.gpu
def test_cpu_compute_in_graph_pieces_equals_eager_on_cuda(tiny_model_factory):
    """On a CUDA GPU (not yet run on one): decode graphs in pieces around the CPU's work (its
    split and pairs run between them) give enforce_eager's tokens, logprobs and counters
    bitwise (the same kernels on both sides)."""
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    kw = dict(moe_expert_cache_size=2, moe_expert_cpu_compute="always")
    eager, eager_stats = _cuda_outputs(path, enforce_eager=True, **kw)
    got, stats = _cuda_outputs(path, **kw)
    assert stats["cpu_pairs"] > 0 and stats == eager_stats
    assert got == eager


@pytest.mark.gpu
@pytest.mark.parametrize("mode,early", [("always", True), ("always", False), ("auto", True)])
def test_cpu_compute_on_cuda_matches_uncached(tiny_model_factory, monkeypatch, mode, early):
    """On a CUDA GPU (not yet run on one): misses computed on the CPU while the device runs its
    waves give the uncached greedy tokens, and logprobs within float32 rounding (another kernel
    computes those pairs); the decode inputs come back with the routing's read (``early``) or
    after it (``EARLY_READ_BYTES`` 0: prefill's path everywhere)."""
    from vllm.model_executor.layers.fused_moe.expert_cache import host_compute
    if not early:
        monkeypatch.setattr(host_compute, "EARLY_READ_BYTES", 0)
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    ref, _ = _cuda_outputs(path)
    got, stats = _cuda_outputs(path, moe_expert_cache_size=2, moe_expert_cpu_compute=mode)
    if mode == "always":
        assert stats["cpu_pairs"] > 0 and stats["misses"] == 0, stats
    for (tokens, lps), (want_tokens, want_lps) in zip(got, ref):
        assert tokens == want_tokens
        for row, want_row in zip(lps, want_lps):
            assert [t for t, _ in row] == [t for t, _ in want_row]
            assert [lp for _, lp in row] == pytest.approx([lp for _, lp in want_row], abs=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["fp8-block", "w4a16-gptq", "nvfp4"])
def test_quantized_cpu_compute_on_cuda_matches_uncached(tiny_model_factory, tmp_path, scheme):
    """On a CUDA GPU: quantized misses computed on the CPU from the host store through
    ``qgemv`` (the triton backend keeps the scheme's layout there) give the uncached greedy
    tokens, and logprobs within rounding (another kernel computes those pairs). Tiny shapes:
    FP8 blocks of 16 x 32, GPTQ group 32. fp8-block's checkpoint declares fp8 activations
    (1 x 32 groups): the GPU's kernel quantizes them (W8A8), the CPU's ``qgemv`` runs
    weight-only, so those pairs differ by e4m3's rounding of the inputs (3 mantissa bits), not
    the float32 sums' order: 4.0e-3 on an H100 (2026-11-27), beside 2e-3 for the others."""
    from tools.quantize_checkpoint import main as quantize_main
    args = {"fp8-block": ["--block-size", "16", "32"], "w4a16-gptq": ["--group-size", "32"],
            "nvfp4": []}[scheme]
    path = str(tmp_path / scheme)
    quantize_main(["--model", tiny_model_factory("Qwen3MoeForCausalLM",
                                                 moe_intermediate_size=32),
                   "--out", path, "--scheme", scheme, *args])
    ref, _ = _cuda_outputs(path)
    got, stats = _cuda_outputs(path, moe_expert_cache_size=2, moe_expert_cpu_compute="always")
    assert stats["cpu_pairs"] > 0 and stats["misses"] == 0, stats
    tol = 2e-2 if scheme == "fp8-block" else 2e-3
    for (tokens, lps), (want_tokens, want_lps) in zip(got, ref):
        assert tokens == want_tokens
        for row, want_row in zip(lps, want_lps):
            assert [lp for _, lp in row] == pytest.approx([lp for _, lp in want_row], abs=tol)
