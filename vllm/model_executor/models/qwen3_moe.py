"""Qwen3-MoE (Qwen3-30B-A3B family): Qwen3 attention (per-head q/k RMSNorm) + routed experts."""
from __future__ import annotations

from typing import Any

from torch import nn

from vllm.model_executor.models.decoder import (DecoderAttention, DecoderForCausalLM,
                                                DecoderLayer, GatedMLP, SparseMoeBlock,
                                                config_attr)


def is_moe_layer(hf_config: Any, layer_idx: int) -> bool:
    """HF rule: sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
    num_experts = config_attr(hf_config, "num_experts", "num_local_experts", default=0)
    step = config_attr(hf_config, "decoder_sparse_step", default=1)
    only_mlp = config_attr(hf_config, "mlp_only_layers", default=[])
    return layer_idx not in only_mlp and num_experts > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    def make_layer(self, hf_config: Any, layer_idx: int, prefix: str) -> nn.Module:
        bias = bool(getattr(hf_config, "attention_bias", False))
        attn = DecoderAttention(hf_config, f"{prefix}.self_attn", qkv_bias=bias, o_bias=bias,
                                qk_norm=True)
        if is_moe_layer(hf_config, layer_idx):
            mlp = SparseMoeBlock(
                hf_config, config_attr(hf_config, "num_experts", "num_local_experts"),
                hf_config.moe_intermediate_size,
                renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
                prefix=f"{prefix}.mlp")
        else:
            mlp = GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act)
        return DecoderLayer(attn, mlp, hf_config.hidden_size, hf_config.rms_norm_eps)
