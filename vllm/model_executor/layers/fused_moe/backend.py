"""The one place that chooses how unquantized experts are computed."""
from __future__ import annotations

from typing import Callable

import torch

from vllm.config import get_current_vllm_config
from vllm.logger import init_logger, log_once
from vllm.model_executor.layers.fused_moe.grouped_mm import (expert_pairs_grouped,
                                                             grouped_mm_supported)
from vllm.model_executor.layers.fused_moe.torch_ref import expert_pairs_ref

logger = init_logger(__name__)

ExpertPairsFn = Callable[..., None]
"""fn(x, w13, w2, topk_weights, topk_ids, out, activation): the apply_pairs contract."""


def select_expert_backend(hidden_size: int, intermediate_size: int,
                          dtype: torch.dtype) -> tuple[str, ExpertPairsFn]:
    """-> (name, fn) from the current config's ``kernel_config.moe_backend`` and device."""
    cfg = get_current_vllm_config()
    requested = cfg.kernel_config.moe_backend if cfg is not None else "auto"
    device = cfg.device_config.torch_device if cfg is not None else torch.device("cpu")
    supported = grouped_mm_supported(hidden_size, intermediate_size, dtype, device)
    if requested == "grouped_mm" and not supported:
        raise ValueError(f"moe_backend='grouped_mm' is not supported for hidden_size={hidden_size}, "
                         f"intermediate_size={intermediate_size}, dtype={dtype} on {device}: "
                         "use 'torch' or 'auto'")
    name = "grouped_mm" if requested == "grouped_mm" or (requested == "auto" and supported) \
        else "torch"
    log_once(logger, 20, f"MoE expert backend: {name} (requested {requested!r})")
    return name, expert_pairs_grouped if name == "grouped_mm" else expert_pairs_ref
