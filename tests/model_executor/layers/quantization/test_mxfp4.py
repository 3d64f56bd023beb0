"""MXFP4 experts in the published GPT-OSS layout: codes packed here by an independent packer,
dequantized by a plain reference written from the format, by transformers' reader
(``convert_moe_packed_tensors``) and by ours; the layer (biases, swigluoai) against a float layer
on the reference weights, on the torch backend (the layout as loaded) and on the C kernel (CPU
"auto": bit for bit the float layer's C kernel); the expert cache holding the packed tensors;
config parsing."""
from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from vllm.config import set_current_vllm_config
from vllm.config.quantization import parse_quant_config
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation
from vllm.model_executor.layers.quantization import get_moe_quant_method
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
from tiny_checkpoints import layer_config as vllm_config

E, H, N, TOP_K = 6, 64, 32, 2
ACT = MoEActivation("swigluoai", 1.702, 7.0)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def random_codes(rows, cols, seed):
    """e2m1 codes uint8 [E, rows, cols] and e8m0 scales uint8 [E, rows, cols / 32] (2^-8..2^-3)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (E, rows, cols), generator=g, dtype=torch.uint8)
    scales = torch.randint(119, 125, (E, rows, cols // 32), generator=g).to(torch.uint8)
    return codes, scales


def pack(codes):
    """The published packing, written from the format: [..., C] codes -> [..., C/32, 16] bytes,
    byte j of a block = code 2j (low nibble) | code 2j + 1 (high nibble)."""
    lo, hi = codes[..., 0::2].to(torch.int32), codes[..., 1::2].to(torch.int32)
    return (lo + 16 * hi).to(torch.uint8).reshape(*codes.shape[:-1], -1, 16)


def reference(codes, scales):
    """Dequantized [E, rows, cols] float64, from the unpacked codes."""
    mag = torch.tensor(E2M1, dtype=torch.float64)[(codes % 8).long()]
    val = torch.where(codes >= 8, -mag, mag)
    return val * (2.0 ** (scales.double() - 127)).repeat_interleave(32, dim=-1)


@pytest.fixture(scope="module")
def ck():
    """One layer in our [gate; up] row order: w13 rows 2N over H inputs, w2 rows H over N."""
    c13, s13 = random_codes(2 * N, H, 0)
    c2, s2 = random_codes(H, N, 1)
    g = torch.Generator().manual_seed(2)
    return {"c13": c13, "s13": s13, "c2": c2, "s2": s2,
            "b13": torch.randn(E, 2 * N, generator=g).bfloat16(),
            "b2": torch.randn(E, H, generator=g).bfloat16()}


def mxfp4_layer(ck, cache_size=0, backend="torch"):
    with set_current_vllm_config(vllm_config(cache_size, moe_backend=backend)):
        method = Mxfp4MoEMethod(ACT)
        layer = FusedMoE(E, TOP_K, H, N, activation=ACT, bias=True, quant_method=method,
                         params_dtype=torch.float32)
        for e in range(E):
            for shard, rows in (("w1", slice(0, N)), ("w3", slice(N, 2 * N))):
                for suffix, t in (("blocks", pack(ck["c13"][e, rows])),
                                  ("scales", ck["s13"][e, rows])):
                    layer.load_expert_weight(f"w13_{suffix}",
                                             method.load_transform(suffix, "w13", t), e, shard)
                layer.load_expert_weight("w13_bias", ck["b13"][e, rows], e, shard)
            layer.load_expert_weight("w2_blocks", pack(ck["c2"][e]), e, "w2")
            layer.load_expert_weight("w2_scales", ck["s2"][e], e, "w2")
            layer.load_expert_weight("w2_bias", ck["b2"][e], e, "w2")
        layer.finish_loading(torch.device("cpu"))
    return layer


def float_layer(ck):
    with set_current_vllm_config(vllm_config()):
        layer = FusedMoE(E, TOP_K, H, N, activation=ACT, bias=True, params_dtype=torch.float32)
    for name, t in (("w13_weight", reference(ck["c13"], ck["s13"])),
                    ("w2_weight", reference(ck["c2"], ck["s2"])),
                    ("w13_bias", ck["b13"]), ("w2_bias", ck["b2"])):
        layer.load_expert_weight(name, t.float(), None, None)
    layer.finish_loading(torch.device("cpu"))
    return layer


def batches(seed=3, sizes=(1, 5, 40, 3)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(t, H, generator=g), torch.randn(t, E, generator=g)) for t in sizes]


def test_packer_agrees_with_transformers_reader(ck):
    """transformers' reader on our packing gives the reference (in x out, as it returns it)."""
    for c, s in ((ck["c13"], ck["s13"]), (ck["c2"], ck["s2"])):
        theirs = convert_moe_packed_tensors(pack(c), s, dtype=torch.float32)
        assert torch.equal(theirs.transpose(1, 2).double(), reference(c, s))


def test_dequantize_matches_reference_and_tensors_stay_packed(ck):
    layer = mxfp4_layer(ck)
    qm = layer.quant_method
    assert qm.expert_tensor_names() == ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales",
                                        "w13_bias", "w2_bias")
    assert layer.w13_blocks.dtype == torch.uint8 and layer.w13_blocks.shape == (E, 2 * N, 2, 16)
    assert layer.w2_scales.shape == (E, H, 1) and layer.w13_bias.dtype == torch.float32
    for e in range(E):
        w13, w2 = qm.dequantize(qm.expert_row(layer.weight_provider.slot_weights(), e),
                                torch.float32)
        assert torch.equal(w13.double(), reference(ck["c13"], ck["s13"])[e])
        assert torch.equal(w2.double(), reference(ck["c2"], ck["s2"])[e])


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_layer_equals_float_layer_on_reference_weights(ck, backend):
    layer, flt = mxfp4_layer(ck, backend=backend), float_layer(ck)
    if backend == "torch":
        assert layer.quant_method.backend_name == "torch"
        for x, logits in batches():
            torch.testing.assert_close(layer(x, logits), flt(x, logits), rtol=1e-6, atol=1e-6)
        return
    # The C kernel dequantizes in its GEMM to the very weights of the float layer's C kernel.
    assert layer.quant_method.backend_name == flt.quant_method.backend_name == "cpu_kernel"
    for x, logits in batches():
        assert torch.equal(layer(x, logits), flt(x, logits))


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_cached_bitwise_equal_uncached_with_packed_slots(ck, backend):
    want = [mxfp4_layer(ck, backend=backend)(x, lg) for x, lg in batches(seed=4)]
    for n in (1, TOP_K, E // 2):
        layer = mxfp4_layer(ck, cache_size=n, backend=backend)
        cache = layer.expert_cache
        assert set(cache.names) == set(layer.quant_method.expert_tensor_names())
        assert layer.w13_blocks.dtype == torch.uint8
        if backend == "torch":        # as loaded
            assert layer.w13_blocks.shape == (n, 2 * N, 2, 16)
            assert cache.store.tensors["w13_blocks"].shape == (E, 2 * N, 2, 16)
        else:                         # the C kernel's layout: still 4-bit codes, e8m0 bytes
            assert layer.quant_method.backend_name == "cpu_kernel"
            assert layer.w13_blocks.shape == (n, 2 * N * H // 2)
            assert cache.store.tensors["w13_scales"].shape == (E, 2 * N * H // 32)
        got = [layer(x, lg) for x, lg in batches(seed=4)]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), n


def test_shapes_and_dtypes_checked():
    with set_current_vllm_config(vllm_config()):
        with pytest.raises(ValueError, match="mxfp4: hidden_size=48 is not a multiple of 32"):
            FusedMoE(E, TOP_K, 48, N, quant_method=Mxfp4MoEMethod())
    with pytest.raises(ValueError, match="blocks has dtype torch.int8"):
        Mxfp4MoEMethod().load_transform("blocks", "w13", torch.zeros(2, 2, 16, dtype=torch.int8))


def test_quantization_config_parsed():
    qc = parse_quant_config({"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    assert qc.scheme == "mxfp4" and qc.describe() == "mxfp4 (mxfp4), experts only"

    class Layer:
        prefix, activation = "model.layers.3.mlp.experts", ACT
    method = get_moe_quant_method(qc, Layer())
    assert isinstance(method, Mxfp4MoEMethod) and method.activation == ACT
