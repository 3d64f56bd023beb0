"""A stand-in for ``flashinfer.fused_moe`` on CPU, written from FlashInfer's documented contract
(flashinfer-python 0.7.2: ``fused_moe/core.py`` docstrings, ``cutlass_fused_moe_kernels.cuh``'s
activation reading the gate at offset inter_size, FlashInfer's own tests splitting w31 as
(w3, w1) and building NVFP4 quant_scales as [a1_gs, sf1, 1 / (a1_gs * w1_gs), a2_gs, sf2, ...]):
it computes in float32 with the activations unquantized, and records every call so the tests can
bind the recorded arguments to the real signatures."""
from __future__ import annotations

import enum
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


def fi_weights(fc1, fc2, quant_scales, block_fp8):
    """FlashInfer's fc1 [G, R, H] / fc2 [G, H, I] as float weights: FP8 block scales multiply
    128x128 blocks; NVFP4 (int64 weights): codes * block scale * alpha * activation global
    scale (alpha = 1 / (a_gs * w_gs), w = codes * sf / w_gs in FlashInfer's test)."""
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
                                use_fused_finalize=True, workspace_buffer=None):
    w1, w2 = fi_weights(fc1_expert_weights, fc2_expert_weights, quant_scales,
                        use_deepseek_fp8_block_scale)
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
                        device=None):
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
                                                   fake_workspace_size))
