"""Belady's offline optimum for demand loading: the reference the online policies are measured by.

Deliberately independent of ``Residency`` (plain Python/numpy, no torch): on a miss, evict the
resident expert whose next use is farthest in the future; never evict an expert needed by the
current wave. Steps needing more than C distinct experts are split into waves the way the cache
splits them (resident-first, then by expert id, chunks of C), so it is the optimum under the same
wave structure.
"""
from __future__ import annotations

import numpy as np


def belady_layer(needed: np.ndarray, capacity: int) -> tuple[int, int]:
    """needed [S, E] bool for one layer -> (hits, misses) of Belady with ``capacity`` slots."""
    num_steps, num_experts = needed.shape
    if not 1 <= capacity <= num_experts:
        raise ValueError(f"capacity={capacity} is invalid: must be in [1, {num_experts}]")
    never = num_steps + 1
    # uses[e]: the steps using e, then a sentinel; ptr[e] indexes e's next use at or after now.
    uses = [np.append(np.flatnonzero(needed[:, e]), never).tolist() for e in range(num_experts)]
    ptr = [0] * num_experts
    per_step = [np.flatnonzero(row).tolist() for row in needed]
    resident: set[int] = set()
    hits = misses = 0
    for step, need in enumerate(per_step):
        for e in need:
            ptr[e] += 1                          # now uses[e][ptr[e]] is e's next use after step
        ordered = [e for e in need if e in resident] + [e for e in need if e not in resident]
        for w in range(0, len(ordered), capacity):
            wave = ordered[w:w + capacity]
            in_wave = set(wave)
            for e in wave:
                if e in resident:
                    hits += 1
                    continue
                misses += 1
                if len(resident) >= capacity:
                    victim = max((x for x in resident if x not in in_wave),
                                 key=lambda x: (uses[x][ptr[x]], x))
                    resident.discard(victim)
                resident.add(e)
    return hits, misses


def belady_hit_rate(masks: np.ndarray, capacity: int) -> float:
    """masks [S, L, E] bool (per step and layer, the experts needed) -> Belady hit rate."""
    hits = misses = 0
    for layer in range(masks.shape[1]):
        h, m = belady_layer(masks[:, layer], capacity)
        hits, misses = hits + h, misses + m
    return hits / max(1, hits + misses)
