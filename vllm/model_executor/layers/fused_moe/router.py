"""Expert selection (routing): router logits -> (topk_weights, topk_ids)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.kernels.cpu.ops import topk_softmax
from vllm.platforms import elementwise_ops, native_kernels


@dataclass(frozen=True)
class RouterConfig:
    top_k: int
    renormalize: bool = True
    """Divide the selected weights by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)."""
    scoring_func: str = "softmax"
    """"softmax" or "sigmoid" (DeepSeek-V3 style)."""
    num_expert_group: int | None = None
    """Grouped top-k: experts split into this many groups, ``topk_group`` groups kept."""
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    """Multiplies the final weights (DeepSeek-V2/V3)."""
    num_experts: int | None = None
    """When given, the other fields are checked against it."""

    def __post_init__(self) -> None:
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func={self.scoring_func!r} is invalid: must be 'softmax' or "
                             "'sigmoid'")
        E = self.num_experts
        if self.top_k < 1 or (E is not None and self.top_k > E):
            raise ValueError(f"top_k={self.top_k} is invalid: must be in [1, num_experts={E}]")
        if self.num_expert_group and E is not None:
            self._check_groups(E)

    def _check_groups(self, E: int) -> None:
        groups, keep = self.num_expert_group, self.topk_group or self.num_expert_group
        if E % groups:
            raise ValueError(f"num_expert_group={groups} is invalid: must divide num_experts={E}")
        if not 1 <= keep <= groups:
            raise ValueError(f"topk_group={keep} is invalid: must be in [1, num_expert_group="
                             f"{groups}]")
        if keep * (E // groups) < self.top_k:
            raise ValueError(f"top_k={self.top_k} is invalid: the {keep} kept groups of "
                             f"{E // groups} experts hold only {keep * (E // groups)}")


def select_experts(router_logits: torch.Tensor, cfg: RouterConfig,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (topk_weights [T, K] float32, topk_ids [T, K] int64).

    The correction bias (if any) only affects which experts are selected, never the weights.
    Plain softmax top-k runs one kernel where the platform has one (CUDA: the Triton kernel of
    ``elementwise_ops``; CPU: the C kernel ``vllm/kernels/cpu/router.c``) unless traced by
    torch.compile; everything else, and the kernels' reference, is ``select_experts_torch``.
    """
    if cfg.scoring_func == "softmax" and not cfg.num_expert_group and correction_bias is None \
            and cfg.routed_scaling_factor == 1.0:
        fused = elementwise_ops(router_logits.dtype, router_logits.device)
        if fused is not None and fused.topk_softmax is not None:
            return fused.topk_softmax(router_logits, cfg.top_k, cfg.renormalize)
        if native_kernels(router_logits.dtype, router_logits.device):
            return topk_softmax(router_logits, cfg.top_k, cfg.renormalize)
    return select_experts_torch(router_logits, cfg, correction_bias)


def select_experts_torch(router_logits: torch.Tensor, cfg: RouterConfig,
                         correction_bias: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts`` in torch ops, on any device."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_expert_group:
        choice = _mask_groups(choice, cfg.num_expert_group, cfg.topk_group or cfg.num_expert_group,
                              top2_sum=correction_bias is not None)
    topk_ids = torch.topk(choice, cfg.top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if cfg.renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if cfg.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * cfg.routed_scaling_factor
    return topk_weights, topk_ids


def _mask_groups(scores: torch.Tensor, num_groups: int, keep: int,
                 top2_sum: bool = False) -> torch.Tensor:
    """Keep the ``keep`` best groups. A group's score is its best expert (DeepSeek-V2), or the sum
    of its best two when a correction bias is used (DeepSeek-V3)."""
    T, E = scores.shape
    grouped = scores.view(T, num_groups, E // num_groups)
    if top2_sum and E // num_groups >= 2:
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        group_score = grouped.max(dim=-1).values                   # [T, G]
    kept = torch.topk(group_score, keep, dim=-1).indices            # [T, keep]
    mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~mask[..., None], float("-inf")).view(T, E)
