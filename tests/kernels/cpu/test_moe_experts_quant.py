"""The C expert kernel on FP8 (tensor, channel, block scales) and INT4 GPTQ experts
(``qgemm.h``, ``qgemm_codes.h``), against a plain torch dequantize-then-matmul reference written
here from the checkpoint layouts. f32 activations run the unquantized kernel's chains on
float(code - zero) * scale: bit for bit that kernel on the dequantized weights (under GPTQ act
order on the input rows sorted by group, so within f32 summation order of it). bf16 activations
feed the codes' exact values to the bf16 pair chain and scale f32 accumulators per group
(``qgemm_codes.h``): within f32 rounding of the reference on the unrounded dequantized weights,
the same bits in every build, and each pair's value independent of the others in the call. GPTQ
act order is packed with each projection's rows sorted by group and its perm (``sort_groups``):
bitwise the plain group-wise kernel on the gathered activations.
"""
from __future__ import annotations

import pytest
import torch
from cpu_builds import assert_pairs_same_bits_in_build
from pair_checks import assert_pairs_independent
import torch.nn.functional as F

from vllm.kernels.cpu.ops import prepack
from vllm.model_executor.layers.fused_moe.cpu_kernel import expert_pairs_cpu
from vllm.model_executor.layers.fused_moe.registry import CpuKernelExperts, TorchExperts
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod, quantize_fp8
from vllm.model_executor.layers.quantization.gptq import GptqMoEMethod, quantize_gptq
from vllm.model_executor.layers.quantization.moe_ref import stack_experts


# ---- plain references from the checkpoint layout of one projection [out, in] --------------------
def ref_fp8(ck, block=None):
    w = ck["weight"].float()
    if block is None:
        return w * ck["weight_scale"].float().reshape(-1, 1)          # [1] or [out, 1]
    bo, bi = block
    s = ck["weight_scale_inv"].float()
    rows = torch.arange(w.shape[0]) // bo
    cols = torch.arange(w.shape[1]) // bi
    return w * s[rows][:, cols]


def ref_gptq(ck, zero_offset=1):
    qweight, qzeros, scales, g_idx = ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"]
    inp, out = qweight.shape[0] * 8, qweight.shape[1]
    i = torch.arange(inp)
    q = (qweight[i // 8] >> (4 * (i % 8))[:, None]) & 15                       # [in, out]
    g = g_idx.long()
    o = torch.arange(out)
    z = ((qzeros[g][:, o // 8] >> (4 * (o % 8))) & 15) + zero_offset            # [in, out]
    return (scales[g].float() * (q - z).float()).t()


SCHEMES = {
    "fp8-tensor": (lambda: Fp8MoEMethod("tensor"), lambda w: quantize_fp8(w, "tensor"), ref_fp8),
    "fp8-channel": (lambda: Fp8MoEMethod("channel"), lambda w: quantize_fp8(w, "channel"),
                    ref_fp8),
    "fp8-block": (lambda: Fp8MoEMethod("block", (128, 128)), lambda w: quantize_fp8(w, "block"),
                  lambda ck: ref_fp8(ck, (128, 128))),
    "fp8-block16x32": (lambda: Fp8MoEMethod("block", (16, 32)),
                       lambda w: quantize_fp8(w, "block", (16, 32)),
                       lambda ck: ref_fp8(ck, (16, 32))),
    "gptq-g32-sym": (lambda: GptqMoEMethod(32, True, False), lambda w: quantize_gptq(w, 32, True),
                     ref_gptq),
    "gptq-g64-asym": (lambda: GptqMoEMethod(64, False, False),
                      lambda w: quantize_gptq(w, 64, False), ref_gptq),
    "gptq-g128-sym": (lambda: GptqMoEMethod(128, True, False),
                      lambda w: quantize_gptq(w, 128, True), ref_gptq),
    "gptq-perchannel-asym": (lambda: GptqMoEMethod(-1, False, False),
                             lambda w: quantize_gptq(w, -1, False), ref_gptq),
    "gptq-g32-asym-descact": (lambda: GptqMoEMethod(32, False, True),
                              lambda w: quantize_gptq(w, 32, False, True), ref_gptq),
    "gptq-v2-g64": (lambda: GptqMoEMethod(64, False, False, "gptq_v2"),
                    lambda w: quantize_gptq(w, 64, False, checkpoint_format="gptq_v2"),
                    lambda ck: ref_gptq(ck, 0)),
}
FP8 = [s for s in SCHEMES if s.startswith("fp8")]
GPTQ = [s for s in SCHEMES if s.startswith("gptq")]
ACT_ORDER = ["gptq-g32-asym-descact"]
"""Schemes whose packed input rows are sorted by group (so f32 sums in another order than the
unquantized kernel on the dequantized weights)."""


def _experts(scheme, E, H, N, seed=0, activation="silu"):
    """-> (kernel with its packed weights, torch backend with the method's tensors,
    dequantized w13 [E, 2N, H], w2 [E, H, N] from the reference)."""
    make, quant, ref = SCHEMES[scheme]
    method = make()
    g = torch.Generator().manual_seed(seed)
    per_expert, w13s, w2s = [], [], []
    for _ in range(E):
        cks = [quant(torch.randn(*shape, generator=g) * 0.2) for shape in ((N, H), (N, H), (H, N))]
        w13s.append(torch.cat([ref(cks[0]), ref(cks[1])]))
        w2s.append(ref(cks[2]))
        per_expert.append(method.expert_from_checkpoint(*cks))
    stacked = stack_experts(per_expert)
    act = MoEActivation.of(activation)
    kernel = CpuKernelExperts(act)
    kernel.bind_scheme(method)
    return (kernel, kernel.pack(stacked), TorchExperts(act, method.dequantizer()), stacked,
            torch.stack(w13s), torch.stack(w2s))


def _routing(T, E, K, seed, skip_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if skip_frac:
        ids = torch.where(torch.rand(T, K, generator=g) < skip_frac, -1, ids)
    return ids, torch.rand(T, K, generator=g)


def _reference(x, w13, w2, wts, ids, dtype, round_weights=True):
    """Dequantize-then-matmul in f32 on the weights rounded to the activation dtype (or not:
    round_weights False); in bf16 the hidden activation is rounded to bf16, as the kernel
    does."""
    out = torch.zeros(*ids.shape, x.shape[1])
    if round_weights:
        w13, w2 = w13.to(dtype).float(), w2.to(dtype).float()
    for t, k in zip(*torch.nonzero(ids >= 0, as_tuple=True)):
        e = ids[t, k]
        gate, up = F.linear(x[t].float(), w13[e]).chunk(2)
        h = F.silu(gate) * up
        if dtype == torch.bfloat16:
            h = h.bfloat16().float()
        out[t, k] = F.linear(h, w2[e]) * wts[t, k]
    return out


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dequantize_then_matmul(scheme, dtype):
    # Odd shapes: H, N not multiples of the 64-column block (FP8: odd input dims too; GPTQ
    # needs multiples of 8). A ragged last block and columns outside any 16-lane vector.
    H, N = (200, 37) if scheme in FP8 else (136, 40)
    E, K, T = 5, 2, 11
    kernel, packed, torch_be, raw, w13, w2 = _experts(scheme, E, H, N, seed=len(scheme))
    ids, wts = _routing(T, E, K, seed=H, skip_frac=0.2)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.zeros(T, K, H, dtype=dtype)
    kernel.apply_pairs(packed, x, wts, ids, got)
    codes_chain = dtype == torch.bfloat16
    want = _reference(x, w13, w2, wts, ids, dtype, round_weights=not codes_chain)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    scale = 1.0 if dtype == torch.float32 else max(1.0, want.abs().max().item())
    if codes_chain:
        # Exact weights, f32 accumulation: what is left is the bf16 rounding of h and of the
        # output (half an ulp of the largest output is 2^-9 of it). The last assert below
        # tells this chain from the dequantize-to-bf16 one.
        torch.testing.assert_close(got.float(), want, atol=5e-3 * scale, rtol=0)
    else:
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # The torch backend (what runs without this kernel) agrees within the same tolerance; in
    # bf16 it rounds after every op (gate_up, the activation, each product), so relative to
    # the output's magnitude.
    via_torch = torch.zeros(T, K, H, dtype=dtype)
    torch_be.apply_pairs(raw, x, wts, ids, via_torch)
    torch.testing.assert_close(got.float(), via_torch.float(), atol=tol * scale, rtol=tol)
    # The dequantize-to-the-activation-dtype chains: bit for bit the unquantized kernel on the
    # dequantized weights in the activation dtype.
    if scheme in ACT_ORDER:         # summed in the sorted order: test_act_order_is_... below
        return
    plain = torch.zeros(T, K, H, dtype=dtype)
    expert_pairs_cpu(x, prepack(w13.to(dtype)), prepack(w2.to(dtype)), wts, ids, plain)
    assert torch.equal(got, plain) != codes_chain


@pytest.mark.parametrize("scheme", ["fp8-block16x32", "fp8-channel", "gptq-g32-sym",
                                    "gptq-g32-asym-descact"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_and_slot_rows(scheme, dtype):
    """Rows together == one by one == split into waves, bitwise; and slot rows (fewer slots
    than top_k, as an expert cache with N < top_k runs) give the experts' values."""
    E, K, T, H, N = 6, 3, 23, 80, 48
    kernel, packed, _, _, _, _ = _experts(scheme, E, H, N, seed=3)
    ids, wts = _routing(T, E, K, seed=5)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert_pairs_independent(kernel, packed, x, wts, ids, E)


@pytest.mark.parametrize("flags", ["-mno-avx512bf16", "-mno-avx512vbmi"])
def test_codes_chain_same_bits_in_every_build(monkeypatch, flags):
    """The bf16 codes chain converts codes with vpermi2b / vpermw tables where the build has
    AVX512-BF16 (and VBMI), through f32 elsewhere: the same values, so the same bits (odd input
    dims, ragged blocks, 1-3 token remainders, experts with more than 4 tokens included)."""
    cases = []
    for scheme, (H, N) in (("fp8-block16x32", (200, 37)), ("gptq-g64-asym", (136, 40)),
                           ("gptq-g32-asym-descact", (136, 40))):
        kernel, packed, _, _, _, _ = _experts(scheme, 4, H, N, seed=11)
        ids, wts = _routing(13, 4, 2, seed=4)
        x = torch.randn(13, H, generator=torch.Generator().manual_seed(3)).bfloat16()
        assert torch.bincount(ids.flatten()).max() > 4
        cases.append((kernel, packed, x, wts, ids))
    assert_pairs_same_bits_in_build(monkeypatch, flags, cases)


def test_token_count_bounds():
    """8191 / 8192 / 8193 tokens at a small hidden size: every pair computed, bitwise equal to
    the unquantized kernel on the dequantized weights."""
    E, K, H, N = 4, 2, 16, 8
    for scheme in ("fp8-channel", "gptq-g32-asym-descact"):
        kernel, packed, _, _, w13, w2 = _experts(scheme, E, H, N, seed=7)
        p13, p2 = prepack(w13), prepack(w2)
        for T in (8191, 8192, 8193):
            ids, wts = _routing(T, E, K, seed=T)
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
            got = torch.full((T, K, H), float("nan"))
            kernel.apply_pairs(packed, x, wts, ids, got)
            plain = torch.zeros(T, K, H)
            expert_pairs_cpu(x, p13, p2, wts, ids, plain)
            assert torch.equal(got, plain), (scheme, T)
            torch.testing.assert_close(got[-3:], _reference(x[-3:], w13, w2, wts[-3:],
                                                            ids[-3:], torch.float32),
                                       atol=2e-5, rtol=2e-5)


def test_scales_too_small_for_the_bf16_rounding_are_refused():
    kernel, packed, _, raw, _, _ = _experts("fp8-channel", 2, 32, 16)
    raw = dict(raw)
    raw["w2_weight_scale"] = raw["w2_weight_scale"].clone()
    raw["w2_weight_scale"][1, 3] = 2.0 ** -120
    with pytest.raises(ValueError, match=r"w2_weight_scale holds a scale of .* below 2\^-117"):
        kernel.pack(raw)


# ---- GPTQ act order: rows sorted by group at pack time, activations gathered by the perm -------
def test_act_order_packs_rows_sorted_by_group():
    """Each projection's group table is packed sorted (stable argsort of g_idx), followed by
    its perm; without act order the tables are as loaded and the perms -1 (nothing gathered)."""
    E, H, N = 3, 136, 40
    _, packed, _, raw, _, _ = _experts("gptq-g32-asym-descact", E, H, N, seed=5)
    g13, g2 = packed["w13_g_idx"], packed["w2_g_idx"]
    assert tuple(g13.shape) == (E, 4, H) and tuple(g2.shape) == (E, 2, N)
    for e in range(E):
        for groups, perm, loaded in ((g13[e, 0], g13[e, 2], raw["w13_g_idx"][e, 0]),
                                     (g13[e, 1], g13[e, 3], raw["w13_g_idx"][e, 1]),
                                     (g2[e, 0], g2[e, 1], raw["w2_g_idx"][e, 0])):
            assert not bool((loaded[1:] >= loaded[:-1]).all())         # really act order
            assert torch.equal(perm.long(), torch.argsort(loaded, stable=True))
            assert torch.equal(groups, loaded[perm.long()])
    _, plain, _, raw_plain, _, _ = _experts("gptq-g32-sym", 2, H, N)
    assert torch.equal(plain["w13_g_idx"][:, :2], raw_plain["w13_g_idx"])
    assert torch.equal(plain["w2_g_idx"][:, :1], raw_plain["w2_g_idx"])
    assert bool((plain["w13_g_idx"][:, 2:] == -1).all() and (plain["w2_g_idx"][:, 1:] == -1).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_order_is_the_plain_kernel_on_gathered_activations(dtype):
    """An act-order expert gives bitwise what the same packed codes give as a plain group-wise
    matrix (perms cleared) on x[:, perm]: gate and up are quantized from proportional weights
    (same column-norm order, so one perm), down with one group (rows in order). So bf16 takes
    the codes chain and f32 the plain group chain, register tiles and block buffer alike."""
    E, H, N = 3, 128, 32
    method = GptqMoEMethod(32, False, True)
    g = torch.Generator().manual_seed(9)
    per_expert = []
    for _ in range(E):
        gate = torch.randn(N, H, generator=g) * 0.2
        cks = [quantize_gptq(w, 32, False, True) for w in (gate, gate * 2)]    # exact: one order
        cks.append(quantize_gptq(torch.randn(H, N, generator=g) * 0.2, N, False, True))
        t = {}
        for suffix in cks[0]:
            gt, up, down = (method.load_transform(suffix, p, ck[suffix])
                            for p, ck in zip(("w13", "w13", "w2"), cks))
            t[f"w13_{suffix}"], t[f"w2_{suffix}"] = torch.cat([gt, up]), down
        per_expert.append(method.process_expert(t))
    kernel = CpuKernelExperts(MoEActivation.of("silu"))
    kernel.bind_scheme(method)
    packed = kernel.pack({n: torch.stack([t[n] for t in per_expert]) for n in per_expert[0]})
    g13 = packed["w13_g_idx"]
    cleared = dict(packed, w13_g_idx=g13.clone())
    cleared["w13_g_idx"][:, 2:] = -1
    assert bool((packed["w2_g_idx"][:, 1] == -1).all())
    for e in range(E):
        perm = g13[e, 2].long()
        assert torch.equal(perm, g13[e, 3].long()) and not torch.equal(perm, torch.arange(H))
        for T in (1, 3, 11):
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dtype)
            ids, wts = torch.full((T, 1), e), torch.rand(T, 1, generator=g)
            got, want = torch.zeros(T, 1, H, dtype=dtype), torch.zeros(T, 1, H, dtype=dtype)
            kernel.apply_pairs(packed, x, wts, ids, got)
            kernel.apply_pairs(cleared, x[:, perm].contiguous(), wts, ids, want)
            assert torch.equal(got, want), (e, T)
