"""One step's waves of a cached MoE layer (``CachedWeightProvider.prepare``'s result): per wave,
the residency step's plan -> copy the misses -> the wave's slot ids for the expert kernels
(``provider.py`` has the contract)."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from vllm.kernels.cpu.graph import capturing
from vllm.model_executor.layers.fused_moe.expert_cache.overlap import overlapped_wave
from vllm.model_executor.layers.fused_moe.expert_cache.residency import wave_capacity
from vllm.model_executor.layers.fused_moe.modular_kernel import WaveIds
from vllm.platforms import platform_for


class ExpertPlan:
    """One step's waves (a static count) of ``provider`` (a ``CachedWeightProvider``, not
    imported: it imports this module). Iterate once, in order, running the kernel of a wave
    before asking for the next: a later wave's copies may overwrite slots an earlier wave read
    (on a device, stream order keeps that safe)."""

    def __init__(self, provider, topk_ids: torch.Tensor,
                 row_slots: torch.Tensor | None, num_waves: int):
        self.provider, self.topk_ids, self.row_slots = provider, topk_ids, row_slots
        self.num_waves = num_waves

    def __len__(self) -> int:
        return self.num_waves

    def __iter__(self) -> Iterator[WaveIds]:
        p = self.provider
        step, res = p.step_for_this_call(), p.residency
        skip_empty = step.on_host and not capturing()
        p.join_prefetch()           # the real step may hit on an expert still being copied
        planned = step.waves(res, self.topk_ids, self.row_slots, self.num_waves)
        finished = False
        try:
            for wave, (plan, slot_ids) in enumerate(planned):
                # The wave holds at most `cap` experts (min(N, T*K) but for a last wave), so it
                # loads at most that many, the plan's first entries: the copy gets only those (a
                # GPU copy's blocks walk its entries: 8 flags to read at batch 1, top-8, not
                # 63), and the expert kernels size their grids by it.
                cap = wave_capacity(res.num_experts, self.topk_ids.numel(), res.num_slots, wave)
                plan = plan.head(cap)
                if p.side_stream is not None:
                    yield from overlapped_wave(p.copy, p.slots, plan, slot_ids, p.side_stream,
                                               cap)
                else:
                    p.copy(p.slots, plan)
                    yield WaveIds(slot_ids, cap)
                if skip_empty and wave + 1 >= int(res.step_waves):
                    break
            finished = True
        finally:
            # A step's side-stream work (its account: KernelStep.side) is joined here at the
            # latest, inside the forward that forked it (a capture must end joined).
            planned.close()
            # Stopped part-way (a wave's kernels raised): a step that planned its waves ahead
            # marked later waves' experts resident without copying them. Forget every slot,
            # unless a capture runs (nothing recorded has run; the engine forgets after a
            # refused CPU-graph capture, whose forward did run).
            if not finished and step.plans_ahead and \
                    not platform_for(p.device).is_capturing():
                p.invalidate()
