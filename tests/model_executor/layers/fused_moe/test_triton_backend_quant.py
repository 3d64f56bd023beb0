"""The "triton" MoE backend on weight-only quantized experts (FP8 tensor / channel / block, GPTQ
INT4): selected for those schemes under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py without a GPU); a FusedMoE layer loaded from checkpoints made by the repo's
quantizers (``quantize_fp8``, ``quantize_gptq``) through the methods' own ``load_transform``
equals the same layer on the ``torch`` backend (which dequantizes with the method's
``dequantize``), cached (slot ids over a few slots) and not; and a tiny Qwen3-MoE quantized by
``tools/quantize_checkpoint.py`` gives the torch backend's greedy tokens in fp32, with and
without the expert cache."""
from __future__ import annotations

import pytest
import torch

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEKernelQuery
from vllm.model_executor.layers.fused_moe.registry import select_moe_backend
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod, quantize_fp8
from vllm.model_executor.layers.quantization.gptq import GptqMoEMethod, quantize_gptq
from vllm.platforms import platform_for
from model_executor.tiny_checkpoints import layer_config
from greedy_runs import greedy_run

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

# Every test here runs (or selects for) Triton on CPU tensors: interpreter only (conftest).
pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]
E, H, N, TOP_K = 6, 40, 24, 2      # H = 40: partial K tiles and a partial 16x32 scale block

# name -> (method factory, quantizer of one [out, in] weight)
LAYER_SCHEMES = {
    "fp8-tensor": (lambda: Fp8MoEMethod("tensor"), lambda w: quantize_fp8(w, "tensor")),
    "fp8-channel": (lambda: Fp8MoEMethod("channel"), lambda w: quantize_fp8(w, "channel")),
    "fp8-block16x32": (lambda: Fp8MoEMethod("block", (16, 32)),
                       lambda w: quantize_fp8(w, "block", (16, 32))),
    "fp8-block128": (lambda: Fp8MoEMethod("block", (128, 128)),
                     lambda w: quantize_fp8(w, "block")),
    "gptq-g8-asym-descact": (lambda: GptqMoEMethod(8, False, True),
                             lambda w: quantize_gptq(w, 8, False, True)),
    "gptq-channel-sym-v2": (lambda: GptqMoEMethod(-1, True, False, "gptq_v2"),
                            lambda w: quantize_gptq(w, -1, True, checkpoint_format="gptq_v2")),
    "gptq-g32-asym": (lambda: GptqMoEMethod(32, False, False),
                      lambda w: quantize_gptq(w, 32, False)),
}
CONTIGUOUS = {"gptq-g8-asym-descact": False, "gptq-channel-sym-v2": True, "gptq-g32-asym": True}
"""Whether the layer may read one group per K tile (g_idx of contiguous groups, found at load:
the kernel then skips g_idx, and with groups of 32 or the whole row each tile lies in one)."""


@pytest.fixture
def interpreted(triton_interpreter):
    """Triton kernels on CPU tensors (tests/conftest.py: skipped where the interpreter is off)."""


@pytest.mark.parametrize("scheme", ["fp8-tensor", "fp8-channel", "fp8-block", "w4a16-gptq"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_selected_for_quantized_schemes(interpreted, scheme, dtype):
    q = MoEKernelQuery(scheme, "silu", dtype, H, N, platform_for("cpu"), True)
    assert select_moe_backend(q, "triton").name == "triton"
    with pytest.raises(ValueError, match=r"quantized path runs gated activations only, not "
                                         r"'relu2_no_mul'"):
        select_moe_backend(MoEKernelQuery(scheme, "relu2_no_mul", dtype, H, N,
                                          platform_for("cpu")), "triton")


# ---- one layer -----------------------------------------------------------------------------
def load_layer(method, quantize, backend, cache_size=0, seed=0):
    """A FusedMoE layer whose experts are ``quantize``d random weights, loaded shard by shard
    through the method's ``load_transform`` as the model loader does."""
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * N, H, generator=g) * 0.1, torch.randn(E, H, N, generator=g) * 0.1
    with set_current_vllm_config(layer_config(cache_size, moe_backend=backend)):
        layer = FusedMoE(E, TOP_K, H, N, quant_method=method, params_dtype=torch.float32)
        for e in range(E):
            for shard, kind, w in (("w1", "w13", w13[e][:N]), ("w3", "w13", w13[e][N:]),
                                   ("w2", "w2", w2[e])):
                for suffix, t in quantize(w).items():
                    layer.load_expert_weight(f"{kind}_{suffix}",
                                             method.load_transform(suffix, kind, t), e, shard)
        layer.finish_loading(torch.device("cpu"))
    assert layer.quant_method.backend_name == backend
    return layer


def batches(seed=1, sizes=(1, 7, 30)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(t, H, generator=g), torch.randn(t, E, generator=g)) for t in sizes]


@pytest.mark.parametrize("scheme", list(LAYER_SCHEMES))
def test_layer_equals_torch_backend_cached_and_not(interpreted, scheme):
    make, quantize = LAYER_SCHEMES[scheme]
    ref = load_layer(make(), quantize, "torch")
    want = [ref(x, lg) for x, lg in batches()]
    for cache_size in (0, 2):
        layer = load_layer(make(), quantize, "triton", cache_size)
        assert (layer.expert_cache is not None) == bool(cache_size)
        if scheme in CONTIGUOUS:
            assert layer.quant_method.contiguous_groups == {"w13": CONTIGUOUS[scheme],
                                                            "w2": CONTIGUOUS[scheme]}
        for (x, lg), w in zip(batches(), want):
            torch.testing.assert_close(layer(x, lg), w, atol=1e-5, rtol=1e-5)


# ---- a tiny model through the engine -------------------------------------------------------
E2E_SCHEMES = {"fp8-tensor": ["--scheme", "fp8-tensor"],
               "fp8-channel": ["--scheme", "fp8-channel"],
               "fp8-block16x32": ["--scheme", "fp8-block", "--block-size", "16", "32"],
               "w4a16-gptq-g16-asym-descact": ["--scheme", "w4a16-gptq", "--asym",
                                               "--desc-act", "--group-size", "16"],
               "w4a16-gptq-g128-sym": ["--scheme", "w4a16-gptq"]}


@pytest.fixture(scope="module", params=list(E2E_SCHEMES))
def quantized(request, tiny_model_factory, tmp_path_factory):
    from tools.quantize_checkpoint import main as quantize_main
    src = tiny_model_factory("Qwen3MoeForCausalLM", moe_intermediate_size=32)
    path = str(tmp_path_factory.mktemp(request.param))
    quantize_main(["--model", src, "--out", path, *E2E_SCHEMES[request.param]])
    return path


def test_quantized_tiny_model_tokens_equal_torch_backend(interpreted, quantized):
    ref, ref_lp, backends, _ = greedy_run(quantized, moe_backend="torch", enforce_eager=True)
    assert backends == {"torch"}
    for cache in (0, TOP_K):
        got, got_lp, backends, llm = greedy_run(quantized, moe_backend="triton",
                                          moe_expert_cache_size=cache)
        assert backends == {"triton"}
        assert got == ref, f"moe_expert_cache_size={cache}"
        torch.testing.assert_close(got_lp, ref_lp, atol=1e-4, rtol=0)
        if cache:
            assert llm.get_moe_cache_stats()["misses"] > 0
