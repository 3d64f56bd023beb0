"""Mixtral: Llama attention + a sparse MoE block in every layer (renormalised top-k)."""
from __future__ import annotations

from typing import Any

from torch import nn

from vllm.model_executor.models.decoder import (DecoderAttention, DecoderForCausalLM,
                                                DecoderLayer, SparseMoeBlock, config_attr)


class MixtralForCausalLM(DecoderForCausalLM):
    def make_layer(self, hf_config: Any, layer_idx: int, prefix: str) -> nn.Module:
        attn = DecoderAttention(hf_config, f"{prefix}.self_attn")
        moe = SparseMoeBlock(hf_config, config_attr(hf_config, "num_local_experts", "num_experts"),
                             hf_config.intermediate_size, renormalize=True,
                             prefix=f"{prefix}.block_sparse_moe")
        # Checkpoints name the block "block_sparse_moe"; transformers >= 5 in memory says "mlp".
        return DecoderLayer(attn, moe, hf_config.hidden_size, hf_config.rms_norm_eps,
                            mlp_name="block_sparse_moe")

    def rename_checkpoint_tensor(self, name: str) -> str:
        return name.replace(".mlp.", ".block_sparse_moe.")
