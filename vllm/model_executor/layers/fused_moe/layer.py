"""FusedMoE: router -> weight provider -> quant_method.apply.

The layer knows two seams and nothing behind them. Its ``weight_provider`` says where the expert
tensors live: ``prepare(topk_ids)`` gives the waves of ids the kernel runs on and
``slot_weights()`` the tensors they index (all E experts without a cache; N device slots with
``moe_expert_cache_size`` N, ``expert_cache/provider.py``). Its ``quant_method`` owns the
scheme and, through the backend the registry chose for it, computes the pairs.
"""
from __future__ import annotations

import re
from functools import partial
from typing import Callable

import torch
from torch import nn

from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.forward_context import get_attn_metadata
from vllm.model_executor.graph_break import break_graph, capturing_in_pieces
from vllm.model_executor.layers.fused_moe.expert_cache import (CachedWeightProvider,
                                                               WeightProvider, cache_enabled,
                                                               make_weight_provider)
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation
from vllm.model_executor.layers.fused_moe.router import RouterConfig, select_experts
from vllm.model_executor.layers.quantization import get_moe_quant_method
from vllm.model_executor.layers.quantization.base import FusedMoEMethodBase, MoEShape
from vllm.model_executor.layers.quantization.unquantized import UnquantizedFusedMoEMethod
from vllm.platforms import platform_for

logger = init_logger(__name__)

# Checkpoint shard -> (which fused tensor, which half of dim 0 of one expert's tensor).
# w1 = gate, w3 = up (fused as [gate; up] rows of w13), w2 = down.
_SHARDS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, scoring_func: str = "softmax",
                 num_expert_group: int | None = None, topk_group: int | None = None,
                 routed_scaling_factor: float = 1.0, use_correction_bias: bool = False,
                 activation: str | MoEActivation = "silu", params_dtype: torch.dtype | None = None,
                 quant_method: FusedMoEMethodBase | None = None, prefix: str = "",
                 bias: bool = False):
        super().__init__()
        cfg = get_current_vllm_config()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.prefix = prefix
        try:
            self.activation = MoEActivation.of(activation)
            """Expert activation (name and parameters); quant methods read it in
            get_moe_quant_method."""
        except ValueError as err:
            raise ValueError(f"{prefix}: {err}") from None
        self.has_bias = bias
        """Experts carry biases (w13_bias [E, 2N], w2_bias [E, H]; GPT-OSS)."""
        m = re.search(r"layers\.(\d+)\.", prefix + ".")
        self.layer_index = int(m.group(1)) if m else 0
        self.router_config = RouterConfig(top_k, renormalize, scoring_func, num_expert_group,
                                          topk_group, routed_scaling_factor, num_experts)
        # f32 as checkpoints and transformers keep it: in the model dtype (bf16) the bias would
        # be rounded and could change which experts are chosen.
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            if use_correction_bias else None)
        if quant_method is None and cfg is not None and getattr(cfg, "quant_config", None):
            quant_method = get_moe_quant_method(cfg.quant_config, self)
        self.quant_method = quant_method or UnquantizedFusedMoEMethod(self.activation)
        if not self.activation.gated and self.quant_method.scheme != "unquantized":
            raise ValueError(f"{prefix}: non-gated experts (activation "
                             f"{self.activation.name!r}) are supported unquantized only, not "
                             f"as {self.quant_method.scheme!r}")
        shape = MoEShape(num_experts, hidden_size, intermediate_size,
                         params_dtype or torch.get_default_dtype(), bias,
                         self.activation.gated)
        self.params_dtype = shape.params_dtype
        self._moe_cache_config = cfg.moe_cache_config if cfg is not None else None
        # Cached experts are created in host memory: they become the store, never touching the
        # device. Uncached ones are created on the ambient (compute) device.
        cached = cache_enabled(self._moe_cache_config, num_experts)
        self.quant_method.create_weights(self, shape, torch.device("cpu") if cached else None)
        compute_device = cfg.device_config.torch_device if cfg is not None else torch.device("cpu")
        self.quant_method.select_kernel(shape, platform_for(compute_device),
                                        cfg.kernel_config.moe_backend if cfg is not None
                                        else "auto")
        self.weight_provider: WeightProvider | None = None
        """Set by ``finish_loading``."""
        self.routing_observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        """Called with (layer_index, topk_ids [T, top_k]) every forward (routing-trace recorder)."""

    @property
    def expert_cache(self) -> CachedWeightProvider | None:
        """The layer's CachedWeightProvider, or None when every expert is resident."""
        p = self.weight_provider
        return p if p is not None and p.cached else None

    # ---- loading -------------------------------------------------------------------------
    def load_expert_weight(self, name: str, loaded: torch.Tensor, expert_id: int | None,
                           shard: str | None) -> None:
        """Copy one checkpoint tensor into the expert parameter ``name``.

        name: a parameter of this layer with a leading expert dim (e.g. "w13_weight").
        expert_id None: ``loaded`` holds all experts (fused checkpoints); else one expert.
        shard "w1"/"w3": the gate/up half of dim 0 of one expert's w13 tensor; None: the whole.
        Non-gated experts (``activation.gated`` False): "w3" (up) is the whole w13, no "w1".
        """
        param = getattr(self, name, None)
        if param is None:
            raise KeyError(f"{self.prefix}: no expert parameter {name!r}")
        if shard is not None and shard not in _SHARDS:
            raise ValueError(f"{self.prefix}.{name}: shard={shard!r} is invalid: must be one of "
                             f"{sorted(_SHARDS)} or None")
        dst = param.data if expert_id is None else param.data[expert_id]
        if not self.activation.gated and shard == "w1":
            raise ValueError(f"{self.prefix}.{name}: these experts are not gated (activation "
                             f"{self.activation.name!r}): they have no gate projection")
        if shard is not None and _SHARDS[shard][1] is not None and self.activation.gated:
            half = dst.shape[0] // 2
            dst = dst[:half] if _SHARDS[shard][1] == 0 else dst[half:]
        if tuple(dst.shape) != tuple(loaded.shape):
            where = f"expert {expert_id} " if expert_id is not None else ""
            raise ValueError(f"{self.prefix}.{name}: {where}shape mismatch: checkpoint has "
                             f"{tuple(loaded.shape)}, model expects {tuple(dst.shape)}")
        dst.copy_(loaded)

    def finish_loading(self, device: torch.device) -> None:
        """Hand the loaded expert tensors to the weight provider (which processes them, and with a
        cache builds its host store and ``device`` slots); the layer then holds what the kernels
        read under the same names."""
        names = self.quant_method.expert_tensor_names()
        loaded = {n: getattr(self, n) for n in names}
        self.weight_provider = make_weight_provider(loaded, self.quant_method,
                                                    self._moe_cache_config, device, self.prefix,
                                                    self.hidden_size, self.params_dtype)
        for name, t in self.weight_provider.slot_weights().items():
            self._hold(name, t)
        # A backend that quantizes activations (flashinfer_cutlass on NVFP4) reads the scheme's
        # shared input scales; loaded by now, never expert-indexed.
        bind = getattr(self.quant_method.kernel, "bind_shared", None)
        if bind is not None:
            names = getattr(self.quant_method, "shared_param_names", tuple)()
            bind({n: getattr(self, n) for n in names})

    def _hold(self, name: str, t: torch.Tensor) -> None:
        """Register ``t`` under ``name`` (replacing the loading target): ``state_dict`` and
        ``module.to`` see what the kernels read; the provider keeps the same tensor object."""
        if name in self._buffers:  # e.g. an integer g_idx registered as a buffer stays one
            self.register_buffer(name, t)
        elif not isinstance(t, nn.Parameter):
            raise TypeError(f"{self.prefix}.{name}: expert tensors must be nn.Parameters")
        else:
            setattr(self, name, t)

    # ---- forward -------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H], router_logits [T, E] -> [T, H]. Where a step reads the device
        on the host (``moe_expert_cpu_compute``), a decode graph runs that part eagerly between
        its pieces (``graph_break``: ``HostMissCompute.step``), or the whole layer where the
        rest cannot be captured (``_captured_in_part``)."""
        if capturing_in_pieces() and self.weight_provider.reads_on_host and \
                not self._captured_in_part():
            return break_graph(partial(self._forward, hidden_states, router_logits),
                               hidden_states)
        return self._forward(hidden_states, router_logits)

    def _captured_in_part(self) -> bool:
        """Whether a graph can capture this layer's device work around its host part: its
        residency step and copies (``capture_refusal``) and its MoE backend."""
        return self.weight_provider.capture_refusal() is None and \
            getattr(self.quant_method.kernel, "cuda_graph_safe", False)

    def _forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.router_config,
                                                self.e_score_correction_bias)
        if self.routing_observer is not None:
            self.routing_observer(self.layer_index, topk_ids, router_logits)
        return self.forward_experts(hidden_states, topk_weights, topk_ids)

    def forward_experts(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts for a given routing: x [T, H], topk_weights [T, K], topk_ids [T, K] global
        expert ids (-1 = skip the pair) -> [T, H]."""
        if hidden_states.shape[0] != topk_ids.shape[0] or topk_weights.shape != topk_ids.shape:
            raise ValueError(f"{self.prefix}: shape mismatch: x {tuple(hidden_states.shape)}, "
                             f"topk_weights {tuple(topk_weights.shape)}, topk_ids "
                             f"{tuple(topk_ids.shape)}; need x [T, H] and topk_* [T, K]")
        provider = self.weight_provider
        md = get_attn_metadata()
        # The step's KV slots mark decode-graph padding rows (PAD_SLOT_ID): a cache routes them
        # nowhere, so a padded replay plans what the eager step would.
        row_slots = md.slot_mapping if md is not None and \
            md.slot_mapping.shape[0] == topk_ids.shape[0] else None
        topk_weights = topk_weights.to(hidden_states.dtype)
        # moe_expert_cpu_compute: the CPU computes the pairs host_pairs writes.
        topk_ids, host_pairs = provider.host_step(topk_ids, hidden_states, topk_weights,
                                                  row_slots)
        waves = provider.prepare(topk_ids, row_slots)
        return self.quant_method.apply(provider.slot_weights(), hidden_states, topk_weights,
                                       waves, host_pairs=host_pairs)
