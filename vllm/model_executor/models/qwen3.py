"""Dense Qwen3: Llama layout with per-head q/k RMSNorm before rotary."""
from __future__ import annotations

from typing import Any

from torch import nn

from vllm.model_executor.models.decoder import (DecoderAttention, DecoderForCausalLM,
                                                DecoderLayer, GatedMLP)


class Qwen3ForCausalLM(DecoderForCausalLM):
    def make_layer(self, hf_config: Any, layer_idx: int, prefix: str) -> nn.Module:
        bias = bool(getattr(hf_config, "attention_bias", False))
        attn = DecoderAttention(hf_config, f"{prefix}.self_attn", qkv_bias=bias, o_bias=bias,
                                qk_norm=True)
        mlp = GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act)
        return DecoderLayer(attn, mlp, hf_config.hidden_size, hf_config.rms_norm_eps)
