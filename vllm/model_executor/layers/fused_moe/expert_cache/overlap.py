"""Miss copies overlapped with the hit experts' compute (``moe_expert_overlap=True``).

Per wave, without overlap: residency step -> copy the misses -> the expert kernels on every pair
of the wave. With overlap the wave is run in two passes of the same kernels:
  1. the residency step (current stream) gives the wave's slot ids [T, K] and its load plan;
  2. the copy of the plan's misses is forked onto the platform's side stream: it starts after
     everything already enqueued on the current stream, so no kernel of an earlier wave, layer
     or step still reads a slot it overwrites;
  3. the kernels run the wave's *hit* pairs (pairs whose slot this plan does not load) on the
     current stream while the copy runs: the plan's slots are the wave's victims and empty
     slots, never a slot a needed resident expert occupies, so the two touch disjoint slots;
  4. the current stream joins the side stream, and the kernels run the *miss* pairs.
Every pair is computed once, by the same kernel on the same slot weights, and the layer sums the
pairs in k order afterwards (``combine_pairs``), so outputs are bitwise those without overlap.
No host read: the split is fixed-shape device code, so a decode graph captures it (the fork and
join are events). Where the platform has no side stream (CPU) the provider does not split.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from vllm.model_executor.layers.fused_moe.expert_cache.residency import LoadPlan
from vllm.model_executor.layers.fused_moe.modular_kernel import WaveIds
from vllm.platforms.interface import SideStream


def split_pairs(slot_ids: torch.Tensor, plan: LoadPlan, num_slots: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """slot_ids [T, K] (-1: not in this wave) -> (hit ids, miss ids), each [T, K] with -1 where
    the pair belongs to the other pass: a pair is a miss when the plan loads its slot."""
    dev = slot_ids.device
    target = torch.where(plan.valid, plan.slots, num_slots)          # [N]; N = "loads nothing"
    loading = torch.zeros(num_slots + 1, dtype=torch.bool, device=dev)
    loading.index_fill_(0, target, True)                               # [N + 1]
    miss = loading[slot_ids.clamp(min=0)] & (slot_ids >= 0)          # [T, K]; ids < N
    neg = torch.full_like(slot_ids, -1)
    return torch.where(miss, neg, slot_ids), torch.where(miss, slot_ids, neg)


def overlapped_wave(copy, slots: dict[str, torch.Tensor], plan: LoadPlan,
                    slot_ids: torch.Tensor, side: SideStream, max_ids: int | None = None
                    ) -> Iterator[WaveIds]:
    """Steps 2-4 above for one wave: yields the hit ids, then (after the join) the miss ids,
    each with the wave's bound ``max_ids`` (``WaveIds``: both are subsets of the wave).
    The caller runs the kernels of each before asking for the next; a caller that stops early
    closes the generator (``FusedMoEMethodBase.apply``), which still joins."""
    try:
        with side.fork():
            copy(slots, plan)
        # After the copy is enqueued: a step stopped between the residency step and its copy
        # would leave experts marked resident that were never copied.
        hits, misses = split_pairs(slot_ids, plan, next(iter(slots.values())).shape[0])
        yield WaveIds(hits, max_ids)
    finally:
        # Even when the copy, the split or the hit pass raised: a capture must not end with the
        # side stream forked (cudaErrorStreamCaptureUnjoined), and eagerly the plan must not be
        # freed on the current stream while the side stream's copy may still read it.
        side.join()
    yield WaveIds(misses, max_ids)
