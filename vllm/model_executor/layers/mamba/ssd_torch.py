"""Mamba-2 kernels in plain torch: the reference every backend is checked against, and the
implementation on every platform without the CUDA packages.

Shapes: L tokens of one sequence, B sequences (one token each in the decode ops), C conv
channels, K conv width, h SSM heads of p dims, g groups of B/C (each shared by h / g heads),
n state dims. ``dt`` here is the discretisation step after softplus(dt + dt_bias) and the
clamp (the mixer computes it once), ``A`` [h] the negative decay rates (-exp(A_log)).

The SSM recurrence, per head: state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T (p x n);
y_t = state_t C_t + D x_t. ``ssd_chunk_scan`` computes it for a whole sequence in chunks of
``chunk_size`` tokens (the state-space-duality form: a masked "attention" inside each chunk,
the recurrence only between chunks); ``selective_state_update`` takes one step. Both compute
in float32 and return float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"mamba_hidden_act={activation!r} is not supported: must be 'silu'")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  init: torch.Tensor | None, activation: str | None = "silu"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's depthwise causal conv: x [L, C], weight [C, K], bias [C] or None, init
    [C, K-1] (the K-1 inputs before x; None = zeros) -> (y [L, C], final [C, K-1]: the last K-1
    inputs of init ++ x, the next step's window)."""
    L, C = x.shape
    K = weight.shape[1]
    head = init.to(x.dtype) if init is not None else x.new_zeros(C, K - 1)
    window = torch.cat([head, x.t()], dim=1)                        # [C, K-1+L]
    y = F.conv1d(window[None], weight[:, None, :], bias, groups=C)[0]  # [C, L]
    return _act(y.t(), activation), window[:, L:].clone()


def causal_conv1d_update(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, activation: str | None = "silu"
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: x [B, C], state [B, C, K-1] -> (y [B, C], new state)."""
    C = x.shape[1]
    window = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)   # [B, C, K]
    y = F.conv1d(window, weight[:, None, :], bias, groups=C)[:, :, 0]
    return _act(y, activation), window[:, :, 1:].clone()


def segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., T] -> [..., T, T] with out[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the
    diagonal. Summed by a masked cumsum (not cumsum differences) so exp(out) keeps its small
    values: the decay from step j to step i."""
    T = a.shape[-1]
    x = a[..., :, None].expand(*a.shape, T)                         # x[..., k, j] = a[k]
    x = x.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1), 0)
    out = x.cumsum(dim=-2)                                          # sum over j < k <= i
    return out.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=a.device).tril(0),
                           float("-inf"))


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor, chunk_size: int,
                   init: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence from ``init`` (None = zeros): x [L, h, p], dt [L, h], A [h], B and C
    [L, g, n], D [h], init [h, p, n] -> (y [L, h, p], final state [h, p, n]), float32.

    Chunks start at this call's first token; padding to a whole chunk uses dt = 0, which leaves
    the state unchanged, so the final state is the state after token L."""
    L, h, p = x.shape
    n, rep = B.shape[-1], h // B.shape[1]
    x, dt, A = x.float(), dt.float(), A.float()
    Bh = B.float().repeat_interleave(rep, dim=1)                    # [L, h, n]
    Ch = C.float().repeat_interleave(rep, dim=1)
    pad = -L % chunk_size
    nc = (L + pad) // chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:                   # [L, ...] -> [nc, cs, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(nc, chunk_size, *t.shape[1:])
    xdt = chunks(x * dt[..., None])                                 # [nc, cs, h, p]
    Bc, Cc = chunks(Bh), chunks(Ch)                                 # [nc, cs, h, n]
    Adt = chunks(dt * A).permute(2, 0, 1)                           # [h, nc, cs]
    A_cum = Adt.cumsum(dim=-1)
    # Inside each chunk: y_l = sum_{s <= l} (C_l . B_s) exp(A_cum_l - A_cum_s) dt_s x_s.
    decay = torch.exp(segsum(Adt))                                  # [h, nc, l, s]
    scores = torch.einsum("clhn,cshn->hcls", Cc, Bc) * decay
    y_diag = torch.einsum("hcls,cshp->clhp", scores, xdt)
    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(A_cum[..., -1:] - A_cum)                     # [h, nc, cs]
    chunk_states = torch.einsum("clhn,hcl,clhp->chpn", Bc, to_end, xdt)
    start = init.float()[None] if init is not None else x.new_zeros(1, h, p, n)
    states = torch.cat([start, chunk_states])                      # [nc+1, h, p, n]
    # Between chunks: the state entering chunk z sums the earlier chunks' states, decayed.
    chunk_decay = torch.exp(segsum(F.pad(A_cum[..., -1], (1, 0))))  # [h, nc+1, nc+1]
    states = torch.einsum("hzc,chpn->zhpn", chunk_decay, states)
    entering, final = states[:-1], states[-1]
    y_off = torch.einsum("clhn,chpn,hcl->clhp", Cc, entering, torch.exp(A_cum))
    y = (y_diag + y_off).reshape(nc * chunk_size, h, p)[:L]
    return y + D.float()[:, None] * x, final


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                           A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                           D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: state [B, h, p, n], x [B, h, p], dt [B, h], A [h], B and C
    [B, g, n], D [h] -> (y [B, h, p], new state [B, h, p, n]), float32."""
    h = x.shape[1]
    rep = h // B.shape[1]
    x, dt = x.float(), dt.float()
    Bh = B.float().repeat_interleave(rep, dim=1)                    # [B, h, n]
    Ch = C.float().repeat_interleave(rep, dim=1)
    dA = torch.exp(dt * A.float())                                  # [B, h]
    dBx = (dt[..., None, None] * Bh[:, :, None, :]) * x[..., None]  # [B, h, p, n]
    new = state.float() * dA[..., None, None] + dBx
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    return y + D.float()[:, None] * x, new
