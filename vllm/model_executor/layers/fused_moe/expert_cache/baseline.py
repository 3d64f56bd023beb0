"""The upstream expert-cache proposal, as a baseline to measure against (not used by the engine).

``SyncLFRUProvider`` has the provider face (``prepare`` -> waves of slot ids, ``slot_weights``)
and does what the upstream seed does (``../shared/context/moe-expert-cache.md``): bookkeeping in
Python on the host (the step's ids read with ``tolist()``: one host sync per step), LFRU
(``freq / (clock - last_use + 1)``), and one synchronous copy per missing expert and tensor,
serialised with compute (no copy kernel, no overlap).

Its decisions are the cache's own for the ``lfru`` policy, so hit rates compare one to one: waves
= needed experts ordered resident-first then by id, cut into chunks of N; in a wave each miss (in
id order) takes an empty slot (in slot order) or else the slot whose expert has the lowest
(score, expert id) among those not in the wave; then every expert of the wave is accessed
(freq += 1, last_use = clock) and a non-empty wave advances the clock. Python floats are IEEE
doubles, so scores order exactly as the float64 tensor policy's.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from vllm.model_executor.layers.fused_moe.expert_cache.store import HostStore
from vllm.model_executor.layers.fused_moe.modular_kernel import WaveIds


class SyncLFRUProvider:
    cached = True

    def __init__(self, store: HostStore, slots: dict[str, torch.Tensor]):
        self.store, self.slots = store, slots
        self.num_experts = store.num_experts
        self.num_slots = next(iter(slots.values())).shape[0]
        self.expert_of_slot: list[int] = [-1] * self.num_slots
        self.slot_of_expert: dict[int, int] = {}
        self.freq = [0] * self.num_experts
        self.last_use = [0] * self.num_experts
        self.clock = 0
        self.hits = self.misses = 0

    def slot_weights(self) -> dict[str, torch.Tensor]:
        return self.slots

    def prepare(self, topk_ids: torch.Tensor, row_slots=None) -> Iterator[WaveIds]:
        """topk_ids [T, K] (-1 = skip) -> waves of slot ids [T, K] (-1 outside the wave), with
        no bound (the kernels size their grids for every slot, as upstream's do). A generator:
        each wave's copies happen when the kernel asks for the wave."""
        needed = sorted({e for row in topk_ids.tolist() for e in row if e >= 0})
        ordered = [e for e in needed if e in self.slot_of_expert] + \
                  [e for e in needed if e not in self.slot_of_expert]
        for w in range(0, len(ordered), self.num_slots):
            wave = ordered[w:w + self.num_slots]
            self._plan(wave)
            slot_map = torch.full((self.num_experts + 1,), -1, dtype=torch.int64)
            for e in wave:
                slot_map[e] = self.slot_of_expert[e]
            # -1 ids index the trailing -1 entry.
            yield WaveIds(slot_map.to(topk_ids.device)[topk_ids.long()])

    def _plan(self, wave: list[int]) -> None:
        in_wave = set(wave)
        self.hits += sum(1 for e in wave if e in self.slot_of_expert)
        for e in sorted(x for x in wave if x not in self.slot_of_expert):
            self.misses += 1
            slot = self._victim(in_wave)
            old = self.expert_of_slot[slot]
            if old >= 0:
                del self.slot_of_expert[old]
            self.expert_of_slot[slot], self.slot_of_expert[e] = e, slot
            self.copy_expert(slot, e)
        for e in wave:
            self.freq[e] += 1
            self.last_use[e] = self.clock
        if wave:
            self.clock += 1

    def copy_expert(self, slot: int, expert: int) -> None:
        """Synchronous copies, one per tensor (a pinned store's copy to a device still waits)."""
        for name, src in self.store.tensors.items():
            self.slots[name][slot].copy_(src[expert])

    def _victim(self, in_wave: set[int]) -> int:
        for s, e in enumerate(self.expert_of_slot):
            if e < 0:
                return s

        def key(s: int) -> tuple[float, int]:
            e = self.expert_of_slot[s]
            return self.freq[e] / (self.clock - self.last_use[e] + 1), e
        return min((s for s, e in enumerate(self.expert_of_slot) if e not in in_wave), key=key)

    def stats(self) -> dict[str, int | float]:
        lookups = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses,
                "bytes_copied": self.misses * self.store.bytes_per_expert,
                "hit_rate": self.hits / lookups if lookups else 0.0}
