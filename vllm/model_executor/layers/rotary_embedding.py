"""Rotary position embedding with Hugging Face semantics (neox-style ``rotate_half`` layout).

Scaling types: default, linear, llama3, yarn. Parameters come from ``hf_config.rope_parameters``
(transformers >= 5) or the legacy ``rope_theta`` / ``rope_scaling`` fields.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vllm.kernels.cpu.ops import rope_cos_sin, rotary_embedding
from vllm.platforms import elementwise_ops, native_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict:
    """Merged rope settings: always has "rope_theta" and "rope_type", plus the scaling fields."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if isinstance(legacy, dict):
        params = {**legacy, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    return params


def compute_inv_freq(params: dict, rotary_dim: int,
                     max_position: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [rotary_dim // 2] float32, attention_scaling applied to cos/sin),
    computed on the CPU whatever the default device (models are built under the target's):
    transformers computes them there, and a GPU's pow may differ by an ulp."""
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / \
        rotary_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(base, exponents, rotary_dim, params, max_position)
    raise ValueError(f"rope_type={rope_type!r} is not supported: must be one of "
                     f"{list(SUPPORTED_ROPE_TYPES)}")


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Low frequencies divided by ``factor``, high ones kept, a smooth blend in between."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_ctx = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def _yarn(base: float, exponents: torch.Tensor, dim: int, params: dict,
          max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: per-dimension blend of interpolated and extrapolated frequencies + an mscale."""
    orig = params.get("original_max_position_embeddings") or max_position
    factor = params.get("factor") or max_position / orig
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength completes ``rotations`` turns over the original context.
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) /
            (high - low)).clamp(0, 1)
    pos_freqs = base ** exponents
    extrapolate = 1 - ramp
    # (1 - extrapolate), not ramp: transformers' expression, equal to it bit for bit.
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


_LAST_COS_SIN: tuple[torch.Tensor, tuple, torch.Tensor] | None = None
"""(positions, frequency key, cos/sin rows) of the last ``RotaryEmbedding._cos_sin``."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, inv_freq: torch.Tensor,
                 attention_scaling: float = 1.0):
        super().__init__()
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim={rotary_dim} is invalid: must be even and <= head_dim "
                             f"({head_dim})")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.attention_scaling = attention_scaling
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._freq_key = (tuple(self.inv_freq.tolist()), attention_scaling)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None):
        """positions [T] int64; q [T, Hq*D], k [T, Hkv*D] -> rotated (q, k), same shapes/dtypes.
        One launch of the platform's fused kernel (CUDA: Triton, cos/sin made in the kernel),
        else one C kernel call on CPU (f32/bf16, ``vllm/kernels/cpu/rotary.c``), else torch.
        With q_norm and k_norm (``RMSNorm(D)``, Qwen3's), each head is normalised first: in the
        rotary launch where the platform fuses them (``qk_norm_rotary``), else by the norms."""
        if q_norm is not None:
            fused = self._fused_qk_norm(q, k, q_norm, k_norm)
            if fused is not None:
                return fused.qk_norm_rotary(positions, q, k, q_norm.weight, k_norm.weight,
                                            q_norm.variance_epsilon, self.inv_freq,
                                            self.attention_scaling, self.head_dim,
                                            self.rotary_dim)
            T = q.shape[0]
            q = q_norm(q.view(T, -1, self.head_dim)).view(T, -1)
            k = k_norm(k.view(T, -1, self.head_dim)).view(T, -1)
        if q.dtype == k.dtype:
            fused = elementwise_ops(q.dtype, q.device)
            if fused is not None:
                return fused.rotary_embedding(positions, q, k, self.inv_freq,
                                              self.attention_scaling, self.head_dim,
                                              self.rotary_dim)
            if native_kernels(q.dtype, q.device):
                return rotary_embedding(self._cos_sin(positions), q, k, self.head_dim,
                                        self.rotary_dim)
        return self.forward_torch(positions, q, k)

    @staticmethod
    def _fused_qk_norm(q, k, q_norm, k_norm):
        """The platform's ops if they fuse the q/k norms into the rotation for these tensors."""
        if not (q.dtype == k.dtype == q_norm.weight.dtype == k_norm.weight.dtype
                and q_norm.variance_epsilon == k_norm.variance_epsilon):
            return None
        fused = elementwise_ops(q.dtype, q.device)
        return fused if fused is not None and fused.qk_norm_rotary is not None else None

    def _cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, rd] cos/sin rows for the kernel. The layers of one forward pass share the
        positions tensor and (usually) the frequencies, so the rows are made once per step:
        the last ones are kept with the positions tensor (held, so its identity stays unique)
        and the frequencies they were made from."""
        global _LAST_COS_SIN
        last = _LAST_COS_SIN
        if last is None or last[0] is not positions or last[1] != self._freq_key:
            cs = rope_cos_sin(positions, self.inv_freq, self.attention_scaling)
            last = _LAST_COS_SIN = (positions, self._freq_key, cs)
        return last[2]

    def forward_torch(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # cos/sin on the fly in float32 (as HF does): a table for 100k+ positions would cost more.
        freqs = positions.float()[:, None] * self.inv_freq[None, :]   # [T, rd/2]
        emb = torch.cat((freqs, freqs), dim=-1)                        # [T, rd]
        cos = (emb.cos() * self.attention_scaling)[:, None, :]         # [T, 1, rd]
        sin = (emb.sin() * self.attention_scaling)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        x = x.view(T, -1, self.head_dim)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rd = self.rotary_dim
        rot = x[..., :rd]
        rot = rot * cos + _rotate_half(rot) * sin
        out = rot if rd == self.head_dim else torch.cat((rot, x[..., rd:]), dim=-1)
        return out.reshape(T, -1)


def get_rope(hf_config: Any, head_dim: int) -> RotaryEmbedding:
    params = rope_parameters(hf_config)
    rotary_dim = int(head_dim * float(params["partial_rotary_factor"]))
    max_position = getattr(hf_config, "max_position_embeddings", None) or 2048
    inv_freq, scaling = compute_inv_freq(params, rotary_dim, max_position)
    return RotaryEmbedding(head_dim, rotary_dim, inv_freq.to(torch.get_default_device()),
                           scaling)
