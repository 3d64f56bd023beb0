"""The C expert kernel on NVFP4 and MXFP4 experts, against a plain torch dequantize-then-matmul
reference written here from the checkpoint layouts. f32 activations run the unquantized
kernel's chain on e2m1 * (scale * global scale) (``qgemm_fp4.h``): bit for bit that kernel on
the dequantized weights. bf16 activations feed the e2m1 values (exact in bf16) to the bf16 pair
chain and apply the scales to f32 partial sums per group, the global scale once per output
(``qgemm_codes_fp4.h``): within f32 rounding of the reference on the unrounded weights, the
same bits in every build, and each pair's value independent of the others in the call. MXFP4
runs as GPT-OSS does: expert biases and swigluoai."""
from __future__ import annotations

import pytest
import torch
from cpu_builds import assert_pairs_same_bits_in_build
from pair_checks import assert_pairs_independent
import torch.nn.functional as F

from vllm.kernels.cpu.ops import prepack
from vllm.model_executor.layers.fused_moe.cpu_kernel import expert_pairs_cpu
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation
from vllm.model_executor.layers.fused_moe.registry import CpuKernelExperts, TorchExperts
from vllm.model_executor.layers.quantization.moe_ref import stack_experts
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
from vllm.model_executor.layers.quantization.nvfp4 import Nvfp4MoEMethod, quantize_nvfp4

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
SWIGLU = MoEActivation("swigluoai", 1.702, 7.0)


# ---- plain references from the checkpoint layout of one projection [out, in] -----------------
def e2m1(packed):
    """uint8 [..., C/2], element 2i in the low nibble -> float32 [..., C]."""
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
    return E2M1[codes.long()]


def ref_nvfp4(ck):
    """weight uint8 [out, in/2], weight_scale e4m3 [out, in/16], weight_scale_2 f32 []:
    e2m1 * (float(weight_scale) * weight_scale_2), in f32."""
    s = ck["weight_scale"].float().repeat_interleave(16, dim=1) * ck["weight_scale_2"].float()
    return e2m1(ck["weight"]) * s


def ref_mxfp4(ck):
    """blocks uint8 [out, in/32, 16], scales uint8 e8m0 [out, in/32]: e2m1 * 2^(s - 127)."""
    vals = e2m1(ck["blocks"].reshape(ck["blocks"].shape[0], -1)).double()
    return (vals * 2.0 ** (ck["scales"].double() - 127).repeat_interleave(32, dim=1)).float()


def random_nvfp4(out, inp, g):
    """Random codes (every nibble, -0 included), e4m3 scale bytes from 0 to 240 (subnormals
    included) and a global scale near 2^-9."""
    scale = torch.randint(0, 0x78, (out, inp // 16), generator=g, dtype=torch.uint8)
    return {"weight": torch.randint(0, 256, (out, inp // 2), generator=g, dtype=torch.uint8),
            "weight_scale": scale.view(torch.float8_e4m3fn),
            "weight_scale_2": (torch.rand((), generator=g) + 1) * 2.0 ** -10}


def random_mxfp4(out, inp, g):
    return {"blocks": torch.randint(0, 256, (out, inp // 32, 16), generator=g, dtype=torch.uint8),
            "scales": torch.randint(112, 130, (out, inp // 32), generator=g).to(torch.uint8)}


SCHEMES = {   # (method, checkpoint of one projection, reference, activation, biases)
    "nvfp4-random": (Nvfp4MoEMethod, random_nvfp4, ref_nvfp4, "silu", False),
    "nvfp4-rtn": (Nvfp4MoEMethod, lambda o, i, g: quantize_nvfp4(torch.randn(o, i, generator=g)),
                  ref_nvfp4, "silu", False),
    "mxfp4-gpt-oss": (Mxfp4MoEMethod, random_mxfp4, ref_mxfp4, SWIGLU, True),
}
SHAPES = {"nvfp4-random": (80, 48), "nvfp4-rtn": (80, 48), "mxfp4-gpt-oss": (96, 64)}


def experts(scheme, E, H, N, seed=0, dtype=torch.float32):
    """-> (kernel, its packed weights, torch backend, the method's tensors, reference w13
    [E, 2N, H] and w2 [E, H, N] in f32, biases b13 [E, 2N] / b2 [E, H] or None)."""
    make, quant, ref, activation, bias = SCHEMES[scheme]
    method, g = make(activation), torch.Generator().manual_seed(seed)
    per_expert, w13s, w2s = [], [], []
    for _ in range(E):
        cks = [quant(o, i, g) for o, i in ((N, H), (N, H), (H, N))]
        w13s.append(torch.cat([ref(cks[0]), ref(cks[1])]))
        w2s.append(ref(cks[2]))
        per_expert.append(method.expert_from_checkpoint(*cks))
    stacked = stack_experts(per_expert)
    b13 = b2 = None
    if bias:
        b13, b2 = (torch.randn(E, n, generator=g).to(dtype) for n in (2 * N, H))
        stacked |= {"w13_bias": b13, "w2_bias": b2}
    act = MoEActivation.of(activation)
    kernel = CpuKernelExperts(act)
    kernel.bind_scheme(method)
    return (kernel, kernel.pack(stacked), TorchExperts(act, method.dequantizer()), stacked,
            torch.stack(w13s), torch.stack(w2s), b13, b2)


def routing(T, E, K, seed, skip_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if skip_frac:
        ids = torch.where(torch.rand(T, K, generator=g) < skip_frac, -1, ids)
    return ids, torch.rand(T, K, generator=g)


def reference(x, w13, w2, wts, ids, dtype, act, b13=None, b2=None, round_weights=True):
    """Dequantize-then-matmul in f32 on the weights rounded to the activation dtype (or not:
    round_weights False); in bf16 the hidden activation is rounded to bf16, as the kernel
    does."""
    out = torch.zeros(*ids.shape, x.shape[1])
    if round_weights:
        w13, w2 = w13.to(dtype).float(), w2.to(dtype).float()
    for t, k in zip(*torch.nonzero(ids >= 0, as_tuple=True)):
        e = ids[t, k]
        gu = F.linear(x[t].float(), w13[e]) + (0 if b13 is None else b13[e].float())
        gate, up = gu.chunk(2)
        if act.name == "silu":
            h = F.silu(gate) * up
        else:
            gate, up = gate.clamp(max=act.limit), up.clamp(-act.limit, act.limit)
            h = (up + 1) * gate * torch.sigmoid(act.alpha * gate)
        if dtype == torch.bfloat16:
            h = h.bfloat16().float()
        out[t, k] = (F.linear(h, w2[e]) + (0 if b2 is None else b2[e].float())) * wts[t, k]
    return out


def assert_codes_chain_close(got, want):
    """bf16 codes chain against the reference on the unrounded weights: exact weights and f32
    accumulation leave the bf16 rounding of h and of the output (half an ulp of the largest
    output is 2^-9 of it)."""
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.float(), want, atol=5e-3 * scale, rtol=0)


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 7, 37])
def test_matches_dequantize_then_matmul(scheme, dtype, T):
    # H, N multiples of the formats' groups but not of the 64-column block (ragged last
    # blocks); T = 7 runs the register tiles with a 3-token remainder, T = 37 (about 15 pairs
    # per expert) the per-block buffer.
    H, N = SHAPES[scheme]
    E, K = 5, 2
    kernel, packed, torch_be, raw, w13, w2, b13, b2 = experts(scheme, E, H, N, len(scheme),
                                                              dtype)
    ids, wts = routing(T, E, K, seed=T, skip_frac=0.2)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.zeros(T, K, H, dtype=dtype)
    kernel.apply_pairs(packed, x, wts, ids, got)
    plain = torch.zeros(T, K, H, dtype=dtype)
    expert_pairs_cpu(x, prepack(w13.to(dtype)), prepack(w2.to(dtype)), wts, ids, plain,
                     kernel.activation, b13, b2)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    if dtype == torch.float32:
        # Bit for bit the unquantized kernel on the reference weights.
        assert torch.equal(got, plain)
        want = reference(x, w13, w2, wts, ids, dtype, kernel.activation, b13, b2)
        torch.testing.assert_close(got, want, atol=tol * max(1.0, want.abs().max().item()),
                                   rtol=tol)
    else:
        assert_codes_chain_close(got, reference(x, w13, w2, wts, ids, dtype, kernel.activation,
                                                b13, b2, round_weights=False))
        # NVFP4's e2m1 * S rounded to bf16 is not e2m1 * S: the old chain's bits are not these.
        # (MXFP4's is exact, S being a power of two: both chains see the same weights.)
        if scheme.startswith("nvfp4"):
            assert not torch.equal(got, plain)
    # The torch backend (per-expert dequantize, then torch ops rounding after each op in bf16).
    scale = max(1.0, plain.float().abs().max().item())
    via_torch = torch.zeros(T, K, H, dtype=dtype)
    torch_be.apply_pairs(raw, x, wts, ids, via_torch)
    torch.testing.assert_close(got.float(), via_torch.float(), atol=2 * tol * scale, rtol=tol)


@pytest.mark.parametrize("scheme", ["nvfp4-random", "mxfp4-gpt-oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_and_slot_rows(scheme, dtype):
    """Rows together == one by one == split into waves, bitwise; and slot rows (fewer slots
    than top_k, as an expert cache with N < top_k runs) give the experts' values. 23 tokens:
    experts with more than 4 (the block buffer) beside single tokens (register tiles)."""
    E, K, T = 6, 3, 23
    H, N = SHAPES[scheme]
    kernel, packed, _, _, _, _, _, _ = experts(scheme, E, H, N, seed=3, dtype=dtype)
    ids, wts = routing(T, E, K, seed=5)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert_pairs_independent(kernel, packed, x, wts, ids, E)


@pytest.mark.parametrize("flags", ["-mno-avx512bf16", "-mno-avx512vbmi", "-mno-avx512f"])
def test_codes_chain_same_bits_in_every_build(monkeypatch, flags):
    """The bf16 codes chain converts codes with vpsrlw / vpsrlvw and a vpermw table where the
    build has AVX512-BF16, through f32 elsewhere (AVX-512 without BF16, or AVX2 in the
    -mno-avx512f build): the same values, so the same bits. Full and ragged 64-column blocks
    (NVFP4: w13 one block of 48 columns, w2 64 + 16; MXFP4: 64, and 64 + 32), 1-3 token
    remainders, experts with more than 4 tokens."""
    cases = []
    for scheme in ("nvfp4-random", "mxfp4-gpt-oss"):
        H, N = SHAPES[scheme]
        kernel, packed, _, _, _, _, _, _ = experts(scheme, 4, H, N, seed=11,
                                                   dtype=torch.bfloat16)
        ids, wts = routing(13, 4, 2, seed=4)
        x = torch.randn(13, H, generator=torch.Generator().manual_seed(3)).bfloat16()
        assert torch.bincount(ids.flatten()).max() > 4
        cases.append((kernel, packed, x, wts, ids))
    assert_pairs_same_bits_in_build(monkeypatch, flags, cases)


def test_packed_codes_stay_4_bit():
    """A cache miss copies the packed expert: 4-bit codes plus one scale byte per group (and
    nvfp4's two global scales), not a wider table."""
    for scheme, per_weight in (("nvfp4-random", 0.5 + 1 / 16), ("mxfp4-gpt-oss", 0.5 + 1 / 32)):
        H, N = SHAPES[scheme]
        _, packed, _, _, _, _, _, _ = experts(scheme, 2, H, N)
        quant = sum(t[0].numel() * t.element_size() for n, t in packed.items() if "bias" not in n)
        assert quant == 3 * H * N * per_weight + (12 if scheme.startswith("nvfp4") else 0)


def test_e8m0_extremes_exact():
    """e8m0 0 (2^-127) on a group of zero codes, and 2 (2^-125, the smallest packed for nonzero
    codes): f32 bit for bit the unquantized kernel, bf16 within the codes chain's bound."""
    kernel, _, _, raw, _, _, _, _ = experts("mxfp4-gpt-oss", 2, 64, 32, seed=9)
    raw = {n: t.clone() for n, t in raw.items()}
    raw["w13_blocks"][0, 3, 1] = 0x88                     # +-0 codes only: scale 0 allowed
    raw["w13_scales"][0, 3, 1] = 0
    raw["w2_scales"][1, 5, 0] = 2
    w13, w2 = ([ref_mxfp4({"blocks": raw[f"{p}_blocks"][e], "scales": raw[f"{p}_scales"][e]})
                for e in range(2)] for p in ("w13", "w2"))
    w13, w2 = torch.stack(w13), torch.stack(w2)
    for dtype in (torch.float32, torch.bfloat16):
        b13, b2 = raw["w13_bias"].to(dtype), raw["w2_bias"].to(dtype)
        packed = kernel.pack(raw | {"w13_bias": b13, "w2_bias": b2})
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
        ids, wts = torch.tensor([[0, 1]] * 3), torch.rand(3, 2)
        got, plain = (torch.zeros(3, 2, 64, dtype=dtype) for _ in range(2))
        kernel.apply_pairs(packed, x, wts, ids, got)
        if dtype == torch.float32:
            expert_pairs_cpu(x, prepack(w13), prepack(w2), wts, ids, plain, SWIGLU, b13, b2)
            assert torch.equal(got, plain)
        else:
            assert_codes_chain_close(got, reference(x, w13, w2, wts, ids, dtype, SWIGLU, b13, b2,
                                                    round_weights=False))


@pytest.mark.parametrize("case", ["e8m0-too-small", "e8m0-nan", "e4m3-nan", "nvfp4-tiny-global"])
def test_scales_the_kernel_cannot_reproduce_are_refused(case):
    scheme = "mxfp4-gpt-oss" if case.startswith("e8m0") else "nvfp4-random"
    H, N = SHAPES[scheme]
    kernel, _, _, raw, _, _, _, _ = experts(scheme, 2, H, N)
    raw = {n: t.clone() for n, t in raw.items()}
    if case == "e8m0-too-small":
        raw["w2_blocks"][1, 3, 0] = 0x21                  # nonzero codes with scale 2^-126
        raw["w2_scales"][1, 3, 0] = 1
        name, what = "w2_scales", r"1.18e-38"
    elif case == "e8m0-nan":
        raw["w13_scales"][0, 2, 1] = 255
        name, what = "w13_scales", "inf"
    elif case == "e4m3-nan":
        raw["w13_weight_scale"].view(torch.uint8)[1, 7, 2] = 0x7F
        name, what = "w13_weight_scale", "nan"
    else:
        raw["w2_weight_scale_2"][0] = 2.0 ** -126
        name, what = "w2_weight_scale", r"\d.*e-"
    with pytest.raises(ValueError, match=rf"{name} holds a scale of {what}.*use "
                                         r"moe_backend='torch'"):
        kernel.pack(raw)
