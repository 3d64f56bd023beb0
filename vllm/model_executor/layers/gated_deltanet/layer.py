"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5.

Per token: projections give q, k [Hk, Dk], v, z [Hv, Dv] and b, a [Hv]; q|k|v go through a
depthwise causal conv1d (kernel K, SiLU); beta = sigmoid(b), g = -exp(A_log) * softplus(a +
dt_bias); the gated delta rule (``torch_ref.py``) mixes tokens through a per-head state
[Dk, Dv]; the output is RMS-normalised per head, gated by silu(z) (``RMSNormGated``) and
projected back by ``out_proj``.

Per-request state (``RecurrentStateLayer``): "conv" [C, K-1] (the last K-1 conv inputs, model
dtype; C = 2*Hk*Dk + Hv*Dv) and "ssm" [Hv, Dk, Dv] fp32. A step's leading one-token sequences
(decodes) run the recurrent form batched; every other sequence (a prefill chunk, continuing
from its stored state when it has one) runs the chunked form.

Projection layouts (checkpoint names):
- Qwen3-Next: ``in_proj_qkvz`` [2*Hk*Dk + 2*Hv*Dv, H] grouped per key head (q, k, v, z of
  that head's group side by side) and ``in_proj_ba`` [2*Hv, H], grouped likewise;
- Qwen3.5: ``in_proj_qkv`` (q | k | v), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.gated_deltanet import torch_ref
from vllm.model_executor.layers.gated_deltanet.registry import (GdnBackend, GdnQuery,
                                                                select_gdn_backend)
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.recurrent_state import RecurrentStateLayer, StateStep
from vllm.platforms import platform_for


class RMSNormGated(nn.Module):
    """weight * rmsnorm(x) * silu(z) per head, as transformers' ``RMSNormGated`` (plain weight,
    not zero-centred; normalised in fp32 and cast back before the weight)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(dtype) * F.silu(z.float())).to(dtype)


class _ConvWeight(nn.Module):
    """Holds ``conv1d.weight`` [C, 1, K] under the checkpoint's name (never called)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)


class GatedDeltaNet(RecurrentStateLayer):
    def __init__(self, hf_config: Any, prefix: str = "", fused_qkvz: bool = True):
        super().__init__()
        c = hf_config
        H = c.hidden_size
        self.prefix = prefix
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        if self.hv % self.hk:
            raise ValueError(f"{prefix}: linear_num_value_heads={self.hv} must be a multiple of "
                             f"linear_num_key_heads={self.hk}")
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = c.linear_conv_kernel_dim
        self.fused_qkvz = fused_qkvz
        if fused_qkvz:          # Qwen3-Next
            self.in_proj_qkvz = Linear(H, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = Linear(H, 2 * self.hv, bias=False)
        else:                   # Qwen3.5
            self.in_proj_qkv = Linear(H, self.conv_dim, bias=False)
            self.in_proj_z = Linear(H, self.value_dim, bias=False)
            self.in_proj_b = Linear(H, self.hv, bias=False)
            self.in_proj_a = Linear(H, self.hv, bias=False)
        self.conv1d = _ConvWeight(self.conv_dim, self.kernel)
        self.dt_bias = nn.Parameter(torch.ones(self.hv), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv), requires_grad=False)
        self.norm = RMSNormGated(self.dv, c.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, H, bias=False)
        self.state_dtype = torch.get_default_dtype()     # the model dtype (the loader sets it)
        self._backend: tuple[tuple, GdnBackend] | None = None

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"conv": ((self.conv_dim, self.kernel - 1), self.state_dtype),
                "ssm": ((self.hv, self.dk, self.dv), torch.float32)}

    def backend(self, x: torch.Tensor) -> GdnBackend:
        key = (x.device, x.dtype)
        if self._backend is None or self._backend[0] != key:
            self._backend = (key, select_gdn_backend(GdnQuery(platform_for(x.device), x.dtype)))
        return self._backend[1]

    def _project(self, x: torch.Tensor):
        """x [T, H] -> (qkv [T, C] as q | k | v, z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        T = x.shape[0]
        if not self.fused_qkvz:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(T, self.hv, self.dv),
                    self.in_proj_b(x), self.in_proj_a(x))
        r = self.hv // self.hk                      # value heads per key head
        qkvz = self.in_proj_qkvz(x).view(T, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(T, self.hk, 2 * r), [r, r], dim=-1)
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return (qkv, z.reshape(T, self.hv, self.dv), b.reshape(T, self.hv),
                a.reshape(T, self.hv))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H] -> [T, H]; reads/writes the state of the step's sequences."""
        T = hidden_states.shape[0]
        step = self.step_layout(T)
        qkv, z, b, a = self._project(hidden_states)
        lens = [e - s for s, e in zip(step.starts[:-1], step.starts[1:])]
        nd = next((i for i, n in enumerate(lens) if n != 1), len(lens))   # leading decodes
        qkv, conv_final = self._conv(qkv, step, nd)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(T, self.hk, self.dk), k.reshape(T, self.hk, self.dk)
        v = v.reshape(T, self.hv, self.dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o, ssm_final = self._delta_rule(q, k, v, g, beta, step, nd)
        self.write_state("conv", step, conv_final)
        self.write_state("ssm", step, ssm_final)
        o = self.norm(o.reshape(-1, self.dv), z.reshape(-1, self.dv))
        return self.out_proj(o.reshape(T, self.value_dim))

    def _conv(self, qkv: torch.Tensor, step: StateStep, nd: int):
        """Causal conv + SiLU of every sequence -> (y [T, C], final conv states [N, C, K-1])."""
        weight = self.conv1d.weight[:, 0]                        # [C, K]
        init = self.read_state("conv", step)                     # [N, C, K-1] or None
        y = torch.empty_like(qkv)
        finals = []
        if nd:
            state = init[:nd] if init is not None else qkv.new_zeros(
                nd, self.conv_dim, self.kernel - 1)
            y[:nd], st = torch_ref.causal_conv1d_step(qkv[:nd], weight, state)
            finals.append(st)
        for i in range(nd, step.num_seqs):
            s, e = step.starts[i], step.starts[i + 1]
            y[s:e], st = torch_ref.causal_conv1d(qkv[s:e], weight,
                                                 None if init is None else init[i])
            finals.append(st.unsqueeze(0))
        return y, torch.cat(finals)

    def _delta_rule(self, q, k, v, g, beta, step: StateStep, nd: int):
        """-> (o [T, Hv, Dv], final states [N, Hv, Dk, Dv] fp32)."""
        backend = self.backend(v)
        init = self.read_state("ssm", step)                      # [N, Hv, Dk, Dv] or None
        outs, finals = [], []
        if nd:
            state = init[:nd] if init is not None else torch.zeros(
                nd, self.hv, self.dk, self.dv, dtype=torch.float32, device=v.device)
            o, st = backend.recurrent(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], state)
            outs.append(o)
            finals.append(st)
        if nd < step.num_seqs:
            t0 = step.starts[nd]
            starts = [s - t0 for s in step.starts[nd:]]
            o, st = backend.chunk(q[t0:], k[t0:], v[t0:], g[t0:], beta[t0:], starts,
                                  None if init is None else init[nd:])
            outs.append(o)
            finals.append(st)
        return torch.cat(outs), torch.cat(finals)

    def extra_repr(self) -> str:
        return (f"key_heads={self.hk}x{self.dk}, value_heads={self.hv}x{self.dv}, "
                f"conv_kernel={self.kernel}")
