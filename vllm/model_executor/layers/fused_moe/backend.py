"""The one place that chooses how unquantized experts are computed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vllm.config import get_current_vllm_config
from vllm.logger import init_logger, log_once
from vllm.kernels.cpu.ops import kernels_support, moe_sum, prepack
from vllm.model_executor.layers.fused_moe.cpu_kernel import expert_pairs_cpu
from vllm.model_executor.layers.fused_moe.grouped_mm import (expert_pairs_grouped,
                                                             grouped_mm_supported)
from vllm.model_executor.layers.fused_moe.torch_ref import combine_pairs as combine_pairs_torch
from vllm.model_executor.layers.fused_moe.torch_ref import expert_pairs_ref

logger = init_logger(__name__)

ExpertPairsFn = Callable[..., None]
"""fn(x, w13, w2, topk_weights, topk_ids, out, activation): the apply_pairs contract."""


@dataclass(frozen=True)
class ExpertBackend:
    name: str
    pairs: ExpertPairsFn
    """Computes the pairs from the layer's (packed, if ``pack``) expert tensors."""
    pack: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Applied to each expert's w13 [2N, K] and w2 [K, N] after loading (None: kept as loaded)."""


_BACKENDS = {
    "cpu_kernel": ExpertBackend("cpu_kernel", expert_pairs_cpu, prepack),
    "grouped_mm": ExpertBackend("grouped_mm", expert_pairs_grouped),
    "torch": ExpertBackend("torch", expert_pairs_ref),
}


def select_expert_backend(hidden_size: int, intermediate_size: int,
                          dtype: torch.dtype) -> ExpertBackend:
    """From the current config's ``kernel_config.moe_backend`` and device. "auto" prefers the C
    kernel on CPU, then torch._grouped_mm, then the loop reference."""
    cfg = get_current_vllm_config()
    requested = cfg.kernel_config.moe_backend if cfg is not None else "auto"
    device = cfg.device_config.torch_device if cfg is not None else torch.device("cpu")
    supported = {"cpu_kernel": kernels_support(dtype, device),
                 "grouped_mm": grouped_mm_supported(hidden_size, intermediate_size, dtype, device),
                 "torch": True}
    if requested != "auto" and not supported[requested]:
        raise ValueError(f"moe_backend={requested!r} is not supported for hidden_size={hidden_size}"
                         f", intermediate_size={intermediate_size}, dtype={dtype} on {device}: use "
                         f"one of {[n for n, ok in supported.items() if ok]} or 'auto'")
    name = requested if requested != "auto" else next(n for n, ok in supported.items() if ok)
    log_once(logger, 20, f"MoE expert backend: {name} (requested {requested!r})")
    return _BACKENDS[name]


def combine_pairs(out: torch.Tensor) -> torch.Tensor:
    """[T, top_k, H] per-pair outputs -> [T, H], summed in k order: the one combine of every
    expert path (uncached ``apply`` and the expert cache), so both give the same bits. One C call
    on CPU (on a 2048-token prefill's pairs torch's strided sum took 0.4-2.3 ms, the C loop
    0.2 ms), else torch."""
    if kernels_support(out.dtype, out.device):
        return moe_sum(out)
    return combine_pairs_torch(out)
