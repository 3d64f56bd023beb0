"""Qwen3-Next (Qwen3-Next-80B-A3B) and the text model of Qwen3.5-MoE: hybrid decoders.

Each layer's token mixer is given by ``config.layer_types``: "linear_attention" layers are
Gated DeltaNet (``layers/gated_deltanet/``, per-request recurrent state), "full_attention"
layers are gated attention (``GatedAttention``: q_proj yields the query and an output gate per
head, sigmoid(gate) * attention, q/k norms, partial rotary). Every RMSNorm outside the DeltaNet
is zero-centred (the checkpoint stores w, the model scales by 1 + w: ``ZeroCenteredRMSNorm``,
folded once after loading). MoE layers: softmax top-k routed experts plus a shared expert gated
by sigmoid(shared_expert_gate(x)) (``SparseMoeBlock``); Qwen3-Next keeps dense MLPs where
``mlp_only_layers`` / ``decoder_sparse_step`` say, Qwen3.5 is MoE everywhere and always
renormalises the top-k weights.

Checkpoints: Qwen3-Next's (``in_proj_qkvz`` / ``in_proj_ba``) and Qwen3.5-MoE's text
CausalLM (``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``); names under
``model.language_model.`` are read as ``model.``; the MTP head (``mtp.*``) and vision tower
(``model.visual.*``) are skipped.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.gated_deltanet.layer import GatedDeltaNet
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.decoder import (DecoderForCausalLM, GatedMLP, SparseMoeBlock,
                                                head_dim_of, input_norm)
from vllm.model_executor.models.qwen3_moe import is_moe_layer
from vllm.model_executor.models.weight_loading import load_decoder_weights

_SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.")


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + w) for a checkpoint weight w: ``fold_offset`` adds the 1 once
    after loading, so the forward is the plain RMSNorm (its C kernel on CPU)."""

    def fold_offset(self) -> None:
        self.weight.data.add_(1.0)


class GatedAttention(nn.Module):
    """Full attention of Qwen3-Next: q_proj [Hq * 2D] holds per head the query then its gate;
    zero-centred q/k norms, partial rotary, output * sigmoid(gate), o_proj."""

    def __init__(self, hf_config: Any, prefix: str = ""):
        super().__init__()
        c = hf_config
        H, D = c.hidden_size, head_dim_of(c)
        self.num_heads, self.num_kv_heads, self.head_dim = (c.num_attention_heads,
                                                            c.num_key_value_heads, D)
        bias = bool(getattr(c, "attention_bias", False))
        self.q_proj = Linear(H, self.num_heads * D * 2, bias=bias)
        self.k_proj = Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = Linear(self.num_heads * D, H, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(D, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(D, c.rms_norm_eps)
        self.rotary_emb = get_rope(c, D)      # rotary_dim = head_dim * partial_rotary_factor
        self.attn = Attention(self.num_heads, D, self.num_kv_heads, D ** -0.5,
                              prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions [T], hidden_states [T, H] -> [T, H]."""
        T, D = hidden_states.shape[0], self.head_dim
        q, gate = self.q_proj(hidden_states).view(T, self.num_heads, 2 * D).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous()).view(T, -1)
        k = self.k_norm(self.k_proj(hidden_states).view(T, self.num_kv_heads, D)).view(T, -1)
        v = self.v_proj(hidden_states)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v) * torch.sigmoid(gate.reshape(T, -1))
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
    """Pre-norm block whose token mixer is ``linear_attn`` (Gated DeltaNet) or ``self_attn``."""

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp: nn.Module, hidden_size: int,
                 eps: float):
        super().__init__()
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = ZeroCenteredRMSNorm(hidden_size, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden_states, residual) -> the next pair (``DecoderLayer``'s protocol)."""
        x, residual = input_norm(self.input_layernorm, hidden_states, residual)
        if self.mixer_name == "linear_attn":
            x = self.linear_attn(x)
        else:
            x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3NextForCausalLM(DecoderForCausalLM):
    fused_qkvz = True
    """Qwen3-Next's DeltaNet projections (in_proj_qkvz / in_proj_ba); Qwen3.5 splits them."""

    def __init__(self, hf_config: Any, prefix: str = ""):
        super().__init__(hf_config, prefix)
        self.model.norm = ZeroCenteredRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def make_layer(self, hf_config: Any, layer_idx: int, prefix: str) -> nn.Module:
        kind = hf_config.layer_types[layer_idx]
        if kind == "linear_attention":
            name, mixer = "linear_attn", GatedDeltaNet(hf_config, f"{prefix}.linear_attn",
                                                       fused_qkvz=self.fused_qkvz)
        elif kind == "full_attention":
            name, mixer = "self_attn", GatedAttention(hf_config, f"{prefix}.self_attn")
        else:
            raise ValueError(f"{prefix}: layer_types[{layer_idx}]={kind!r} is not supported: "
                             "must be 'linear_attention' or 'full_attention'")
        return HybridDecoderLayer(name, mixer, self.make_mlp(hf_config, layer_idx, prefix),
                                  hf_config.hidden_size, hf_config.rms_norm_eps)

    def make_mlp(self, hf_config: Any, layer_idx: int, prefix: str) -> nn.Module:
        if not is_moe_layer(hf_config, layer_idx):
            return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size,
                            hf_config.hidden_act)
        return SparseMoeBlock(hf_config, hf_config.num_experts, hf_config.moe_intermediate_size,
                              renormalize=bool(getattr(hf_config, "norm_topk_prob", True)),
                              prefix=f"{prefix}.mlp",
                              shared_intermediate_size=hf_config.shared_expert_intermediate_size)

    def rename_checkpoint_tensor(self, name: str) -> str:
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_decoder_weights(
            self, ((n, t) for n, t in weights if not n.startswith(_SKIPPED_PREFIXES)))
        for m in self.modules():
            if isinstance(m, ZeroCenteredRMSNorm):
                m.fold_offset()
        return loaded


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE's text model (config ``qwen3_5_moe_text``): the same blocks, DeltaNet
    projections split (in_proj_qkv / z / b / a), every layer MoE with renormalised top-k. Its
    rope is multimodal (mrope) but text positions are equal on all three axes, where it is
    plain partial rotary."""

    fused_qkvz = False

    def make_mlp(self, hf_config: Any, layer_idx: int, prefix: str) -> nn.Module:
        return SparseMoeBlock(hf_config, hf_config.num_experts, hf_config.moe_intermediate_size,
                              renormalize=True, prefix=f"{prefix}.mlp",
                              shared_intermediate_size=hf_config.shared_expert_intermediate_size)
