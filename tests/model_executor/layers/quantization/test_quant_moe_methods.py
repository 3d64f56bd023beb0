"""Quantized MoE layers: dequantization against plain per-format references written from the
checkpoint layouts, closeness to the float layer they came from, cached == uncached bitwise, slot
tensors only in the cached forward, and per-expert post-load repacking into the store."""
import pytest
import torch

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod, quantize_fp8
from vllm.model_executor.layers.quantization.gptq import GptqMoEMethod, quantize_gptq
from vllm.model_executor.layers.quantization.nvfp4 import Nvfp4MoEMethod, quantize_nvfp4
from tiny_checkpoints import layer_config

E, H, N, TOP_K = 8, 64, 48, 2


# ---- plain references, from the checkpoint layout (one projection [out, in]) -----------------
def ref_fp8(ck, block=None):
    w = ck["weight"].float()
    if "weight_scale_inv" in ck:
        s, (bo, bi) = ck["weight_scale_inv"], block
        out = torch.empty_like(w)
        for r in range(w.shape[0]):
            for c0 in range(0, w.shape[1], bi):
                out[r, c0:c0 + bi] = w[r, c0:c0 + bi] * s[r // bo, c0 // bi]
        return out
    return w * ck["weight_scale"].float().reshape(-1, 1)       # [1] or [out] broadcast per row


def ref_gptq(ck, zero_offset=1):
    qweight, qzeros, scales, g_idx = ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"]
    inp, out = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(out, inp)
    cols = torch.arange(out)
    for i in range(inp):
        q = (qweight[i // 8] >> (4 * (i % 8))) & 15                              # [out]
        g = int(g_idx[i])
        z = ((qzeros[g][cols // 8] >> (4 * (cols % 8))) & 15) + zero_offset       # [out]
        w[:, i] = scales[g].float() * (q - z).float()
    return w


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_nvfp4(ck):
    b = ck["weight"]
    out, half = b.shape
    w = torch.empty(out, half * 2)
    for j in range(half * 2):
        code = (b[:, j // 2] >> (4 * (j % 2))) & 15
        mag = torch.tensor(E2M1)[(code & 7).long()]
        w[:, j] = torch.where(code >= 8, -mag, mag)
    return w * ck["weight_scale"].float().repeat_interleave(16, 1) * ck["weight_scale_2"].float()


# scheme -> (method factory, quantizer of one [out, in] weight, reference dequant, tolerance of
# ||quantized layer - float layer|| / ||float layer||). Measured on these random weights: fp8
# 0.050-0.056 (3 mantissa bits), int4 and fp4 0.14-0.18; tolerances are about 1.4x that.
SCHEMES = {
    "fp8-tensor": (lambda: Fp8MoEMethod("tensor"), lambda w: quantize_fp8(w, "tensor"),
                   ref_fp8, 0.08),
    "fp8-channel": (lambda: Fp8MoEMethod("channel"), lambda w: quantize_fp8(w, "channel"),
                    ref_fp8, 0.08),
    "fp8-block16x32": (lambda: Fp8MoEMethod("block", (16, 32)),
                       lambda w: quantize_fp8(w, "block", (16, 32)),
                       lambda ck: ref_fp8(ck, (16, 32)), 0.08),
    "gptq-g32-sym": (lambda: GptqMoEMethod(32, True, False), lambda w: quantize_gptq(w, 32, True),
                     ref_gptq, 0.25),
    "gptq-g64-asym": (lambda: GptqMoEMethod(64, False, False),
                      lambda w: quantize_gptq(w, 64, False), ref_gptq, 0.25),
    "gptq-g128-sym-descact": (lambda: GptqMoEMethod(128, True, True),
                              lambda w: quantize_gptq(w, 128, True, True), ref_gptq, 0.25),
    "gptq-g32-asym-descact": (lambda: GptqMoEMethod(32, False, True),
                              lambda w: quantize_gptq(w, 32, False, True), ref_gptq, 0.25),
    "gptq-perchannel": (lambda: GptqMoEMethod(-1, True, False),
                        lambda w: quantize_gptq(w, -1, True), ref_gptq, 0.25),
    "nvfp4": (Nvfp4MoEMethod, quantize_nvfp4, ref_nvfp4, 0.25),
}


def vllm_config(cache_size=0):
    # The torch backend: these tests read the method's layout and spy on its ``dequantize``
    # (cpu_kernel, the CPU default, packs its own layout: tests/kernels/cpu/
    # test_moe_experts_quant.py).
    return layer_config(cache_size, moe_backend="torch")


def float_weights(seed=0, e=E, h=H, n=N):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * n, h, generator=g) * 0.1, torch.randn(e, h, n, generator=g) * 0.1


def checkpoint(quantize, w13, w2):
    """{(expert, shard): checkpoint tensors of that projection} as a checkpoint would hold them."""
    n = w13.shape[1] // 2
    return {(e, s): quantize(w) for e in range(w13.shape[0])
            for s, w in (("w1", w13[e][:n]), ("w3", w13[e][n:]), ("w2", w2[e]))}


def load_layer(method, ck, cache_size=0, e=E, h=H, n=N):
    with set_current_vllm_config(vllm_config(cache_size)):
        layer = FusedMoE(e, TOP_K, h, n, quant_method=method, params_dtype=torch.float32)
        shared = {c.suffix for c in method.checkpoint_tensors if c.shared}
        for (ex, shard), tensors in ck.items():
            kind = "w2" if shard == "w2" else "w13"
            for suffix, t in tensors.items():
                if suffix in shared:
                    method.load_shared(layer, f"{kind}_{suffix}", t)
                else:
                    layer.load_expert_weight(f"{kind}_{suffix}",
                                             method.load_transform(suffix, kind, t), ex, shard)
        layer.finish_loading(torch.device("cpu"))
    return layer


def float_layer(w13, w2):
    with set_current_vllm_config(vllm_config()):
        layer = FusedMoE(w13.shape[0], TOP_K, w13.shape[2], w13.shape[1] // 2,
                         params_dtype=torch.float32)
    layer.load_expert_weight("w13_weight", w13, None, None)
    layer.load_expert_weight("w2_weight", w2, None, None)
    layer.finish_loading(torch.device("cpu"))
    return layer


def batches(seed=1, sizes=(1, 5, 40, 3)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(t, H, generator=g), torch.randn(t, E, generator=g)) for t in sizes]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_dequantize_matches_plain_reference(scheme):
    make, quantize, ref, _ = SCHEMES[scheme]
    w13, w2 = float_weights()
    ck = checkpoint(quantize, w13, w2)
    layer = load_layer(make(), ck)
    for e in (0, E - 1):
        got13, got2 = layer.quant_method.dequantize(
            layer.quant_method.expert_row(layer.weight_provider.slot_weights(), e), torch.float32)
        want13 = torch.cat([ref(ck[(e, "w1")]), ref(ck[(e, "w3")])])
        torch.testing.assert_close(got13, want13, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got2, ref(ck[(e, "w2")]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quantized_layer_close_to_float_layer(scheme):
    make, quantize, ref, tol = SCHEMES[scheme]
    w13, w2 = float_weights()
    ck = checkpoint(quantize, w13, w2)
    layer, flt = load_layer(make(), ck), float_layer(w13, w2)
    # The same layer math on reference-dequantized weights: checks apply_pairs itself.
    deq13 = torch.stack([torch.cat([ref(ck[(e, "w1")]), ref(ck[(e, "w3")])]) for e in range(E)])
    deq = float_layer(deq13, torch.stack([ref(ck[(e, "w2")]) for e in range(E)]))
    for x, logits in batches():
        got, want = layer(x, logits), flt(x, logits)
        torch.testing.assert_close(got, deq(x, logits), rtol=1e-5, atol=1e-6)
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < tol, f"{scheme}: relative error {rel:.4f} >= {tol}"


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_cached_bitwise_equal_uncached(scheme):
    make, quantize, _, _ = SCHEMES[scheme]
    ck = checkpoint(quantize, *float_weights(seed=2))
    ref_layer = load_layer(make(), ck)
    want = [ref_layer(x, lg) for x, lg in batches(seed=3)]
    for cache_size in (1, TOP_K, E // 2):
        layer = load_layer(make(), ck, cache_size)
        assert layer.expert_cache is not None
        got = [layer(x, lg) for x, lg in batches(seed=3)]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (scheme, cache_size)


def _ranges(tensors):
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]


@pytest.mark.parametrize("scheme", ["fp8-block16x32", "gptq-g32-asym-descact", "nvfp4"])
def test_cached_forward_reads_only_slot_tensors(scheme):
    """Every tensor the compute reads (weights and every scale, zero point and g_idx) lies inside
    the layer's slot tensors, never inside the host store."""
    make, quantize, _, _ = SCHEMES[scheme]
    layer = load_layer(make(), checkpoint(quantize, *float_weights()), cache_size=3)
    qm, cache = layer.quant_method, layer.expert_cache
    slot_ranges = {n: _ranges([getattr(layer, n)])[0] for n in cache.names}
    store_ranges = _ranges(cache.store.tensors.values())
    assert set(cache.names) == set(qm.expert_tensor_names()) and len(cache.names) >= 4
    for n in cache.names:
        assert getattr(layer, n).shape[0] == 3 and cache.store.tensors[n].shape[0] == E
    seen = []
    real = qm.dequantize

    def spy(t, dtype):
        for name, tensor in t.items():
            p = tensor.data_ptr()
            lo, hi = slot_ranges[name]
            assert lo <= p < hi, f"{name} read outside its slot tensor"
            assert not any(a <= p < b for a, b in store_ranges), f"{name} read from the store"
            seen.append(name)
        return real(t, dtype)
    qm.dequantize = spy
    for x, logits in batches(seed=4):
        layer(x, logits)
    assert set(seen) == set(cache.names)


class UnpackingGptq(GptqMoEMethod):
    """A method whose post-load processing repacks (and doubles) qweight: int32 words -> int8."""

    def __init__(self):
        super().__init__(32, False, True)
        self.calls = []

    def process_expert(self, tensors):
        self.calls.append({n: tuple(t.shape) for n, t in tensors.items()})
        out = dict(super().process_expert(tensors))
        for n in ("w13_qweight", "w2_qweight"):
            out[n] = super().unpacked_weight(out[n]).to(torch.int8)
        return out

    def unpacked_weight(self, qweight):
        return qweight.to(torch.int32)


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("cache_size", [1, E // 2])
def test_repacking_runs_per_expert_into_store_and_device_holds_only_slots(cache_size):
    ck = checkpoint(lambda w: quantize_gptq(w, 32, False, True), *float_weights())
    method = UnpackingGptq()
    layer = load_layer(method, ck, cache_size)
    store = layer.expert_cache.store
    assert len(method.calls) == E                       # once per expert, per-expert shapes
    assert all(c["w13_qweight"] == (2 * N, H // 8) for c in method.calls)
    assert store.tensors["w13_qweight"].shape == (E, 2 * N, H)
    assert store.tensors["w13_qweight"].dtype == torch.int8
    slots = [getattr(layer, n) for n in layer.expert_cache.names]
    assert all(s.shape[0] == cache_size for s in slots)
    assert _nbytes(slots) == cache_size * store.bytes_per_expert
    assert _nbytes(store.tensors.values()) == E * store.bytes_per_expert
    # What the layer holds (its "device" side): the slots plus a few scalars, never the store.
    assert all(getattr(layer, n) is t for n, t in layer.weight_provider.slot_weights().items())
    assert _nbytes(layer.parameters()) - _nbytes(slots) <= 64
    # Same values as the packed method, cached or not.
    plain = load_layer(GptqMoEMethod(32, False, True), ck)
    for x, logits in batches(seed=5):
        assert torch.equal(layer(x, logits), plain(x, logits))


def test_fp8_block_128_with_shapes_not_multiple_of_128():
    e, h, n = 3, 200, 136
    w13, w2 = float_weights(seed=6, e=e, h=h, n=n)
    ck = checkpoint(lambda w: quantize_fp8(w, "block"), w13, w2)
    assert ck[(0, "w1")]["weight_scale_inv"].shape == (2, 2)        # ceil(136/128), ceil(200/128)
    layer = load_layer(Fp8MoEMethod("block", (128, 128)), ck, e=e, h=h, n=n)
    assert layer.w13_weight_scale_inv.shape == (e, 4, 2)
    got13, got2 = layer.quant_method.dequantize(
        layer.quant_method.expert_row(layer.weight_provider.slot_weights(), 1), torch.float32)
    want13 = torch.cat([ref_fp8(ck[(1, "w1")], (128, 128)), ref_fp8(ck[(1, "w3")], (128, 128))])
    torch.testing.assert_close(got13, want13, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got2, ref_fp8(ck[(1, "w2")], (128, 128)), rtol=1e-6, atol=1e-7)
    assert ((got13 - w13[1]).norm() / w13[1].norm()).item() < 0.05


def test_desc_act_g_idx_is_a_group_permutation():
    w = float_weights()[0][0]                                         # [2N, H]
    ck = quantize_gptq(w, 16, True, desc_act=True)
    g = ck["g_idx"].long()
    assert not torch.equal(g, torch.arange(H) // 16)                  # really permuted
    assert torch.bincount(g).tolist() == [16] * (H // 16)             # every group full
    # Permuting the input columns together with g_idx leaves the dequantized weight permuted.
    perm = torch.randperm(H, generator=torch.Generator().manual_seed(0))
    deq = ref_gptq(ck)
    from vllm.model_executor.layers.quantization.utils import pack_int4, unpack_int4
    q = unpack_int4(ck["qweight"], dim=0)[perm]
    permuted = dict(ck, qweight=pack_int4(q, dim=0), g_idx=ck["g_idx"][perm])
    torch.testing.assert_close(ref_gptq(permuted), deq[:, perm])


def test_bad_g_idx_rejected_at_load():
    ck = checkpoint(lambda w: quantize_gptq(w, 32, True, True), *float_weights())
    ck[(2, "w3")]["g_idx"] = ck[(2, "w3")]["g_idx"] + 5
    with pytest.raises(ValueError, match=r"w13_g_idx has values in \[0, 6\].*must be in \[0, 1\]"):
        load_layer(GptqMoEMethod(32, True, True), ck, cache_size=2)


def test_expert_from_checkpoint_is_the_loader_layout():
    """The helper the tests and benchmarks build experts with: gate/up halves of w13 under the
    declared names, as ``load_expert_weight`` fills them; a suffix that is not an expert
    tensor is refused."""
    method = GptqMoEMethod(32, True, False)
    g = torch.Generator().manual_seed(0)
    gate, up, down = (quantize_gptq(torch.randn(*s, generator=g), 32, True)
                      for s in ((64, 32), (64, 32), (32, 64)))
    t = method.expert_from_checkpoint(gate, up, down)
    assert torch.equal(t["w13_qweight"], torch.cat([gate["qweight"].t(), up["qweight"].t()]))
    assert torch.equal(t["w2_scales"], down["scales"].t())
    assert torch.equal(t["w13_g_idx"], torch.stack([gate["g_idx"], up["g_idx"]]))
    with pytest.raises(ValueError, match=r"GptqMoEMethod: 'bias' is not one of its expert"):
        method.expert_from_checkpoint(*({**d, "bias": torch.zeros(1)} for d in (gate, up, down)))


@pytest.mark.parametrize("quantize", [
    lambda w: quantize_gptq(w, 32, False), lambda w: quantize_gptq(w, 32, False, True),
    lambda w: quantize_fp8(w, "block", (8, 32)), lambda w: quantize_fp8(w, "channel"),
    lambda w: quantize_fp8(w, "tensor"), quantize_nvfp4],
    ids=["gptq", "gptq-act-order", "fp8-block", "fp8-channel", "fp8-tensor", "nvfp4"])
def test_the_quantizers_make_their_tensors_on_the_weight_s_device(quantize):
    """Under a default-device context (a layer built ``with torch.device("cuda")``, as the GPU
    tests do) a quantizer's own tensors follow the weight: on the H100 GPTQ's went to the
    context's device beside a CPU weight and the scatter failed. Here the context is ``meta``:
    any tensor made there would make the results meta or raise."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    plain = quantize(w)
    with torch.device("meta"):
        inside = quantize(w)
    assert plain.keys() == inside.keys()
    for name, t in plain.items():
        assert inside[name].device.type == "cpu" and torch.equal(inside[name], t), name
