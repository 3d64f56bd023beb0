"""Brute-force prefetch counters for a CachedWeightProvider, computed eagerly in plain Python
from snapshots of its residency, to check the provider's lazy, tensor-side bookkeeping
(``expert_cache/prefetch.py``) against.

Wraps the provider's ``prefetch`` and ``prepare``: a step's needed set is the set of ids the real
router handed ``prepare``; it is closed (used / wasted / recall settled) at the provider's next
call or when ``expected()`` is asked, by which time its waves have run.
"""
from __future__ import annotations

from collections import Counter


def brute_wanted(ids: list[list[int]], num_slots: int) -> set[int]:
    """At most N predicted experts, most-predicted first, ties to the lower id."""
    counts = Counter(e for row in ids for e in row if e >= 0)
    return {e for e, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:num_slots]}


class PrefetchAudit:
    FIELDS = ("predicted", "loads", "used", "wasted", "recalled", "needed")

    def __init__(self, provider):
        self.p = provider
        self.c = dict.fromkeys(self.FIELDS, 0)
        self.flagged: set[int] = set()
        self.pending: set[int] | None = None
        self.step_needed: set[int] | None = None
        self.needed_total = 0          # distinct experts over all real steps (hits + misses)
        self._prefetch, self._prepare = provider.prefetch, provider.prepare
        provider.prefetch, provider.prepare = self.prefetch, self.prepare

    def resident(self) -> set[int]:
        return {e for e, s in enumerate(self.p.residency.slot_of_expert.tolist()) if s >= 0}

    def prefetch(self, ids, row_slots=None):
        assert row_slots is None or (row_slots >= 0).all(), "eager steps have no padding rows"
        self._close_step()
        before = self.resident()
        wanted = brute_wanted(ids.tolist(), self.p.num_slots)
        self._prefetch(ids, row_slots)
        after = self.resident()
        assert wanted <= after, "every wanted expert is resident after a prefetch"
        loads = wanted - before
        self.c["predicted"] += len(wanted)
        self.c["loads"] += len(loads)
        self.c["wasted"] += len(self.flagged - after)
        self.flagged = (self.flagged & after) | loads
        self.pending = wanted

    def prepare(self, ids, row_slots=None):
        self._close_step()
        self.step_needed = {e for row in ids.tolist() for e in row if e >= 0}
        self.needed_total += len(self.step_needed)
        return self._prepare(ids, row_slots)

    def _close_step(self) -> None:
        needed, self.step_needed = self.step_needed, None
        if needed is None:
            return
        after = self.resident()
        used = self.flagged & needed
        self.c["used"] += len(used)
        rest = self.flagged - used
        self.c["wasted"] += len(rest - after)
        self.flagged = rest & after
        if self.pending is not None:
            self.c["recalled"] += len(self.pending & needed)
            self.c["needed"] += len(needed)
            self.pending = None

    def expected(self) -> dict[str, int]:
        """The provider's ``prefetch_*`` counters as they must read now."""
        self._close_step()
        return {f"prefetch_{k}": v for k, v in self.c.items()}

    @staticmethod
    def actual(stats: dict) -> dict[str, int]:
        return {f"prefetch_{k}": stats[f"prefetch_{k}"] for k in PrefetchAudit.FIELDS}
