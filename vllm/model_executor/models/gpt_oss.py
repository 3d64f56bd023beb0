"""GPT-OSS (openai/gpt-oss-20b, -120b): biased attention with learned sinks, sliding-window layers
alternating with full ones, YaRN rope, and a biased top-k router over experts with biases and the
clamped "swigluoai" activation. Experts load as published: bf16, or MXFP4 (``mxfp4.py``).

Checkpoint names follow transformers' ``GptOssForCausalLM``; where ours differ:
  * ``self_attn.sinks`` [Hq] -> ``self_attn.attn.sinks`` (the attention layer owns them);
  * ``mlp.experts.gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H] are stored input-major
    (x @ W), and gate_up's 2I outputs interleave gate and up (output 2j = gate j, 2j + 1 =
    up j; the same for ``gate_up_proj_bias`` and the MXFP4 ``_blocks`` / ``_scales`` rows).
    ``per_expert_tensors`` turns each into the per-expert gate/up/down shards the shared loader
    takes, so FusedMoE holds its usual [gate; up] layout and the expert cache moves each expert's
    weights, scales and biases together.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation
from vllm.model_executor.layers.linear import QKV, Linear, fuse_projections, project
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.decoder import (DecoderForCausalLM, DecoderLayer, config_attr,
                                                head_dim_of)
from vllm.model_executor.models.weight_loading import load_decoder_weights

# model.layers.{i}.mlp.experts.{gate_up_proj|down_proj}{""|_bias|_blocks|_scales}
_FUSED_EXPERTS = re.compile(
    r"^(?P<mod>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<suffix>|_bias|_blocks|_scales)$")
# checkpoint suffix -> the per-expert tensor name the loader takes
_KIND = {"": "weight", "_bias": "bias", "_blocks": "blocks", "_scales": "scales"}


def per_expert_tensors(weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """GPT-OSS's fused expert tensors -> ``...experts.{e}.{gate,up,down}_proj.{kind}`` views
    (out x in rows, gate and up de-interleaved); every other tensor passes through."""
    for name, tensor in weights:
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            yield name, tensor
            continue
        kind = _KIND[m["suffix"]]
        if kind == "weight":
            tensor = tensor.transpose(1, 2)        # [E, in, out] -> [E, out, in]
        for e in range(tensor.shape[0]):
            rows = tensor[e]                        # dim 0 = output features
            if m["proj"] == "down_proj":
                yield f"{m['mod']}.{e}.down_proj.{kind}", rows
            else:
                yield f"{m['mod']}.{e}.gate_proj.{kind}", rows[0::2]
                yield f"{m['mod']}.{e}.up_proj.{kind}", rows[1::2]


class GptOssAttention(nn.Module):
    """Biased q/k/v/o, rope, attention with per-head sinks; a sliding window on the layers
    ``layer_types`` marks "sliding_attention" (keys in (p - window, p])."""

    def __init__(self, hf_config: Any, layer_idx: int, prefix: str = ""):
        super().__init__()
        H = hf_config.hidden_size
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = config_attr(hf_config, "num_key_value_heads", default=self.num_heads)
        self.head_dim = D = head_dim_of(hf_config)
        bias = bool(config_attr(hf_config, "attention_bias", default=True))
        self.q_proj = Linear(H, self.num_heads * D, bias=bias)
        self.k_proj = Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = Linear(self.num_heads * D, H, bias=bias)
        self.rotary_emb = get_rope(hf_config, D)
        layer_types = config_attr(hf_config, "layer_types", default=None)
        sliding = layer_types is not None and layer_types[layer_idx] == "sliding_attention"
        self.attn = Attention(self.num_heads, D, self.num_kv_heads, D ** -0.5,
                              prefix=f"{prefix}.attn", use_sinks=True,
                              sliding_window=hf_config.sliding_window if sliding else None)

    def finish_loading(self, device: torch.device) -> None:
        fuse_projections(self, QKV, device)   # one GEMM where the Linears are nn.Linear

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions [T], hidden_states [T, H] -> [T, H]."""
        q, k, v = project(self, QKV, hidden_states)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class GptOssMLP(nn.Module):
    """Router logits = x W^T + b [T, E]; top-k experts weighted by the softmax of their logits
    (transformers: top-k of the logits, then softmax over those k; ours: softmax over all E,
    top-k, renormalised: the same weights)."""

    def __init__(self, hf_config: Any, prefix: str = ""):
        super().__init__()
        H, E = hf_config.hidden_size, config_attr(hf_config, "num_local_experts", "num_experts")
        self.router = Linear(H, E, bias=True)
        activation = MoEActivation("swigluoai", alpha=float(hf_config.swiglu_alpha),
                                   limit=float(hf_config.swiglu_limit))
        self.experts = FusedMoE(E, hf_config.num_experts_per_tok, H, hf_config.intermediate_size,
                                renormalize=True, activation=activation, bias=True,
                                prefix=f"{prefix}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.experts(x, self.router(x))


class GptOssForCausalLM(DecoderForCausalLM):
    def make_layer(self, hf_config: Any, layer_idx: int, prefix: str) -> nn.Module:
        return DecoderLayer(GptOssAttention(hf_config, layer_idx, f"{prefix}.self_attn"),
                            GptOssMLP(hf_config, f"{prefix}.mlp"), hf_config.hidden_size,
                            hf_config.rms_norm_eps)

    def rename_checkpoint_tensor(self, name: str) -> str:
        if name.endswith(".self_attn.sinks"):
            return name[:-len("sinks")] + "attn.sinks"
        return name

    def load_weights(self, weights) -> set[str]:
        return load_decoder_weights(self, per_expert_tensors(weights))
