"""Building blocks shared by the decoder-only model files (Llama-style pre-norm transformer).

Module names mirror Hugging Face checkpoints (``model.layers.{i}.self_attn.q_proj`` ...), so
most checkpoint tensors load by name; expert tensors go through ``FusedMoE.load_expert_weight``.
"""
from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.activation import get_act_and_mul_fn, sigmoid_gated_add
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import GATE_UP, QKV, Linear, fuse_projections, project
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_embedding import VocabEmbedding
from vllm.model_executor.models.weight_loading import load_decoder_weights


def config_attr(hf_config: Any, *names: str, default: Any = None) -> Any:
    """First non-None attribute among ``names`` (configs rename fields across versions)."""
    for name in names:
        value = getattr(hf_config, name, None)
        if value is not None:
            return value
    return default


def sliding_window_of(hf_config: Any, layer_idx: int) -> int | None:
    """The layer's attention window as transformers applies it, or None for full attention.

    ``layer_types`` (Qwen2-MoE, Qwen3, ...) name the sliding layers; without it a configured
    ``sliding_window`` applies to every layer (Mistral, Mixtral, Qwen3-MoE). A window of 0 or
    ``use_sliding_window: false`` means none (Qwen2-MoE keeps the size and zeroes it so)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        return window if types[layer_idx] == "sliding_attention" else None
    return window


def head_dim_of(hf_config: Any) -> int:
    return config_attr(hf_config, "head_dim",
                       default=hf_config.hidden_size // hf_config.num_attention_heads)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); names match HF ``gate_proj/up_proj/down_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
                 bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_and_mul = get_act_and_mul_fn(hidden_act)

    def finish_loading(self, device: torch.device) -> None:
        fuse_projections(self, GATE_UP, device)   # one GEMM where the Linears are nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(*project(self, GATE_UP, x)))


class DecoderAttention(nn.Module):
    """q/k/v projections, optional per-head q/k RMSNorm (Qwen3), rotary, paged attention, o_proj."""

    def __init__(self, hf_config: Any, prefix: str = "", qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm: bool = False):
        super().__init__()
        H = hf_config.hidden_size
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = config_attr(hf_config, "num_key_value_heads", default=self.num_heads)
        self.head_dim = D = head_dim_of(hf_config)
        self.q_proj = Linear(H, self.num_heads * D, bias=qkv_bias)
        self.k_proj = Linear(H, self.num_kv_heads * D, bias=qkv_bias)
        self.v_proj = Linear(H, self.num_kv_heads * D, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * D, H, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            eps = hf_config.rms_norm_eps
            self.q_norm, self.k_norm = RMSNorm(D, eps), RMSNorm(D, eps)
        self.rotary_emb = get_rope(hf_config, D)
        m = re.search(r"layers\.(\d+)\.", prefix + ".")
        window = sliding_window_of(hf_config, int(m.group(1)) if m else 0)
        self.attn = Attention(self.num_heads, D, self.num_kv_heads, D ** -0.5,
                              prefix=f"{prefix}.attn", sliding_window=window)

    def finish_loading(self, device: torch.device) -> None:
        fuse_projections(self, QKV, device)   # one GEMM where the Linears are nn.Linear

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions [T], hidden_states [T, H] -> [T, H]."""
        q, k, v = project(self, QKV, hidden_states)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else ()
        q, k = self.rotary_emb(positions, q, k, *norms)
        return self.o_proj(self.attn(q, k, v))


class SparseMoeBlock(nn.Module):
    """Router linear ``gate`` [E, H] + ``FusedMoE`` experts (+ optional sigmoid-gated shared expert)."""

    def __init__(self, hf_config: Any, num_experts: int, intermediate_size: int, renormalize: bool,
                 prefix: str = "", shared_intermediate_size: int = 0):
        super().__init__()
        H = hf_config.hidden_size
        act = config_attr(hf_config, "hidden_act", default="silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{prefix}: hidden_act={act!r} is not supported for MoE experts: "
                             "must be 'silu'")
        self.gate = Linear(H, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, hf_config.num_experts_per_tok, H, intermediate_size,
                                renormalize=renormalize, activation="silu",
                                prefix=f"{prefix}.experts")
        self.shared_expert = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(H, shared_intermediate_size, act)
            self.shared_expert_gate = Linear(H, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        out = self.experts(x, self.gate(x))           # router logits [T, E]
        if self.shared_expert is not None:
            out = sigmoid_gated_add(out, self.shared_expert_gate(x), self.shared_expert(x))
        return out


def input_norm(norm: RMSNorm, hidden_states: torch.Tensor, residual: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's first norm under the (hidden_states, residual) protocol: the first block's
    input is the residual itself (residual None); later ones add the two inside the norm."""
    if residual is None:
        return norm(hidden_states), hidden_states
    return norm(hidden_states, residual)


class DecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)). ``mlp_name`` matches the checkpoint.

    As vLLM's: the block returns (mlp output, residual) and the next norm adds them, so each add
    and the norm after it are one ``RMSNorm(x, residual)`` call (one launch on CUDA); layer 0
    gets residual None (its input is the embedding), the model's final norm adds the last."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 mlp_name: str = "mlp"):
        super().__init__()
        self.self_attn = self_attn
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden_states, residual) [T, H] -> the next pair; their sum is the block's output."""
        x, residual = input_norm(self.input_layernorm, hidden_states, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x), residual)
        return getattr(self, self.mlp_name)(x), residual


class DecoderModel(nn.Module):
    def __init__(self, hf_config: Any, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return self.norm(h, residual)[0]


class DecoderForCausalLM(nn.Module):
    """Base of every model class. Subclasses implement ``make_layer(hf_config, i, prefix)``."""

    def __init__(self, hf_config: Any, prefix: str = ""):
        super().__init__()
        self.config = hf_config
        p = f"{prefix}.model" if prefix else "model"
        layers = [self.make_layer(hf_config, i, f"{p}.layers.{i}")
                  for i in range(hf_config.num_hidden_layers)]
        self.model = DecoderModel(hf_config, layers)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)

    def make_layer(self, hf_config: Any, layer_idx: int, prefix: str) -> nn.Module:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden_states [T, H]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, vocab] float32."""
        if self.tie_word_embeddings:
            return F.linear(hidden_states, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden_states).float()

    def rename_checkpoint_tensor(self, name: str) -> str:
        """Map a checkpoint name to this model's module path (identity unless overridden)."""
        return name

    def load_weights(self, weights) -> set[str]:
        """Load (name, tensor) pairs in HF naming; raises ValueError on any mismatch."""
        return load_decoder_weights(self, weights)
