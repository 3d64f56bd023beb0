"""Python wrappers of ``moe_cache.c``: the expert cache's fused residency step (all of a step's
waves in one call) and its miss copy.

Both go through ``graph.launch``, so a CPU graph records them like any other kernel: a cached
MoE layer's decode step replays with its bookkeeping and copies inside the graph. They take raw
pointers to tensors their callers own (the layer's residency state lives as long as the layer).
"""
from __future__ import annotations

import torch

from vllm.kernels.cpu.graph import launch


def _ptr(t: torch.Tensor | None, dtype: torch.dtype, what: str) -> int | None:
    if t is None:
        return None
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"moe_cache: {what} must be a contiguous CPU {dtype} tensor, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    return t.data_ptr()


def _policy_ptrs(policy_code: int, state: dict[str, torch.Tensor], params: torch.Tensor,
                 decay_pow: torch.Tensor, E: int) -> tuple:
    """(freq, last_use, crf, weight, bias, prev, params, decay_pow, D): the policy's arguments of
    both kernels (None where the policy has no such state; lrfu_next's sizes are checked, as
    the C code indexes them by E)."""
    i64, f64 = torch.int64, torch.float64
    if policy_code == 4 and (params.numel() < 4 or any(
            n not in state or state[n].numel() != size
            for n, size in (("weight", E * E), ("bias", E), ("prev", E)))):
        raise ValueError(f"moe_cache: lrfu_next needs state weight [{E}, {E}], bias and prev "
                         f"[{E}] and params [4], got params {tuple(params.shape)} and state "
                         f"{ {k: tuple(v.shape) for k, v in state.items()} }")
    return (_ptr(state.get("freq"), i64, "freq"), _ptr(state.get("last_use"), i64, "last_use"),
            _ptr(state.get("crf"), f64, "crf"), _ptr(state.get("weight"), f64, "weight"),
            _ptr(state.get("bias"), f64, "bias"), _ptr(state.get("prev"), torch.bool, "prev"),
            _ptr(params, f64, "params"), _ptr(decay_pow, f64, "decay_pow"), decay_pow.numel())


def check_wave_outputs(who: str, num_waves: int, T: int, K: int, N: int,
                       plan: tuple[torch.Tensor, ...], slot_ids: torch.Tensor,
                       row_slots: torch.Tensor | None = None) -> None:
    """The residency step's sizes: row_slots [T] or None; each plan tensor [num_waves * N]
    elements (a wave's plan at offset i * N) and slot_ids [num_waves * T * K]; shared by both
    kernels, which index them without bounds."""
    if not isinstance(num_waves, int) or num_waves < 1:
        raise ValueError(f"{who}: num_waves={num_waves!r}; must be an int >= 1")
    if row_slots is not None and row_slots.numel() != T:
        raise ValueError(f"{who}: row_slots has {row_slots.numel()} entries for T={T} rows of "
                         "topk_ids; need one per row")
    if any(t.numel() != num_waves * N for t in plan) or slot_ids.numel() != num_waves * T * K:
        raise ValueError(f"{who}: for num_waves={num_waves}, N={N}, T={T}, K={K} the plan "
                         f"tensors need {num_waves * N} elements and slot_ids "
                         f"{num_waves * T * K}, got {[t.numel() for t in plan]} and "
                         f"{slot_ids.numel()}")


def residency_step(topk_ids: torch.Tensor, row_slots: torch.Tensor | None, wave: int,
                   slot_of_expert: torch.Tensor, expert_of_slot: torch.Tensor,
                   wave_of_expert: torch.Tensor, counters: torch.Tensor, policy_code: int,
                   state: dict[str, torch.Tensor], params: torch.Tensor, decay_pow: torch.Tensor,
                   plan_slots: torch.Tensor, plan_experts: torch.Tensor, plan_valid: torch.Tensor,
                   slot_ids: torch.Tensor, num_waves: int = 1) -> None:
    """Waves [wave, wave + num_waves) of one layer in one call (the contract in ``moe_cache.c``).
    topk_ids [T, K] int64; row_slots [T] int64 or None (rows whose slot is PAD_SLOT_ID route
    nowhere); the residency's tensors and ``state`` (the policy's, by policy.py's names: freq,
    last_use, crf; lrfu_next's weight, bias, prev) are updated in place; the plans
    [num_waves, N] and slot_ids [num_waves, T, K] are written."""
    T, K = topk_ids.shape
    E, N = slot_of_expert.shape[0], expert_of_slot.shape[0]
    check_wave_outputs("moe_cache", num_waves, T, K, N, (plan_slots, plan_experts, plan_valid),
                       slot_ids, row_slots)
    i64 = torch.int64
    rc = launch(
        "moe_residency_step", _ptr(topk_ids, i64, "topk_ids"), _ptr(row_slots, i64, "row_slots"),
        T, K, E, N, wave, _ptr(slot_of_expert, i64, "slot_of_expert"),
        _ptr(expert_of_slot, i64, "expert_of_slot"), _ptr(wave_of_expert, i64, "wave_of_expert"),
        _ptr(counters, i64, "counters"), policy_code,
        *_policy_ptrs(policy_code, state, params, decay_pow, E),
        _ptr(plan_slots, i64, "plan_slots"), _ptr(plan_experts, i64, "plan_experts"),
        _ptr(plan_valid, torch.bool, "plan_valid"), _ptr(slot_ids, i64, "slot_ids"), num_waves)
    if rc == -2:
        raise ValueError(f"moe_cache: topk_ids holds an expert id >= num_experts={E} (ids must be "
                         f"in [0, {E}) or negative to skip the pair)")
    if rc:
        raise MemoryError("moe_cache: the residency step could not allocate its scratch")


def keep_scores(policy_code: int, clock: int, state: dict[str, torch.Tensor],
                params: torch.Tensor, decay_pow: torch.Tensor) -> torch.Tensor:
    """[E] float64: the keep score the residency step ranks each expert by (for tests of its
    bits against ``EvictionPolicy.keep_score``; lrfu_next's is conditioned on ``prev``)."""
    E = next(iter(state.values())).shape[-1]
    out = torch.empty(E, dtype=torch.float64)
    if launch("moe_cache_scores", policy_code, E, clock,
              *_policy_ptrs(policy_code, state, params, decay_pow, E), out.data_ptr()):
        raise MemoryError("moe_cache: keep_scores could not allocate its scratch")
    return out


def expert_copy(src: torch.Tensor, dst: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor,
                valid: torch.Tensor) -> None:
    """dst[slots[i]] = src[experts[i]] for each i with valid[i] (``UvaCopyKernel``'s contract on
    CPU): src [E, ...] and dst [N, ...] contiguous with the same row shape and dtype."""
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype or not (
            src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"expert_copy: src {src.dtype} {tuple(src.shape)} and dst {dst.dtype} "
                         f"{tuple(dst.shape)} must be contiguous with the same row shape and dtype")
    row_bytes = src[0].numel() * src.element_size() if src.shape[0] else 0
    rc = launch("expert_copy", src.data_ptr(), dst.data_ptr(), row_bytes,
                _ptr(experts, torch.int64, "experts"), _ptr(slots, torch.int64, "slots"),
                _ptr(valid, torch.bool, "valid"), valid.numel(), src.shape[0], dst.shape[0])
    if rc:
        raise ValueError(f"expert_copy: a valid entry's expert or slot id is outside [0, "
                         f"{src.shape[0]}) / [0, {dst.shape[0]})")
