"""Qwen2-MoE (Qwen1.5-MoE / Qwen2-57B-A14B): biased q/k/v, routed experts + a gated shared expert."""
from __future__ import annotations

from typing import Any

from torch import nn

from vllm.model_executor.models.decoder import (DecoderAttention, DecoderForCausalLM,
                                                DecoderLayer, GatedMLP, SparseMoeBlock)
from vllm.model_executor.models.qwen3_moe import is_moe_layer


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    def make_layer(self, hf_config: Any, layer_idx: int, prefix: str) -> nn.Module:
        # Older configs have no qkv_bias field: Qwen2-MoE always used biased q/k/v.
        attn = DecoderAttention(hf_config, f"{prefix}.self_attn",
                                qkv_bias=bool(getattr(hf_config, "qkv_bias", True)))
        if is_moe_layer(hf_config, layer_idx):
            mlp = SparseMoeBlock(
                hf_config, hf_config.num_experts, hf_config.moe_intermediate_size,
                renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
                prefix=f"{prefix}.mlp",
                shared_intermediate_size=hf_config.shared_expert_intermediate_size)
        else:
            mlp = GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act)
        return DecoderLayer(attn, mlp, hf_config.hidden_size, hf_config.rms_norm_eps)
