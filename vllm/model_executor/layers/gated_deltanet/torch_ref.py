"""Torch reference of the gated delta rule (Gated DeltaNet) and its causal conv1d: the kernels'
definition, run on every platform (and by the tests).

The recurrence, per value head h with state S [Dk, Dv] (fp32), for each token t:
    S = exp(g_t) * S                           (g_t <= 0: the decay, in log space)
    S = S + k_t (beta_t * (v_t - S^T k_t))^T   (the delta rule: write the correction only)
    o_t = S^T q_t                              (q_t scaled by Dk^-0.5, q/k l2-normalised)
``recurrent_gated_delta_rule`` runs it token by token (decode); ``chunk_gated_delta_rule``
computes the same in chunks of 64 tokens with a UT transform (prefill), the form of
flash-linear-attention's kernels and Hugging Face's ``torch_chunk_gated_delta_rule``, whose
operations it repeats in the same order (so tokens match transformers in fp32).

Shapes: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv] (Hv a multiple of Hk: each q/k head serves
Hv / Hk consecutive value heads); g, beta [B, T, Hv]; state [B, Hv, Dk, Dv] fp32.
Outputs: o [B, T, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (flash-linear-attention's definition)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(q, k, v, g, beta, use_qk_l2norm: bool):
    """fp32 [B, Hv, T, D] tensors (q/k repeated to the value heads), q/k normalised."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v, beta, g = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g)]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q, k, v, g, beta


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state: torch.Tensor | None = None,
                               use_qk_l2norm: bool = True):
    """Token by token (decode: T = 1). Returns (o, final_state)."""
    B, T, _, Dk = k.shape
    Hv, Dv = v.shape[2:]
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, use_qk_l2norm)
    q = q / Dk ** 0.5      # divided here, multiplied in the chunked form: as transformers does
    state = (torch.zeros(B, Hv, Dk, Dv, dtype=torch.float32, device=v.device)
             if initial_state is None else initial_state.to(torch.float32))
    out = torch.zeros_like(v)
    for t in range(T):
        q_t, k_t, v_t = q[:, :, t], k[:, :, t], v[:, :, t]
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta[:, :, t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, t] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), state


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state: torch.Tensor | None = None,
                           use_qk_l2norm: bool = True, chunk_size: int = 64):
    """Chunked form (prefill): the same result as the recurrence up to rounding. Within a chunk
    the delta-rule updates are condensed by solving a unit lower-triangular system (the UT
    transform); across chunks the state is carried sequentially. Returns (o, final_state)."""
    B, T, _, Dk = k.shape
    Hv, Dv = v.shape[2:]
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, use_qk_l2norm)
    q = q * Dk ** -0.5
    pad = (chunk_size - T % chunk_size) % chunk_size        # padded tokens: g = 0, beta = 0
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    C = chunk_size
    q, k, k_beta, v_beta = [x.reshape(B, Hv, -1, C, x.shape[-1]) for x in (q, k, k_beta, v_beta)]
    g = g.reshape(B, Hv, -1, C).cumsum(dim=-1)               # log decay since the chunk start
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    # decay[..., i, j] = exp(g_i - g_j) for j <= i (0 above the diagonal)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    decayed_k_beta = k_beta * g.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False,
                                               unitriangular=True)
    state = (torch.zeros(B, Hv, Dk, Dv, dtype=torch.float32, device=v.device)
             if initial_state is None else initial_state.to(new_values))
    out = torch.zeros_like(new_values)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(B, Hv, -1, Dv)[:, :, :T]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None):
    """Depthwise causal conv over one sequence, then SiLU. x [L, C]; weight [C, K];
    conv_state [C, K-1]: the K-1 inputs before x (None: zeros). Returns (y [L, C], the new
    state [C, K-1]: the last K-1 inputs, reaching back into the old state when L < K-1)."""
    L, C = x.shape
    K = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(C, K - 1)
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=-1)          # [C, K-1+L]
    y = F.conv1d(window.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=C)[0]
    return F.silu(y).t().to(x.dtype), window[:, L:]


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor):
    """One token per sequence (decode), batched. x [B, C]; conv_state [B, C, K-1].
    Returns (y [B, C], new state [B, C, K-1])."""
    window = torch.cat([conv_state.to(x.dtype), x.unsqueeze(-1)], dim=-1)   # [B, C, K]
    y = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), groups=x.shape[1])[..., -1]
    return F.silu(y).to(x.dtype), window[..., 1:]
