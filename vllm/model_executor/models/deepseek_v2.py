"""DeepSeek-V2 / V2-Lite and DeepSeek-V3: multi-head latent attention (MLA) + routed experts with
shared experts, matching ``transformers.DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``.

MLA runs in the absorbed form, so the paged KV cache holds the latent, not per-head keys/values:
one "kv head" per token of head_dim = kv_lora_rank + qk_rope_head_dim, the entry
[kv_a_layernorm(c_kv) (r dims), rope(k_pe) (dr dims)]. Per head h (kv_b_proj's rows split into
W_UK [dn, r] and W_UV [dv, r]):
  q_h . k_h = (q_nope_h @ W_UK) . c_kv + q_pe_h . k_pe        (keys never expanded)
  out_h     = W_UV @ sum_j p_j c_kv_j                          (values = the same latent)
so the query is [q_nope_h @ W_UK, rope(q_pe_h)] and the attention output's first r dims go
through W_UV, then o_proj. The softmax scale is HF's: qk_head_dim^-0.5, times mscale^2 under
YaRN with ``mscale_all_dim``.

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3)... (V2's complex-number rope, V3's
``rope_interleave``). A consistent permutation of q_pe and k_pe leaves every score unchanged, so
the rope rows of the q and kv_a projections are de-interleaved once after loading and the shared
neox-style ``RotaryEmbedding`` (its C kernel on CPU) applies.

FP8 checkpoints (``quant_method: fp8`` with ``weight_block_size``, DeepSeek-V3's own format):
routed experts load through the FP8 block scheme of ``FusedMoE``; every other FP8 linear
(attention projections, shared experts, dense layers) has no FP8 path here and is dequantized at
load time into the model dtype (``quantization/fp8_dense.py``, as for every model's FP8
checkpoint: ``load_decoder_weights``).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.rotary_embedding import _yarn_mscale, get_rope, rope_parameters
from vllm.model_executor.models.decoder import (DecoderForCausalLM, DecoderLayer, GatedMLP,
                                                config_attr)
from vllm.model_executor.models.weight_loading import load_decoder_weights

KV_SHARED = True
"""Give ``Attention`` the latent once (``kv_shared``: a one-plane cache whose values are the
keys). False passes v = k to a plain two-plane layer (the same results, twice the cache)."""

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_LATENT_EPS = 1e-6
"""q_a_layernorm / kv_a_layernorm eps: HF builds them with the RMSNorm default, not rms_norm_eps."""


def mla_softmax_scale(hf_config: Any) -> float:
    """HF ``yarn_apply_mscale``: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for a
    scaled rope with a nonzero ``mscale_all_dim``."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf_config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def _deinterleave(n: int) -> torch.Tensor:
    """Row order taking pairs (0, 1), (2, 3)... to halves [0, 2, 4..., 1, 3, 5...]."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def _permute_rows(linear: Linear, groups: int, width: int, start: int, perm: torch.Tensor):
    """Reorder rows start..start+len(perm) inside each of ``groups`` blocks of ``width`` rows."""
    for p in (linear.weight, linear.bias):
        if p is None:
            continue
        v = p.data.view(groups, width, *p.shape[1:])
        v[:, start:start + len(perm)] = v[:, start + perm].clone()


class DeepseekMLA(nn.Module):
    """Multi-head latent attention over a latent KV cache (module docstring). Checkpoint names:
    q_proj | q_a_proj + q_a_layernorm + q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
    o_proj."""

    def __init__(self, hf_config: Any, prefix: str, rope_interleaved: bool):
        super().__init__()
        H, nH = hf_config.hidden_size, hf_config.num_attention_heads
        self.num_heads = nH
        self.r, self.dn = hf_config.kv_lora_rank, hf_config.qk_nope_head_dim
        self.dr, self.dv = hf_config.qk_rope_head_dim, hf_config.v_head_dim
        self.q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        bias = bool(getattr(hf_config, "attention_bias", False))
        qk = self.dn + self.dr
        if self.q_lora_rank is None:
            self.q_proj = Linear(H, nH * qk, bias=False)
        else:
            self.q_a_proj = Linear(H, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, nH * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(H, self.r + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.r, _LATENT_EPS)
        # Only read after loading, to make w_uk / w_uv (then removed): never a forward Linear.
        self.kv_b_proj = nn.Module()
        self.kv_b_proj.weight = nn.Parameter(torch.empty(nH * (self.dn + self.dv), self.r),
                                             requires_grad=False)
        self.o_proj = Linear(nH * self.dv, H, bias=bias)
        self.register_buffer("w_uk", torch.empty(nH, self.dn, self.r), persistent=False)
        self.register_buffer("w_uv", torch.empty(nH, self.r, self.dv), persistent=False)
        self.rope_interleaved = rope_interleaved
        self.rotary_emb = get_rope(hf_config, self.dr)
        extra = {"kv_shared": True} if KV_SHARED else {}
        self.attn = Attention(nH, self.r + self.dr, 1, mla_softmax_scale(hf_config),
                              prefix=f"{prefix}.attn", **extra)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Split kv_b_proj into W_UK [nH, dn, r] and W_UV^T [nH, r, dv] (exact slices of the
        loaded weight, so nothing is rounded), and de-interleave the rope rows. Runs once, before
        the Linears are packed (``finish_loading``)."""
        if "kv_b_proj" not in self._modules:
            return
        w = self.kv_b_proj.weight.data.view(self.num_heads, self.dn + self.dv, self.r)
        self.w_uk = w[:, :self.dn].contiguous()
        self.w_uv = w[:, self.dn:].transpose(1, 2).contiguous()
        del self.kv_b_proj
        if self.rope_interleaved:
            perm = _deinterleave(self.dr)
            q = self.q_proj if self.q_lora_rank is None else self.q_b_proj
            _permute_rows(q, self.num_heads, self.dn + self.dr, self.dn, perm)
            _permute_rows(self.kv_a_proj_with_mqa, 1, self.r + self.dr, self.r, perm)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions [T], hidden_states [T, H] -> [T, H]."""
        T, nH, r, dn, dr = hidden_states.shape[0], self.num_heads, self.r, self.dn, self.dr
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(T, nH, dn + dr)
        kv = self.kv_a_proj_with_mqa(hidden_states)                       # [T, r + dr]
        c_kv = self.kv_a_layernorm(kv[:, :r])                             # [T, r]
        q_pe, k_pe = self.rotary_emb(positions, q[..., dn:].reshape(T, nH * dr),
                                     kv[:, r:].contiguous())              # [T, nH*dr], [T, dr]
        q_lat = torch.bmm(q[..., :dn].transpose(0, 1), self.w_uk)         # [nH, T, r]
        q_full = torch.cat([q_lat.transpose(0, 1), q_pe.view(T, nH, dr)], dim=-1)
        latent = torch.cat([c_kv, k_pe], dim=-1)                          # [T, r + dr]: the cache
        o = self.attn(q_full.reshape(T, -1), latent, None if KV_SHARED else latent)
        o = o.view(T, nH, r + dr)[..., :r].transpose(0, 1)                # [nH, T, r]
        out = torch.bmm(o, self.w_uv).transpose(0, 1).reshape(T, nH * self.dv)
        return self.o_proj(out)


class DeepseekMoE(nn.Module):
    """Router ``gate`` (f32, as HF keeps it) + routed ``experts`` + ungated ``shared_experts``."""

    def __init__(self, hf_config: Any, prefix: str, scoring_func: str, correction_bias: bool,
                 num_expert_group: int | None, topk_group: int | None, renormalize: bool):
        super().__init__()
        H, E = hf_config.hidden_size, config_attr(hf_config, "n_routed_experts", "num_experts")
        act = hf_config.hidden_act
        if act not in ("silu", "swish"):
            raise ValueError(f"{prefix}: hidden_act={act!r} is not supported for MoE experts: "
                             "must be 'silu'")
        self.gate = Linear(H, E, bias=False, dtype=torch.float32)
        self.experts = FusedMoE(
            E, hf_config.num_experts_per_tok, H, hf_config.moe_intermediate_size,
            renormalize=renormalize, scoring_func=scoring_func, num_expert_group=num_expert_group,
            topk_group=topk_group,
            routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
            use_correction_bias=correction_bias, activation="silu", prefix=f"{prefix}.experts")
        n_shared = getattr(hf_config, "n_shared_experts", 0) or 0
        self.shared_experts = GatedMLP(H, hf_config.moe_intermediate_size * n_shared, act,
                                       bias=bool(getattr(hf_config, "mlp_bias", False))) \
            if n_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        out = self.experts(x, self.gate(x.float()))                       # router logits f32
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V2 routing (HF ``DeepseekV2TopkRouter``): softmax, ``topk_method`` "greedy" or
    "group_limited_greedy" (a group's score is its best expert), then ``routed_scaling_factor``.
    HF never renormalises here; we renormalise when ``norm_topk_prob`` is set, as DeepSeek's own
    code and vLLM do (false in every released V2 config, where both agree)."""

    def rope_interleaved(self, hf_config: Any) -> bool:
        return True                                    # V2's complex-number rope: pairs

    def make_moe(self, hf_config: Any, prefix: str) -> DeepseekMoE:
        method = getattr(hf_config, "topk_method", None) or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method={method!r} is not supported for DeepSeek-V2: must be "
                             "'greedy' or 'group_limited_greedy'")
        grouped = method == "group_limited_greedy"
        return DeepseekMoE(hf_config, prefix, "softmax", False,
                           hf_config.n_group if grouped else None,
                           hf_config.topk_group if grouped else None,
                           bool(getattr(hf_config, "norm_topk_prob", False)))

    def make_layer(self, hf_config: Any, layer_idx: int, prefix: str) -> nn.Module:
        attn = DeepseekMLA(hf_config, f"{prefix}.self_attn", self.rope_interleaved(hf_config))
        freq = getattr(hf_config, "moe_layer_freq", 1) or 1
        first_dense = getattr(hf_config, "first_k_dense_replace", 0) or 0
        # DeepSeek's rule; HF ignores moe_layer_freq (1 in every released config).
        if layer_idx >= first_dense and layer_idx % freq == 0:
            mlp = self.make_moe(hf_config, f"{prefix}.mlp")
        else:
            mlp = GatedMLP(hf_config.hidden_size, hf_config.intermediate_size,
                           hf_config.hidden_act, bias=bool(getattr(hf_config, "mlp_bias", False)))
        return DecoderLayer(attn, mlp, hf_config.hidden_size, hf_config.rms_norm_eps)

    def rename_checkpoint_tensor(self, name: str) -> str:
        # The correction bias lives on the router in checkpoints and on FusedMoE here.
        return name.replace("mlp.gate.e_score_correction_bias",
                            "mlp.experts.e_score_correction_bias")

    def load_weights(self, weights) -> set[str]:
        """HF-named tensors, with: layers past num_hidden_layers (V3's multi-token-prediction
        layer) skipped, dense FP8 linears dequantized, then the MLA matrices made."""
        n = self.config.num_hidden_layers

        def ours(item):
            m = _LAYER.match(item[0])
            return m is None or int(m.group(1)) < n
        loaded = load_decoder_weights(self, filter(ours, weights))
        for m in self.modules():
            if isinstance(m, DeepseekMLA):
                m.process_weights_after_loading()
        return loaded


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 routing (HF ``DeepseekV3TopkRouter``): sigmoid scores; experts chosen on
    score + ``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups (a
    group's score: its best two); weights are the unbiased scores, renormalised when
    ``norm_topk_prob``, times ``routed_scaling_factor``. Rope pairs per ``rope_interleave``."""

    def rope_interleaved(self, hf_config: Any) -> bool:
        return bool(getattr(hf_config, "rope_interleave", True))

    def make_moe(self, hf_config: Any, prefix: str) -> DeepseekMoE:
        return DeepseekMoE(hf_config, prefix, "sigmoid", True, hf_config.n_group,
                           hf_config.topk_group, bool(getattr(hf_config, "norm_topk_prob", True)))
