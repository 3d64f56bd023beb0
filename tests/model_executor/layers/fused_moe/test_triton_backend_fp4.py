"""The "triton" MoE backend on FP4 experts (NVFP4: ModelOpt and compressed-tensors checkpoints;
MXFP4: GPT-OSS's published blocks / scales, with biases and swigluoai), under Triton's
interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without a GPU): selected for both
schemes; a FusedMoE layer loaded through the methods' own ``load_transform`` equals the same
layer on the ``torch`` backend (which dequantizes with the method's ``dequantize``), and with the
expert cache at 1 (< top_k: several waves), top_k and E/2 slots equals itself uncached bit for
bit; a tiny Qwen3-MoE quantized by ``tools/quantize_checkpoint.py --scheme nvfp4`` and a tiny
GPT-OSS with MXFP4 experts give the torch backend's greedy tokens in fp32, the cached runs the
uncached run's exact logprobs."""
from __future__ import annotations

import os

import pytest
import torch

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation, MoEKernelQuery
from vllm.model_executor.layers.fused_moe.registry import select_moe_backend
from vllm.model_executor.layers.quantization.compressed_tensors import \
    CompressedTensorsNvfp4MoEMethod
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
from vllm.model_executor.layers.quantization.nvfp4 import Nvfp4MoEMethod, quantize_nvfp4
from vllm.platforms import platform_for
from model_executor.layers.quantization.gpt_oss_mxfp4 import gpt_oss_mxfp4, mxfp4_round
from model_executor.tiny_checkpoints import layer_config
from greedy_runs import greedy_run

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

# Every test here runs (or selects for) Triton on CPU tensors: interpreter only (conftest).
pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]
E, TOP_K = 6, 2
SWIGLUOAI = MoEActivation("swigluoai", 1.702, 7.0)


def ct_nvfp4(w):
    """compressed-tensors nvfp4-pack-quantized of one weight: its global scale divides."""
    q = quantize_nvfp4(w)
    return {"weight_packed": q["weight"], "weight_scale": q["weight_scale"],
            "weight_global_scale": (1.0 / q["weight_scale_2"]).reshape(1)}


# name -> (method factory, quantizer of one [out, in] weight, H, N, activation, biases)
LAYER_SCHEMES = {
    "nvfp4-modelopt": (Nvfp4MoEMethod, quantize_nvfp4, 48, 32, "silu", False),
    "nvfp4-compressed-tensors": (CompressedTensorsNvfp4MoEMethod, ct_nvfp4, 48, 32, "silu",
                                 False),
    "mxfp4-gpt-oss": (Mxfp4MoEMethod, mxfp4_round, 64, 32, SWIGLUOAI, True),
}


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_selected_for_fp4_schemes(scheme, dtype):
    q = MoEKernelQuery(scheme, "swigluoai", dtype, 64, 32, platform_for("cpu"), True)
    assert select_moe_backend(q, "triton").name == "triton"
    with pytest.raises(ValueError, match=r"quantized path runs gated activations only, not "
                                         r"'relu2_no_mul'"):
        select_moe_backend(MoEKernelQuery(scheme, "relu2_no_mul", dtype, 64, 32,
                                          platform_for("cpu")), "triton")


# ---- one layer -----------------------------------------------------------------------------
def load_layer(scheme, backend, cache_size=0, seed=0):
    """A FusedMoE layer whose experts are quantized random weights, loaded shard by shard
    through the method's ``load_transform`` under its layer names, as the model loader does."""
    make, quantize, H, N, act, bias = LAYER_SCHEMES[scheme]
    act = MoEActivation.of(act)
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * N, H, generator=g) * 0.1, torch.randn(E, H, N, generator=g) * 0.1
    b13, b2 = torch.randn(E, 2 * N, generator=g) * 0.3, torch.randn(E, H, generator=g) * 0.3
    method = make(act)
    names = {ct.suffix: ct.name for ct in method.checkpoint_tensors}
    with set_current_vllm_config(layer_config(cache_size, moe_backend=backend)):
        layer = FusedMoE(E, TOP_K, H, N, activation=act, bias=bias, quant_method=method,
                         params_dtype=torch.float32)
        for e in range(E):
            for shard, kind, rows in (("w1", "w13", slice(0, N)), ("w3", "w13", slice(N, 2 * N)),
                                      ("w2", "w2", slice(None))):
                w = (w13 if kind == "w13" else w2)[e][rows]
                for suffix, t in quantize(w).items():
                    layer.load_expert_weight(f"{kind}_{names[suffix]}",
                                             method.load_transform(suffix, kind, t), e, shard)
                if bias:
                    layer.load_expert_weight(f"{kind}_bias",
                                             (b13 if kind == "w13" else b2)[e][rows], e, shard)
        layer.finish_loading(torch.device("cpu"))
    assert layer.quant_method.backend_name == backend
    return layer


def batches(H, seed=1, sizes=(1, 7, 30)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(t, H, generator=g), torch.randn(t, E, generator=g)) for t in sizes]


@pytest.mark.parametrize("scheme", list(LAYER_SCHEMES))
def test_layer_equals_torch_backend_and_cache_is_exact(scheme):
    H = LAYER_SCHEMES[scheme][2]
    ref = [load_layer(scheme, "torch")(x, lg) for x, lg in batches(H)]
    layer = load_layer(scheme, "triton")
    codes = "w13_blocks" if scheme.startswith("mxfp4") else "w13_weight"
    packed = getattr(layer, codes)
    assert packed.dtype == torch.uint8                      # read as loaded: no repacking
    got = [layer(x, lg) for x, lg in batches(H)]
    for g, w in zip(got, ref):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    for n in (1, TOP_K, E // 2):        # 1 < top_k: a step's pairs need several waves
        cached = load_layer(scheme, "triton", cache_size=n)
        assert cached.expert_cache is not None
        assert tuple(getattr(cached, codes).shape) == (n, *packed.shape[1:])   # slots, packed
        for (x, lg), want in zip(batches(H), got):
            assert torch.equal(cached(x, lg), want), f"capacity {n}"


# ---- tiny models through the engine --------------------------------------------------------
@pytest.fixture(scope="module", params=["nvfp4-qwen3-moe", "mxfp4-gpt-oss"])
def quantized(request, tiny_model_factory, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    if request.param == "mxfp4-gpt-oss":
        gpt_oss_mxfp4(tiny_model_factory("GptOssForCausalLM", num_hidden_layers=2),
                      os.path.join(path, "m"))
        return os.path.join(path, "m")
    from tools.quantize_checkpoint import main as quantize_main
    src = tiny_model_factory("Qwen3MoeForCausalLM", moe_intermediate_size=32)
    quantize_main(["--model", src, "--out", path, "--scheme", "nvfp4"])
    return path


def test_fp4_tiny_model_tokens_equal_torch_backend(quantized):
    ref, ref_lp, backends, _ = greedy_run(quantized, moe_backend="torch", enforce_eager=True)
    assert backends == {"torch"}
    got, got_lp, backends, _ = greedy_run(quantized, moe_backend="triton")
    assert backends == {"triton"}
    assert got == ref
    torch.testing.assert_close(got_lp, ref_lp, atol=1e-4, rtol=0)
    cached, cached_lp, _, llm = greedy_run(quantized, moe_backend="triton", moe_expert_cache_size=1)
    assert (cached, cached_lp) == (got, got_lp)
    assert llm.get_moe_cache_stats()["misses"] > 0
