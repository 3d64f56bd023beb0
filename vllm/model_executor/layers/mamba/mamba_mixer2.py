"""The Mamba-2 mixer (``MambaMixer2``), matching transformers' ``NemotronHMamba2Mixer`` /
``Mamba2Mixer`` in inference, over the engine's per-request state slots.

  in_proj(h) -> z [I] | xBC [I + 2 g n] | dt [h]           (I = h * p: heads x head_dim)
  xBC -> causal depthwise conv (width K) -> silu -> x [h, p], B [g, n], C [g, n]
  dt -> softplus(dt + dt_bias), clamped to time_step_limit;  A = -exp(A_log)
  y = SSM(x, dt, A, B, C) + D x                            (``ssd_torch.py``)
  out_proj(gated_rmsnorm(y, z)): rmsnorm per group of I / g channels of y * silu(z)

Per request the layer keeps (``RecurrentStateLayer``) the conv window (the last K-1 inputs of
xBC, model dtype) and the SSM state [h, p, n] (``ssm_state_dtype``, float32 by default). Each
forward splits its tokens by sequence (``step_layout``): single-token sequences at the front
of the batch (decodes) take the recurrent update together, every other sequence runs the
chunked scan from its stored (or zero) state. The kernels come from the Mamba backend registry
(``registry.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.mamba.registry import MambaQuery, select_mamba_backend
from vllm.model_executor.layers.recurrent_state import RecurrentStateLayer, StateStep
from vllm.platforms import platform_for


class GatedRMSNorm(nn.Module):
    """HF ``NemotronHRMSNormGated``/``MambaRMSNormGated`` with norm_before_gate=False:
    x * silu(z), RMS-normalised per group of ``group_size`` channels and scaled by ``weight`` in
    float32, then cast to z's dtype (one rounding, as HF's prefill path: its scan output is
    float32)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.group_size, self.variance_epsilon = group_size, eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x [T, I] (any float dtype), z [T, I] -> [T, I] in z's dtype."""
        T, I = x.shape
        g = (x.float() * F.silu(z.float())).view(T, I // self.group_size, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * g.view(T, I)).to(z.dtype)


class MambaMixer2(RecurrentStateLayer):
    """Checkpoint names (under ``mixer.``): in_proj, conv1d.weight [C, 1, K], conv1d.bias,
    dt_bias, A_log, D, norm.weight, out_proj."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, ssm_state_size: int,
                 n_groups: int, conv_kernel: int, chunk_size: int, *, use_conv_bias: bool = True,
                 use_bias: bool = False, eps: float = 1e-5, activation: str = "silu",
                 time_step_limit: tuple[float, float] = (0.0, float("inf")),
                 ssm_state_dtype: torch.dtype = torch.float32, prefix: str = ""):
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"{prefix}: mamba_num_heads={num_heads} must be a multiple of "
                             f"n_groups={n_groups}")
        if activation not in ("silu", "swish"):
            raise ValueError(f"{prefix}: mamba_hidden_act={activation!r} is not supported: "
                             "must be 'silu'")
        self.num_heads, self.head_dim, self.n_groups = num_heads, head_dim, n_groups
        self.ssm_state_size, self.conv_kernel, self.chunk_size = ssm_state_size, conv_kernel, \
            chunk_size
        self.intermediate_size = I = num_heads * head_dim
        self.conv_dim = I + 2 * n_groups * ssm_state_size
        self.activation, self.prefix = activation, prefix
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.ssm_state_dtype = ssm_state_dtype
        self.dtype = torch.get_default_dtype()
        """The model dtype (the loader builds the model under it): the conv window's."""
        self.in_proj = Linear(hidden_size, I + self.conv_dim + num_heads, bias=use_bias)
        # Only read by the conv kernels (never an nn.Conv1d forward): a plain holder keeps the
        # checkpoint names conv1d.weight / conv1d.bias.
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel),
                                          requires_grad=False)
        self.conv1d.bias = nn.Parameter(torch.empty(self.conv_dim), requires_grad=False) \
            if use_conv_bias else None
        # float32 whatever the model dtype: loading bf16 values into them is exact.
        for name in ("dt_bias", "A_log", "D"):
            setattr(self, name, nn.Parameter(torch.empty(num_heads, dtype=torch.float32),
                                             requires_grad=False))
        self.norm = GatedRMSNorm(I, I // n_groups, eps)
        self.out_proj = Linear(I, hidden_size, bias=use_bias)
        cfg = get_current_vllm_config()
        device = cfg.device_config.torch_device if cfg is not None else torch.device("cpu")
        # "auto" (no engine option forces a Mamba backend yet): the platform's order.
        self.backend = select_mamba_backend(MambaQuery(platform_for(device), self.dtype))
        self.kernels = self.backend.make()

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"conv": ((self.conv_dim, self.conv_kernel - 1), self.dtype),
                "ssm": ((self.num_heads, self.head_dim, self.ssm_state_size),
                        self.ssm_state_dtype)}

    def _zero_state(self, name: str, *batch: int, device: torch.device) -> torch.Tensor:
        shape, dtype = self.state_shapes()[name]
        return torch.zeros(*batch, *shape, dtype=dtype, device=device)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H] -> [T, H]."""
        T = hidden_states.shape[0]
        z, xBC, dt = self.in_proj(hidden_states).split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias).clamp(*self.time_step_limit)   # [T, h]
        step = self.step_layout(T)
        y = self._scan(step, xBC, dt)                                  # [T, h, p] float32
        return self.out_proj(self.norm(y.view(T, self.intermediate_size), z))

    def _split_xbc(self, xbc: torch.Tensor):
        """Conv output [L, C] -> x [L, h, p], B [L, g, n], C [L, g, n]."""
        L, gn = xbc.shape[0], self.n_groups * self.ssm_state_size
        x, B, C = xbc.split([self.intermediate_size, gn, gn], dim=-1)
        return (x.reshape(L, self.num_heads, self.head_dim),
                B.reshape(L, self.n_groups, self.ssm_state_size),
                C.reshape(L, self.n_groups, self.ssm_state_size))

    def _scan(self, step: StateStep, xBC: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """Conv + SSM of every sequence of the step, reading and writing its state slots."""
        k, starts = self.kernels, step.starts
        conv0, ssm0 = self.read_state("conv", step), self.read_state("ssm", step)
        w, b = self.conv1d.weight[:, 0], self.conv1d.bias
        A = -torch.exp(self.A_log)
        y = torch.empty(xBC.shape[0], self.num_heads, self.head_dim, dtype=torch.float32,
                        device=xBC.device)
        # Leading one-token sequences (decodes come first): one batched recurrent step.
        nd = next((i for i in range(step.num_seqs) if starts[i + 1] - starts[i] != 1),
                  step.num_seqs)
        conv_f: list[torch.Tensor] = []
        ssm_f: list[torch.Tensor] = []
        dev = xBC.device
        if nd:
            c0 = conv0[:nd] if conv0 is not None else self._zero_state("conv", nd, device=dev)
            s0 = ssm0[:nd] if ssm0 is not None else self._zero_state("ssm", nd, device=dev)
            xc, c1 = k.causal_conv1d_update(xBC[:nd], c0, w, b, self.activation)
            x, B, C = self._split_xbc(xc)
            y[:nd], s1 = k.state_update(s0, x, dt[:nd], A, B, C, self.D)
            conv_f += list(c1)
            ssm_f += list(s1)
        for i in range(nd, step.num_seqs):
            s, e = starts[i], starts[i + 1]
            c0 = conv0[i] if conv0 is not None else None
            s0 = ssm0[i] if ssm0 is not None else None
            if e == s:                           # nothing fed: the state stays as it was
                conv_f.append(self._zero_state("conv", device=dev) if c0 is None else c0)
                ssm_f.append(self._zero_state("ssm", device=dev) if s0 is None else s0)
                continue
            xc, c1 = k.causal_conv1d(xBC[s:e], w, b, c0, self.activation)
            x, B, C = self._split_xbc(xc)
            y[s:e], s1 = k.chunk_scan(x, dt[s:e], A, B, C, self.D, self.chunk_size, s0)
            conv_f.append(c1)
            ssm_f.append(s1)
        if step.slots is not None:
            self.write_state("conv", step, torch.stack(conv_f))
            self.write_state("ssm", step, torch.stack(ssm_f))
        return y
