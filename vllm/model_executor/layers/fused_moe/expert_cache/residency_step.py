"""The residency step of a cached MoE layer, from the router's ids to the slot ids the expert
kernel reads and the miss list the copy engine copies, per wave:

    plan, slot_ids = step(residency, topk_ids, row_slots, wave)
    for plan, slot_ids in step.waves(residency, topk_ids, row_slots, W): ...

topk_ids [T, K] int64 global expert ids (negative: skip the pair); row_slots [T] int64 or None,
the step's KV slot per row (rows whose slot is PAD_SLOT_ID are decode-graph padding and route
nowhere, so a padded replay plans exactly what the eager step would); wave in [0, W), W =
``num_waves(E, T*K, N)``, planned in order; a wave's misses are copied only after the expert
kernels of the wave before it ran (a later wave may reuse a slot an earlier one read), so the
waves may all be planned first. Wave 0 fixes every needed
expert's wave (``wave_index``: resident ones first) in ``residency.wave_of_expert`` and the
step's count of non-empty waves in ``residency.step_waves``; each wave then runs
``Residency.plan`` on its experts and remaps its pairs (-1 for pairs of other waves). The
results: ``LoadPlan`` [N] (valid entries first, padding -1) and slot ids [T, K].

Implementations, each bit for bit the same decisions, plan, slot ids, policy state and counters:
  * ``reference_step``: the tensor-op version (``Residency.plan``, ``wave_index``), any device,
    traceable with ``torch.compile(fullgraph=True)``; the one the others are tested against.
  * ``KernelStep`` over the platform's ``residency_step_kernel()``: ``waves`` plans all W waves
    of the step in one call, on CPU one C call (``vllm/kernels/cpu/moe_cache.c``), recorded by
    CPU graphs, on CUDA one Triton launch (``vllm/kernels/triton/residency_step.py``), no host
    read, fixed grid (CUDA-graph capturable): one per layer and step. Plans [W, N] and slot ids
    [W, T, K] (W * T * K * 8 bytes: 4 MiB for a prefill of 8192 tokens, top-8, 8 waves).
    With a side stream (CUDA) a step is two launches: the route before the waves' copies and
    experts, the account (policy state, counters) beside them (with several waves only when
    the step's experts fit the first; else the route runs the waves whole).
``select_residency_step`` picks one per layer: the platform's kernel when the policy has a
``kernel_code``, else the reference.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Callable

import torch

from vllm.model_executor.layers.fused_moe.expert_cache.residency import (LoadPlan, Residency,
                                                                         wave_index)
from vllm.platforms import platform_for
from vllm.platforms.interface import SideStream

PAD_SLOT_ID = -1
"""forward_context.PAD_SLOT_ID (restated: the cache must not import the model executor)."""


class ResidencyStep:
    """``step(res, topk_ids, row_slots, wave)`` plans one wave; ``waves(res, topk_ids, row_slots,
    W)`` yields every wave's (plan, slot ids) in order, where a fused kernel plans them all in
    one call at the first ``next``."""
    name = ""
    on_host = False
    """Whether the state tensors are host memory, so reading ``step_waves`` costs no device sync
    (the provider then skips the empty waves of an eager step)."""
    cpu_graph_node = False
    """Whether a CPU graph records it (a C kernel through ``graph.launch``)."""
    plans_ahead = False
    """Whether ``waves`` plans every wave before the first is used (then a step stopped
    part-way leaves later waves resident in the maps but not copied)."""

    def __call__(self, res: Residency, topk_ids: torch.Tensor, row_slots: torch.Tensor | None,
                 wave: int) -> tuple[LoadPlan, torch.Tensor]:
        raise NotImplementedError

    def waves(self, res: Residency, topk_ids: torch.Tensor, row_slots: torch.Tensor | None,
              num_waves: int) -> Iterator[tuple[LoadPlan, torch.Tensor]]:
        """Waves 0..num_waves-1 of one step: here one call per wave, each when asked for."""
        for wave in range(num_waves):
            yield self(res, topk_ids, row_slots, wave)


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
    fed the residency's own tensors. ``side``: where the kernel plans a step in two launches
    (``part`` "route", then "account": the Triton kernel), the account (the policy state and
    counters) runs on this side stream, role "account", beside the waves' copies and expert
    kernels, and joins after them: only the route (plans, maps, slot ids) is on the way to the
    experts. The same state after the step as one launch."""
    plans_ahead = True

    def __init__(self, kernel: Callable[..., None], name: str, on_host: bool,
                 side: SideStream | None = None):
        self.kernel, self.name = kernel, name
        self.on_host = self.cpu_graph_node = on_host
        self.side = side

    def __call__(self, res, topk_ids, row_slots, wave):
        (plan,), slot_ids = self._launch(res, topk_ids, row_slots, wave, 1)
        return plan, slot_ids[0]

    def waves(self, res, topk_ids, row_slots, num_waves):
        """All the step's waves in one kernel call (issue 26: one residency step per layer), or
        a wave's route and account on two streams (``side``). The state then holds every wave's
        residency before the first wave's experts run, which is safe because each wave's copy
        runs after the kernels of the wave before it. A step that stops part-way leaves later
        waves marked resident but uncopied, so every slot is forgotten
        (``CachedWeightProvider.invalidate``): by the plan when a wave raised, by the engine
        after a failed step (model_runner) and after a refused CPU-graph capture
        (cpu_graphs)."""
        if self.side is not None:
            yield from self._routed(res, topk_ids, row_slots, num_waves)
            return
        plans, slot_ids = self._launch(res, topk_ids, row_slots, 0, num_waves)
        # select, not unbind: a CPU graph records views it knows (kernels/cpu/graph.py).
        yield from ((plans[i], slot_ids[i]) for i in range(num_waves))

    def _routed(self, res: Residency, topk_ids: torch.Tensor, row_slots: torch.Tensor | None,
                num_waves: int) -> Iterator[tuple[LoadPlan, torch.Tensor]]:
        """The waves' route on the current stream, the account forked after it (it reads the
        route's plans and eviction counts, and the policy state the route read; with several
        waves, the route's word on whether it left the accounts), joined once the caller has
        enqueued the waves' kernels (after the last wave, or on closing this)."""
        evictions = torch.empty(num_waves + (num_waves > 1), dtype=torch.int64,
                                device=topk_ids.device)
        args = self._arguments(res, topk_ids, row_slots, 0, num_waves)
        self.kernel(*args, num_waves=num_waves, part="route", evictions=evictions)
        try:
            with self.side.fork("account"):
                self.kernel(*args, num_waves=num_waves, part="account", evictions=evictions)
            plans, slot_ids = self._outputs(args)
            yield from ((plans[i], slot_ids[i]) for i in range(num_waves))
        finally:
            # Even when the caller stopped: a capture must not end with the side stream forked.
            self.side.join("account")

    def _arguments(self, res: Residency, topk_ids: torch.Tensor, row_slots: torch.Tensor | None,
                   wave: int, num_waves: int) -> tuple:
        """The kernel's positional arguments for waves [wave, wave + num_waves), with fresh
        outputs: plan slots, experts, valid [num_waves, N] (11-13), slot ids [num_waves, T, K]
        (14)."""
        N = res.num_slots
        dev = topk_ids.device
        ids = topk_ids if topk_ids.dtype == torch.int64 and topk_ids.is_contiguous() else \
            topk_ids.to(torch.int64).contiguous()
        params, decay_pow = res.policy.kernel_params(dev)
        slots, experts = (torch.empty(num_waves, N, dtype=torch.int64, device=dev)
                          for _ in range(2))
        valid = torch.empty(num_waves, N, dtype=torch.bool, device=dev)
        slot_ids = torch.empty((num_waves, *ids.shape), dtype=torch.int64, device=dev)
        return (ids, row_slots, wave, res.slot_of_expert, res.expert_of_slot,
                res.wave_of_expert, res.counters, res.policy.kernel_code, res.policy_state,
                params, decay_pow, slots, experts, valid, slot_ids)

    def _launch(self, res: Residency, topk_ids: torch.Tensor, row_slots: torch.Tensor | None,
                wave: int, num_waves: int) -> tuple[list[LoadPlan], torch.Tensor]:
        """Waves [wave, wave + num_waves) in one call: their plans and slot ids
        [num_waves, T, K]."""
        args = self._arguments(res, topk_ids, row_slots, wave, num_waves)
        self.kernel(*args, num_waves=num_waves)
        return self._outputs(args)

    @staticmethod
    def _outputs(args: tuple) -> tuple[list[LoadPlan], torch.Tensor]:
        """The plans and slot ids [num_waves, T, K] that ``_arguments``' outputs hold."""
        slots, experts, valid, slot_ids = args[11:]
        # select, not unbind (iterating a tensor): a CPU graph records views it knows.
        return [LoadPlan(slots[i], experts[i], valid[i]) for i in range(slots.shape[0])], \
            slot_ids


def select_residency_step(res: Residency, device: torch.device) -> ResidencyStep:
    """The step a layer on ``device`` runs: the platform's fused kernel (C on CPU, Triton on
    CUDA) when there is one and the policy has a ``kernel_code``, else the reference."""
    platform = platform_for(device)
    kernel = platform.residency_step_kernel()
    on_host = platform.device_type == "cpu"
    if kernel is not None and res.policy.kernel_code is not None:
        side = platform.side_stream(device) if platform.residency_step_parts() else None
        return KernelStep(kernel, "cpu_kernel" if on_host else "triton", on_host, side)
    return ReferenceStep(on_host)
