"""Nemotron-H (NVIDIA Nemotron-H, Nemotron-Nano-v2/3, Nemotron-Cascade-2-30B-A3B): a hybrid of
Mamba-2, attention, MLP and MoE layers, matching ``transformers.NemotronHForCausalLM``.

Layer i is one block, ``h += mixer(norm(h))``, whose mixer ``hybrid_override_pattern[i]`` (HF:
``layers_block_type``) names: ``M`` Mamba-2 (``layers/mamba``: state per request, no KV
cache), ``*`` attention (no positional encoding at all: Nemotron-H's attention has no rope),
``-`` MLP (up, relu^2, down: not gated), ``E`` MoE: a sigmoid router in f32 with
``e_score_correction_bias`` (choice only), ``n_group`` / ``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``; non-gated relu^2 experts (``up_proj`` [I, H], ``down_proj``
[H, I]); one shared relu^2 MLP; optional latent projections (``moe_latent_size``).

Checkpoint names are the published ones (``backbone.embeddings``, ``backbone.layers.{i}.norm``,
``backbone.layers.{i}.mixer.*``, ``backbone.norm_f``, ``lm_head``), which are our module paths;
transformers' in-memory names (``model.`` for ``backbone.``, fused ``experts.up_proj`` [E, I, H]
and ``experts.down_proj`` [E, H, I]) load too. Multi-token-prediction tensors (``mtp.*``) are
skipped.

Differences from transformers: the Mamba dt clamp is the config's ``time_step_limit`` (default
(0, inf), as the original implementation and the mamba_ssm kernels) in prefill and decode;
transformers clamps at ``time_step_min`` in its prefill scan only. The block and final norms
multiply the weight in the model dtype (transformers: in f32; the same in fp32).
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKV, Linear, fuse_projections, project
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.vocab_embedding import VocabEmbedding
from vllm.model_executor.models.decoder import config_attr, head_dim_of
from vllm.model_executor.models.weight_loading import load_decoder_weights

_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# transformers' layers_block_type names -> pattern characters
_BLOCK_TYPES = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
                "mlp": "-", "moe": "E"}
_FUSED_EXPERTS = re.compile(r"^(?P<mod>.+\.mixer\.experts)\.(?P<proj>up_proj|down_proj)$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layer_pattern(hf_config: Any) -> str:
    """One character per layer (M, *, -, E) from ``hybrid_override_pattern`` or, as
    transformers >= 5 stores it, ``layers_block_type``."""
    types = config_attr(hf_config, "layers_block_type", "layer_types", default=None)
    if types is not None and not isinstance(types, str):
        unknown = sorted(set(types) - set(_BLOCK_TYPES))
        if unknown:
            raise ValueError(f"layers_block_type has unsupported entries {unknown}: must be "
                             f"among {sorted(_BLOCK_TYPES)}")
        return "".join(_BLOCK_TYPES[t] for t in types)
    pattern = getattr(hf_config, "hybrid_override_pattern", None)
    if not pattern or set(pattern) - set(_KINDS):
        raise ValueError(f"hybrid_override_pattern={pattern!r} is invalid: must be a non-empty "
                         "string of M (Mamba-2), * (attention), - (MLP) and E (MoE)")
    return pattern


class NemotronHMLP(nn.Module):
    """down(act(up(x))): not gated; act is ``mlp_hidden_act`` (relu2 in every release)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool):
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHAttention(nn.Module):
    """q/k/v/o projections and paged causal attention; no rope (positions are unused)."""

    def __init__(self, hf_config: Any, prefix: str):
        super().__init__()
        H, nH = hf_config.hidden_size, hf_config.num_attention_heads
        nKV = config_attr(hf_config, "num_key_value_heads", default=nH)
        D = head_dim_of(hf_config)
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.q_proj = Linear(H, nH * D, bias=bias)
        self.k_proj = Linear(H, nKV * D, bias=bias)
        self.v_proj = Linear(H, nKV * D, bias=bias)
        self.o_proj = Linear(nH * D, H, bias=bias)
        self.attn = Attention(nH, D, nKV, D ** -0.5, prefix=f"{prefix}.attn")

    def finish_loading(self, device: torch.device) -> None:
        fuse_projections(self, QKV, device)   # one GEMM where the Linears are nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(*project(self, QKV, x)))


class NemotronHMoE(nn.Module):
    """Router ``gate`` (f32) + routed ``experts`` (non-gated relu^2) + ``shared_experts``."""

    def __init__(self, hf_config: Any, prefix: str):
        super().__init__()
        H, E = hf_config.hidden_size, config_attr(hf_config, "n_routed_experts", "num_experts")
        act = hf_config.mlp_hidden_act
        if act != "relu2":
            raise ValueError(f"{prefix}: mlp_hidden_act={act!r} is not supported for MoE "
                             "experts: must be 'relu2'")
        latent = getattr(hf_config, "moe_latent_size", None)
        bias = bool(getattr(hf_config, "mlp_bias", False))
        groups = getattr(hf_config, "n_group", 1) or 1
        self.gate = Linear(H, E, bias=False, dtype=torch.float32)
        self.experts = FusedMoE(
            E, hf_config.num_experts_per_tok, latent or H, hf_config.moe_intermediate_size,
            renormalize=bool(getattr(hf_config, "norm_topk_prob", True)), scoring_func="sigmoid",
            num_expert_group=groups if groups > 1 else None,
            topk_group=hf_config.topk_group if groups > 1 else None,
            routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
            use_correction_bias=True, activation="relu2_no_mul", prefix=f"{prefix}.experts")
        self.shared_experts = NemotronHMLP(H, hf_config.moe_shared_expert_intermediate_size,
                                           act, bias) \
            if (getattr(hf_config, "n_shared_experts", 1) or 0) > 0 else None
        if latent:
            self.fc1_latent_proj = Linear(H, latent, bias=bias)
            self.fc2_latent_proj = Linear(latent, H, bias=bias)
        self.latent = bool(latent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        logits = self.gate(x.float())                                   # [T, E] f32
        routed_in = self.fc1_latent_proj(x) if self.latent else x
        out = self.experts(routed_in, logits)
        if self.latent:
            out = self.fc2_latent_proj(out)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def make_mixer(hf_config: Any, kind: str, prefix: str) -> nn.Module:
    c = hf_config
    if kind == "M":
        return MambaMixer2(
            c.hidden_size, c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.n_groups,
            c.conv_kernel, c.chunk_size, use_conv_bias=bool(c.use_conv_bias),
            use_bias=bool(getattr(c, "use_bias", False)), eps=c.layer_norm_epsilon,
            activation=getattr(c, "mamba_hidden_act", "silu"),
            time_step_limit=tuple(getattr(c, "time_step_limit", None) or (0.0, float("inf"))),
            ssm_state_dtype=_DTYPES[getattr(c, "mamba_ssm_cache_dtype", None) or "float32"],
            prefix=prefix)
    if kind == "*":
        return NemotronHAttention(c, prefix)
    if kind == "-":
        return NemotronHMLP(c.hidden_size, c.intermediate_size, c.mlp_hidden_act,
                            bool(getattr(c, "mlp_bias", False)))
    return NemotronHMoE(c, prefix)


class NemotronHBlock(nn.Module):
    """h + mixer(norm(h)): one pre-norm residual block per layer."""

    def __init__(self, hf_config: Any, kind: str, prefix: str):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.layer_norm_epsilon)
        self.mixer = make_mixer(hf_config, kind, f"{prefix}.mixer")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.mixer(self.norm(hidden_states))


class NemotronHModel(nn.Module):
    def __init__(self, hf_config: Any, prefix: str):
        super().__init__()
        self.embeddings = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(hf_config, kind, f"{prefix}.layers.{i}")
                                    for i, kind in enumerate(layer_pattern(hf_config)))
        self.norm_f = RMSNorm(hf_config.hidden_size, hf_config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm_f(h)


def per_expert_tensors(weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' fused expert tensors (``...experts.up_proj`` [E, I, H], ``down_proj``
    [E, H, I], out x in) -> ``...experts.{e}.up_proj.weight`` rows; the rest pass through."""
    for name, tensor in weights:
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            yield name, tensor
            continue
        for e in range(tensor.shape[0]):
            yield f"{m['mod']}.{e}.{m['proj']}.weight", tensor[e]


class NemotronHForCausalLM(nn.Module):
    def __init__(self, hf_config: Any, prefix: str = ""):
        super().__init__()
        self.config = hf_config
        p = f"{prefix}.backbone" if prefix else "backbone"
        self.backbone = NemotronHModel(hf_config, p)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] (unused: no layer encodes positions) -> [T, H]."""
        return self.backbone(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, vocab] float32."""
        if self.tie_word_embeddings:
            return F.linear(hidden_states, self.backbone.embeddings.weight).float()
        return self.lm_head(hidden_states).float()

    def rename_checkpoint_tensor(self, name: str) -> str:
        if name.startswith("model."):                    # transformers' in-memory prefix
            name = "backbone." + name[len("model."):]
        # The correction bias lives on the router in checkpoints and on FusedMoE here.
        return name.replace("mixer.gate.e_score_correction_bias",
                            "mixer.experts.e_score_correction_bias")

    def load_weights(self, weights) -> set[str]:
        """HF-named tensors; multi-token-prediction layers (``mtp.*``) skipped."""
        ours = ((n, t) for n, t in weights if not n.startswith("mtp."))
        return load_decoder_weights(self, per_expert_tensors(ours))
