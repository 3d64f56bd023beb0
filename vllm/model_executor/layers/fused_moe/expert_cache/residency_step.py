"""The residency step: one call per wave of a cached MoE layer, from the router's ids to the
slot ids the expert kernel reads and the miss list the copy engine copies.

    plan, slot_ids = step(residency, topk_ids, row_slots, wave)

topk_ids [T, K] int64 global expert ids (negative: skip the pair); row_slots [T] int64 or None,
the step's KV slot per row (rows whose slot is PAD_SLOT_ID are decode-graph padding and route
nowhere, so a padded replay plans exactly what the eager step would); wave in [0, W), W =
``num_waves(E, T*K, N)``, called in order, running the expert kernel of a wave before the next
wave is planned (a later wave may reuse a slot an earlier one read). Wave 0 fixes every needed
expert's wave (``wave_index``: resident ones first) in ``residency.wave_of_expert`` and the
step's count of non-empty waves in ``residency.step_waves``; each wave then runs
``Residency.plan`` on its experts and remaps its pairs (-1 for pairs of other waves). The
results: ``LoadPlan`` [N] (valid entries first, padding -1) and slot ids [T, K].

Implementations, each bit for bit the same decisions, plan, slot ids, policy state and counters:
  * ``reference_step``: the tensor-op version (``Residency.plan``, ``wave_index``), any device,
    traceable with ``torch.compile(fullgraph=True)``; the one the others are tested against.
  * ``KernelStep`` over the platform's ``residency_step_kernel()``: on CPU one C call per wave
    (``vllm/kernels/cpu/moe_cache.c``), recorded by CPU graphs; on CUDA one Triton launch per
    wave (``vllm/kernels/triton/residency_step.py``), no host read, fixed grid (CUDA-graph
    capturable).
``select_residency_step`` picks one per layer: the platform's kernel when the policy has a
``kernel_code``, else the reference.
"""
from __future__ import annotations

from typing import Callable

import torch

from vllm.model_executor.layers.fused_moe.expert_cache.residency import (LoadPlan, Residency,
                                                                         wave_index)
from vllm.platforms import platform_for

PAD_SLOT_ID = -1
"""forward_context.PAD_SLOT_ID (restated: the cache must not import the model executor)."""


class ResidencyStep:
    name = ""
    on_host = False
    """Whether the state tensors are host memory, so reading ``step_waves`` costs no device sync
    (the provider then skips the empty waves of an eager step)."""
    cpu_graph_node = False
    """Whether a CPU graph records it (a C kernel through ``graph.launch``)."""

    def __call__(self, res: Residency, topk_ids: torch.Tensor, row_slots: torch.Tensor | None,
                 wave: int) -> tuple[LoadPlan, torch.Tensor]:
        raise NotImplementedError


class ReferenceStep(ResidencyStep):
    name = "reference"

    def __init__(self, on_host: bool):
        self.on_host = on_host

    def __call__(self, res, topk_ids, row_slots, wave):
        E, N = res.num_experts, res.num_slots
        valid = topk_ids >= 0                                                # [T, K]
        if row_slots is not None:
            valid = valid & (row_slots != PAD_SLOT_ID).unsqueeze(1)
        ids = torch.where(valid, topk_ids, E)                                # [T, K] in [0, E]
        if wave == 0:
            needed = torch.zeros(E + 1, dtype=torch.bool, device=topk_ids.device)
            needed = needed.index_fill_(0, ids.reshape(-1), True)[:E]        # [E]
            res.wave_of_expert.copy_(wave_index(needed, res.slot_of_expert, N))
            res.step_waves.copy_((needed.sum() + N - 1) // N)
        in_wave = res.wave_of_expert == wave                                 # [E] bool
        plan = res.plan(in_wave)
        ids = ids.clamp(max=E - 1)
        slot_ids = torch.where(in_wave[ids] & valid, res.remap(ids), -1)    # [T, K]
        return plan, slot_ids


def reference_step(res: Residency, topk_ids: torch.Tensor, row_slots: torch.Tensor | None,
                   wave: int) -> tuple[LoadPlan, torch.Tensor]:
    """The tensor-op residency step (see the module docstring)."""
    return ReferenceStep(False)(res, topk_ids, row_slots, wave)


class KernelStep(ResidencyStep):
    """A platform's fused kernel (the signature of ``vllm.kernels.cpu.moe_cache.residency_step``),
    fed the residency's own tensors."""

    def __init__(self, kernel: Callable[..., None], name: str, on_host: bool):
        self.kernel, self.name = kernel, name
        self.on_host = self.cpu_graph_node = on_host

    def __call__(self, res, topk_ids, row_slots, wave):
        N = res.num_slots
        dev = topk_ids.device
        ids = topk_ids if topk_ids.dtype == torch.int64 and topk_ids.is_contiguous() else \
            topk_ids.to(torch.int64).contiguous()
        params, decay_pow = res.policy.kernel_params(dev)
        plan = LoadPlan(torch.empty(N, dtype=torch.int64, device=dev),
                        torch.empty(N, dtype=torch.int64, device=dev),
                        torch.empty(N, dtype=torch.bool, device=dev))
        slot_ids = torch.empty(ids.shape, dtype=torch.int64, device=dev)
        self.kernel(ids, row_slots, wave, res.slot_of_expert, res.expert_of_slot,
                    res.wave_of_expert, res.counters, res.policy.kernel_code, res.policy_state,
                    params, decay_pow, plan.slots, plan.experts, plan.valid, slot_ids)
        return plan, slot_ids


def select_residency_step(res: Residency, device: torch.device) -> ResidencyStep:
    """The step a layer on ``device`` runs: the platform's fused kernel (C on CPU, Triton on
    CUDA) when there is one and the policy has a ``kernel_code``, else the reference."""
    platform = platform_for(device)
    kernel = platform.residency_step_kernel()
    on_host = platform.device_type == "cpu"
    if kernel is not None and res.policy.kernel_code is not None:
        return KernelStep(kernel, "cpu_kernel" if on_host else "triton", on_host)
    return ReferenceStep(on_host)
