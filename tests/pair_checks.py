"""The pair contract's invariance checks, shared by the expert-kernel tests: a pair's value must
not depend on which other pairs share the call (``modular_kernel.py``), which is what makes a
cached step (waves over slots) bitwise equal to an uncached one."""
from __future__ import annotations

import torch


def assert_pairs_independent(kernel, weights: dict[str, torch.Tensor], x: torch.Tensor,
                             wts: torch.Tensor, ids: torch.Tensor, num_experts: int) -> None:
    """Rows together == one by one == split into waves of two slots (fewer slots than top_k, as
    an expert cache with N < top_k runs them), bitwise. x [T, H]; wts, ids [T, K]."""
    T, K = ids.shape
    whole = torch.zeros(T, K, x.shape[-1], dtype=x.dtype)
    kernel.apply_pairs(weights, x, wts, ids, whole)
    alone = torch.zeros_like(whole)
    for t in range(T):
        kernel.apply_pairs(weights, x[t:t + 1], wts[t:t + 1], ids[t:t + 1], alone[t:t + 1])
    assert torch.equal(alone, whole)
    waves = torch.zeros_like(whole)
    for lo in range(0, num_experts, 2):              # two slots: one wave each
        resident = torch.tensor([lo, lo + 1])
        slots = {n: t[resident].clone() for n, t in weights.items()}
        slot_ids = torch.where((ids >= lo) & (ids < lo + 2), ids - lo, -1)
        kernel.apply_pairs(slots, x, wts, slot_ids, waves)
    assert torch.equal(waves, whole)
