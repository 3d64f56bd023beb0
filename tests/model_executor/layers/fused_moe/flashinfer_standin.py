"""A stand-in for ``flashinfer.fused_moe`` on CPU, written from FlashInfer's documented contract
(flashinfer-python 0.7.2: ``fused_moe/core.py`` docstrings, ``cutlass_fused_moe_kernels.cuh``'s
activation reading the gate at offset inter_size, FlashInfer's own tests splitting w31 as
(w3, w1) and building NVFP4 quant_scales as [a1_gs, sf1, 1 / (a1_gs * w1_gs), a2_gs, sf2, ...],
and the SM90 W4A16 MXFP4 test ``test_moe_bf16_mxfp4``: quant_scales [fc1 e8m0, fc2 e8m0] folded
and viewed as int32, weights interleaved): it computes in float32 with the activations
unquantized, and records every call so the tests can bind the recorded arguments to the real
signatures.

The two MXFP4 layout functions are ports, test-side: ``fold_scales`` of FlashInfer's torch
``interleave_moe_scales_for_sm90_mixed_gemm`` (fused_moe/prepare.py; a CPU test compares it with
the installed one), and ``interleave_fp4`` of the CUDA kernel behind
``interleave_moe_weights_for_sm90_mixed_gemm`` (quant_type 1:
``interleave_fp4_weights_for_sm90_mixed_gemm_kernel`` in data/csrc/nv_internal/tensorrt_llm/
kernels/cutlass_kernels/moe_gemm/moe_gemm_mixed_utils.cu), its index and bit-mask formulas
transcribed; only a gpu-marked test compares it with the kernel."""
from __future__ import annotations

import enum
import functools
import inspect
from types import SimpleNamespace

import torch
import torch.nn.functional as F

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class FakeActivationType(enum.IntEnum):
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6


def unswizzle(sf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """128x4-tiled scale bytes uint8 [G, R', C'] -> [G, rows, cols] bytes, by FlashInfer's byte
    formula: (r, c) sits in tile (r // 128, c // 4) (tiles row-block major), at byte
    (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4 of its 512."""
    G, Rp, Cp = sf.shape
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    idx = ((r // 128) * (Cp // 4) + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    return sf.reshape(G, -1)[:, idx.reshape(-1)].reshape(G, rows, cols)


def e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C/2], element 2i in the low nibble, sign bit 3 -> float [..., C]."""
    nib = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1).long()
    mag = torch.tensor(E2M1)[nib & 7]
    return torch.where(nib >= 8, -mag, mag)


# ---- MXFP4 for the SM90 mixed-input GEMM --------------------------------------------------------
_FP4_BIT_MOVES = ((0x00000080, 24), (0x00000070, 18), (0x00000008, 12), (0x00000007, 6),
                  (0x00008000, 13), (0x00007000, 7), (0x00000800, 1), (0x00000700, -5),
                  (0x00800000, 2), (0x00700000, -4), (0x00080000, -10), (0x00070000, -16),
                  (0x80000000, -1), (0x10000000, 1), (0x60000000, -3), (0x08000000, -13),
                  (0x01000000, -11), (0x06000000, -15))
"""The kernel's (mask, shift) pairs, in its order: ``out |= (raw & mask) << shift`` (negative:
>>) on the 32-bit word of 4 bytes [row, c], [row + 8, c], [row, c + 4], [row + 8, c + 4]."""


@functools.lru_cache(maxsize=None)
def fp4_interleave_sources(rows: int, row_bytes: int) -> torch.Tensor:
    """For each bit of one expert's interleaved [rows, row_bytes] (flat: (r * row_bytes + c) * 8
    + bit), the flat bit of the source it comes from: the kernel's thread (block_id,
    partition_id, lane) for every block_id < rows / 2, partition_id < cols / 64, lane < 16."""
    assert rows % 16 == 0 and (2 * row_bytes) % 64 == 0, (rows, row_bytes)
    src_of = [0] * 32                                    # dst bit of the word -> its raw bit
    for mask, shift in _FP4_BIT_MOVES:
        for b in range(32):
            if mask >> b & 1:
                src_of[b + shift] = b
    assert sorted(src_of) == list(range(32))             # the moves permute the 32 bits
    blk, part, lane = (t.reshape(-1, 1) for t in torch.meshgrid(
        torch.arange(rows // 2), torch.arange(2 * row_bytes // 64), torch.arange(16),
        indexing="ij"))
    row_id, mma = blk // 8 * 16 + blk % 8, lane // 4
    dst_row = row_id + mma % 2 * 8
    dst_col = part * 32 + lane // 8 * 16 + lane % 4 * 4
    col = part * 32 + mma * 8 + lane % 4
    d = torch.arange(32).reshape(1, -1)                  # bit of the interleaved word
    s = torch.tensor(src_of).reshape(1, -1)              # bit of the raw word
    src_row, src_col = row_id + s // 8 % 2 * 8, col + s // 16 * 4      # bytes a, b, a + 4, b + 4
    dst = ((dst_row * row_bytes + dst_col + d // 8) * 8 + d % 8).reshape(-1)
    out = torch.empty(rows * row_bytes * 8, dtype=torch.long)
    out[dst] = ((src_row * row_bytes + src_col) * 8 + s % 8).reshape(-1)
    return out


def _bits(w: torch.Tensor) -> torch.Tensor:
    return ((w.unsqueeze(-1).long() >> torch.arange(8, device=w.device)) & 1).reshape(
        w.shape[0], -1)


def _bytes(bits: torch.Tensor, shape) -> torch.Tensor:
    return (bits.reshape(-1, 8) << torch.arange(8, device=bits.device)).sum(-1).to(
        torch.uint8).reshape(shape)


def interleave_fp4(w: torch.Tensor) -> torch.Tensor:
    """uint8 [E, rows, cols / 2] -> the kernel's interleaved bytes (same shape)."""
    src = fp4_interleave_sources(w.shape[1], w.shape[2]).to(w.device)
    return _bytes(_bits(w)[:, src], w.shape)


def deinterleave_fp4(w: torch.Tensor) -> torch.Tensor:
    """The inverse of ``interleave_fp4``."""
    src = fp4_interleave_sources(w.shape[1], w.shape[2]).to(w.device)
    bits = torch.empty_like(_bits(w))
    bits[:, src] = _bits(w)
    return _bytes(bits, w.shape)


def fold_scales(scales: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """FlashInfer's scale fold, uint8 scales only: [E, rows, K / 32] -> [E, rows / 64, K / 128,
    16, 16] with [e, i, j, m, 4 a + g] = scales[e, 64 i + 16 a + m, 4 j + g]."""
    assert scales.dtype == torch.uint8 and group_size == 32
    E, rows, kgs = scales.shape
    return scales.reshape(E, rows // 64, 4, 16, kgs // 4, 4).permute(0, 1, 4, 3, 2, 5) \
        .reshape(E, rows // 64, kgs // 4, 16, 16)


def unfold_scales(folded: torch.Tensor) -> torch.Tensor:
    """The inverse of ``fold_scales``: -> [E, rows, K / 32]."""
    E, r64, k128 = folded.shape[:3]
    return folded.reshape(E, r64, k128, 16, 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(
        E, 64 * r64, 4 * k128)


def mxfp4_weights(w: torch.Tensor, folded: torch.Tensor) -> torch.Tensor:
    """Interleaved weights [G, R, C/2] and folded scales (int32 view) -> float [G, R, C]."""
    vals = e2m1(deinterleave_fp4(w))
    s = unfold_scales(folded.view(torch.uint8)).float()
    return vals * torch.exp2(s - 127).repeat_interleave(32, -1)


def fake_interleave_weights(weight, quant_type="fp4"):
    assert weight.dtype == torch.uint8 and weight.dim() == 3 and quant_type == "fp4"
    return interleave_fp4(weight)


def fake_interleave_scales(scales, group_size=32):
    return fold_scales(scales, group_size)


# ---- the fused MoE ------------------------------------------------------------------------------
def fi_weights(fc1, fc2, quant_scales, block_fp8, w4_group=False):
    """FlashInfer's fc1 [G, R, H] / fc2 [G, H, I] as float weights: FP8 block scales multiply
    128x128 blocks; NVFP4 (int64 weights): codes * block scale * alpha * activation global
    scale (alpha = 1 / (a_gs * w_gs), w = codes * sf / w_gs in FlashInfer's test); W4A16 MXFP4
    (uint8 weights, ``use_w4_group_scaling``): e2m1 codes * 2^(e8m0 - 127) per 32 inputs."""
    if w4_group:
        return [mxfp4_weights(w, s) for w, s in zip((fc1, fc2), quant_scales)]
    if block_fp8:
        return [w.float() * s.repeat_interleave(128, -2).repeat_interleave(128, -1)
                for w, s in zip((fc1, fc2), quant_scales)]
    if fc1.dtype != torch.int64:
        return fc1.float(), fc2.float()
    out = []
    for w, (a_gs, sf, alpha) in zip((fc1, fc2), (quant_scales[:3], quant_scales[3:])):
        vals = e2m1(w.view(torch.uint8))                                  # [G, R, C]
        s = unswizzle(sf.view(torch.uint8), vals.shape[1], vals.shape[2] // 16)
        s = s.view(torch.float8_e4m3fn).float()
        out.append(vals * s.repeat_interleave(16, -1) * (alpha * a_gs)[:, None, None])
    return out


def fi_activation(h, act, e, alpha, beta, limit):
    if act == FakeActivationType.Relu2:
        return F.relu(h) ** 2
    up, gate = h.chunk(2)                             # fc1 is [up; gate]
    if act == FakeActivationType.Swiglu:
        return F.silu(gate) * up
    if act == FakeActivationType.Geglu:
        return F.gelu(gate) * up
    g = gate.clamp(max=limit[e])
    return g * torch.sigmoid(alpha[e] * g) * (up.clamp(-limit[e], limit[e]) + beta[e])


def reference_cutlass_fused_moe(input, token_selected_experts, token_final_scales,
                                fc1_expert_weights, fc2_expert_weights, output_dtype,
                                quant_scales, fc1_expert_biases=None, fc2_expert_biases=None,
                                swiglu_alpha=None, swiglu_beta=None, swiglu_limit=None,
                                output=None, use_deepseek_fp8_block_scale=False,
                                activation_type=FakeActivationType.Swiglu,
                                use_fused_finalize=True, workspace_buffer=None,
                                use_w4_group_scaling=False):
    w1, w2 = fi_weights(fc1_expert_weights, fc2_expert_weights, quant_scales,
                        use_deepseek_fp8_block_scale, use_w4_group_scaling)
    y = torch.zeros(input.shape[0], w2.shape[1])
    for r in range(input.shape[0]):
        for k, e in enumerate(token_selected_experts[r].tolist()):
            if not 0 <= e < w1.shape[0]:                 # not a local expert: contributes 0
                continue
            h = w1[e] @ input[r].float()
            h = h if fc1_expert_biases is None else h + fc1_expert_biases[e].float()
            o = w2[e] @ fi_activation(h, activation_type, e, swiglu_alpha, swiglu_beta,
                                      swiglu_limit)
            o = o if fc2_expert_biases is None else o + fc2_expert_biases[e].float()
            y[r] += token_final_scales[r, k] * o
    output.copy_(y.to(output_dtype))
    return [output]


def fake_workspace_size(max_num_tokens, hidden_size, intermediate_size, num_experts_total, top_k,
                        *, x_dtype, weight_dtype, output_dtype=torch.bfloat16,
                        activation_type=FakeActivationType.Swiglu,
                        use_deepseek_fp8_block_scale=False, use_fused_finalize=True,
                        use_w4_group_scaling=False, device=None):
    return 64 * max_num_tokens


def fake_flashinfer():
    calls = []

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            calls.append((name, args, kwargs))
            return fn(*args, **kwargs)
        wrapper.__signature__ = inspect.signature(fn)
        return wrapper
    return SimpleNamespace(
        calls=calls, ActivationType=FakeActivationType,
        cutlass_fused_moe=recording("cutlass_fused_moe", reference_cutlass_fused_moe),
        cutlass_fused_moe_workspace_size=recording("cutlass_fused_moe_workspace_size",
                                                   fake_workspace_size),
        interleave_moe_weights_for_sm90_mixed_gemm=recording(
            "interleave_moe_weights_for_sm90_mixed_gemm", fake_interleave_weights),
        interleave_moe_scales_for_sm90_mixed_gemm=recording(
            "interleave_moe_scales_for_sm90_mixed_gemm", fake_interleave_scales))


def running_max_flashinfer():
    """The stand-in with FlashInfer's FP8 block-scale state: one runner whose workspace need is
    64 bytes x the most rows it has seen (size queries and runs alike), and runs that reject a
    smaller given workspace ("workspace_buffer too small")."""
    api, seen = fake_flashinfer(), [0]
    size, run = api.cutlass_fused_moe_workspace_size, api.cutlass_fused_moe

    def stateful_size(rows, *a, **kw):
        seen[0] = max(seen[0], rows)
        return size(seen[0], *a, **kw)

    def stateful_run(input, *a, workspace_buffer=None, **kw):
        seen[0] = max(seen[0], input.shape[0])
        if workspace_buffer is not None and workspace_buffer.numel() < 64 * seen[0]:
            raise RuntimeError("workspace_buffer too small")
        return run(input, *a, workspace_buffer=workspace_buffer, **kw)
    stateful_size.__signature__ = inspect.signature(size)
    stateful_run.__signature__ = inspect.signature(run)
    api.cutlass_fused_moe_workspace_size, api.cutlass_fused_moe = stateful_size, stateful_run
    return api
