"""The expert cache's residency step as one Triton launch per wave (CUDA).

The contract and the decisions are those of ``vllm/kernels/cpu/moe_cache.c`` (read its header):
wave 0 ranks the needed experts resident-first and fixes their waves; each wave makes its
experts resident (hits keep their slots; misses, in expert-id order, take the empty slots in
slot order, then the slots of held experts outside the wave by ascending (keep score, expert
id)), updates the policy state at the pre-step clock and the counters, and writes the miss list
and the slot ids. The torch reference (``expert_cache/residency_step.py``: ``reference_step``) is
what both kernels are tested against, bit for bit.

One program (grid (1,)) does a whole wave: E and N are a few hundred at most, so the step is a
handful of vector operations over [E] and [N] plus an [N, N] comparison that ranks the victims
(its loads masked off when the wave has no miss: an all-hits step does not wait on them),
with ``debug_barrier`` between the phases that read what an earlier phase stored; lrfu_next
(policy 4) adds loops over [ROWS_E, E] tiles of its weight [E, E] (masked to the rows of the
wave or of ``prev``; ROWS_E * BLOCK_E <= WEIGHT_TILE for E <= 2048). No host read:
the wave's shapes are fixed, so the launch can be captured in a CUDA graph. Differences from
the C kernel: a valid pair with an id >= E routes nowhere (a launch cannot raise; the router
never produces one), and its only scratch is the victim ranking's [BLOCK_N] keys, allocated
per call (from the graph's pool inside a capture).

Floating point: keep scores are float64 computed in the reference's operation order; the launch
passes ``enable_fp_fusion=False`` so ``crf * p * w1 + r * w0`` is not contracted into an FMA,
and float64 division lowers to IEEE round-to-nearest ``div.rn.f64`` (as torch's); lrfu_next's
``torch.round`` is ``(x + 2**52) - 2**52`` (libdevice's rint has no interpreter version), its
sums are of integers (exact in any order). The ``gpu`` test checks those bits against the
reference on CUDA (run on an H100, 2026-11-26: passed for every policy).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Counter indices (residency.py's counters) and the padding-row slot, as constexprs: a @triton.jit
# function may read only constexpr globals.
CLOCK, HITS, MISSES, EVICTIONS, LAST_HITS, LAST_MISSES, WAVES, STEP_WAVES = (
    tl.constexpr(i) for i in range(8))
PAD_SLOT_ID = tl.constexpr(-1)
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
"""Compile options of every launch (no FMA contraction; tests/build compiles with these)."""
BLOCK_P = 256       # pairs per chunk of the loops over topk_ids
ROW_BLOCK = 32      # victim rows ranked per [ROW_BLOCK, BLOCK_N] comparison
WEIGHT_TILE = 2048  # lrfu_next: elements of one [ROWS_E, cols] tile of its weight loops
# lrfu_next's constants (policy.py _FIX_ONE, _FIX_MAX) and 2**52 (rounding to an integer).
FIX_ONE, FIX_MAX, TWO_52 = (tl.constexpr(float(2 ** k)) for k in (32, 40, 52))


@triton.jit
def _pair_ids(ids_ptr, rows_ptr, p, P, K, E, HAS_ROWS: tl.constexpr):
    """(ids, valid) of pairs p: valid pairs have 0 <= id < E and a row that is not padding."""
    inb = p < P
    ids = tl.load(ids_ptr + p, mask=inb, other=-1)
    valid = inb & (ids >= 0) & (ids < E)
    if HAS_ROWS:
        row = tl.load(rows_ptr + p // K, mask=inb, other=PAD_SLOT_ID)
        valid = valid & (row != PAD_SLOT_ID)
    return ids, valid


@triton.jit
def _assign_waves(ids_ptr, rows_ptr, P, K, E, N, soe_ptr, woe_ptr, cnt_ptr,
                  HAS_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    """Wave 0: wave_of_expert[e] = rank / N for needed e (resident first, then by id), else -1."""
    e = tl.arange(0, BLOCK_E)
    in_e = e < E
    tl.store(woe_ptr + e, tl.full([BLOCK_E], -1, tl.int64), mask=in_e)
    tl.debug_barrier()
    for start in range(0, P, BLOCK_P):
        ids, valid = _pair_ids(ids_ptr, rows_ptr, start + tl.arange(0, BLOCK_P), P, K, E, HAS_ROWS)
        tl.store(woe_ptr + ids, tl.zeros([BLOCK_P], tl.int64), mask=valid)
    tl.debug_barrier()
    needed = in_e & (tl.load(woe_ptr + e, mask=in_e, other=-1) == 0)
    resident = tl.load(soe_ptr + e, mask=in_e, other=-1) >= 0
    need_res = (needed & resident).to(tl.int32)
    need_miss = (needed & ~resident).to(tl.int32)
    n_res = tl.sum(need_res, axis=0)
    rank = tl.where(resident, tl.cumsum(need_res, axis=0) - 1,
                    n_res + tl.cumsum(need_miss, axis=0) - 1).to(tl.int64)
    n_needed = tl.sum(needed.to(tl.int64), axis=0)
    # Every thread has read woe before any overwrites it: for BLOCK_E <= 32 the [BLOCK_E]
    # values are replicated over the warps and only warp 0 stores, so without this a later
    # warp could read the new ranks as "needed" flags (harmless only while its copies stay
    # masked; the barrier makes it not depend on that).
    tl.debug_barrier()
    tl.store(woe_ptr + e, tl.where(needed, rank // N, -1), mask=in_e)
    tl.store(cnt_ptr + STEP_WAVES, (n_needed + N - 1) // N)
    tl.debug_barrier()


@triton.jit
def _keep_score(x, clock, freq_ptr, last_ptr, crf_ptr, par_ptr, pow_ptr, D, mask,
                POLICY: tl.constexpr):
    """float64 keep scores of experts x (as policy.py's keep_score, same operation order)."""
    if POLICY == 0:
        score = tl.load(last_ptr + x, mask=mask, other=0).to(tl.float64)
    elif POLICY == 1:
        score = tl.load(freq_ptr + x, mask=mask, other=0).to(tl.float64)
    elif POLICY == 2:
        freq = tl.load(freq_ptr + x, mask=mask, other=0).to(tl.float64)
        age = clock - tl.load(last_ptr + x, mask=mask, other=0) + 1
        score = freq / age.to(tl.float64)
    else:
        dt = clock - tl.load(last_ptr + x, mask=mask, other=0)
        p = tl.load(pow_ptr + tl.minimum(dt, D - 1), mask=mask, other=0.0)
        rate = tl.load(crf_ptr + x, mask=mask, other=0.0) * p * tl.load(par_ptr + 1)
        score = rate + (1.0 / (dt.to(tl.float64) + 1.0)) * tl.load(par_ptr + 0)
    return score


@triton.jit
def _predict(cols, mask, sel_ptr, sel, E, wt_ptr, b_ptr, ROWS_E: tl.constexpr):
    """lrfu_next's p[cols] (float64, same shape) given the rows i < E with sel_ptr[i] == sel
    (the wave: wave_of_expert == w; or prev == 1): (bias + sum of weight[i, cols]) / 2**32.
    The terms are integers and the sum stays below 2**53 (policy.py _FIX_MAX), so summing by
    [ROWS_E, cols] tiles gives torch's bits."""
    acc = tl.zeros_like(cols).to(tl.float64)
    for r0 in range(0, E, ROWS_E):
        i = r0 + tl.arange(0, ROWS_E)
        rows = (i < E) & (tl.load(sel_ptr + i, mask=i < E, other=0) == sel)
        tile = tl.load(wt_ptr + i[:, None] * E + cols[None, :],
                       mask=rows[:, None] & mask[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
    return (tl.load(b_ptr + cols, mask=mask, other=0.0) + acc) / FIX_ONE


@triton.jit
def _victim_keys(s, inb, w, E, eos_ptr, woe_ptr, clock, freq_ptr, last_ptr, crf_ptr, wt_ptr,
                 b_ptr, par_ptr, pow_ptr, D, POLICY: tl.constexpr, ROWS_E: tl.constexpr):
    """(victim, score, expert) of slots s where ``inb``: victims hold an expert that is not in
    wave w."""
    held = tl.load(eos_ptr + s, mask=inb, other=-1)
    victim = inb & (held >= 0)
    victim = victim & (tl.load(woe_ptr + held, mask=victim, other=-1) != w)
    score = _keep_score(held, clock, freq_ptr, last_ptr, crf_ptr, par_ptr, pow_ptr, D, victim,
                        POLICY)
    if POLICY == 4:     # lrfu_next: lrfu's score + p(held | the wave) * next_weight
        p = _predict(held, victim, woe_ptr, w, E, wt_ptr, b_ptr, ROWS_E)
        score = score + p * tl.load(par_ptr + 2)
    return victim, score, held


@triton.jit
def _plan_slots(w, N, M, E, eos_ptr, woe_ptr, clock, freq_ptr, last_ptr, crf_ptr, wt_ptr, b_ptr,
                par_ptr, pow_ptr, D, ps_ptr, ks_ptr, kx_ptr, POLICY: tl.constexpr,
                BLOCK_N: tl.constexpr, ROW_BLOCK: tl.constexpr, ROWS_E: tl.constexpr):
    """plan_slots[:M]: the empty slots in slot order, then victims by (score, expert id). The
    keys are computed once (lrfu_next's cost a pass over its [E, E] weight) and each row block
    of the ranking reads them back from the scratch ks [BLOCK_N] (score) and kx [BLOCK_N] (the
    victim's expert, -1 for a slot that is no victim): the same bits. A wave without a miss
    (M == 0) masks every slot's loads off (``s < N`` only where M > 0): no slot is empty or a
    victim for it, so the loads chained behind them (the held expert's wave, its policy state,
    lrfu_next's weight rows) never go to memory. Masks, not a branch: under Triton 3.6 an
    ``if M > 0`` around this made the lrfu and lrfu_next variants spill."""
    s = tl.arange(0, BLOCK_N)
    slot = tl.where(M > 0, s < N, False)     # not `& (M > 0)`: the interpreter makes int32
    empty = slot & (tl.load(eos_ptr + s, mask=slot, other=0) < 0)
    empty_rank = tl.cumsum(empty.to(tl.int32), axis=0).to(tl.int64) - 1
    n_empty = tl.sum(empty.to(tl.int64), axis=0)
    tl.store(ps_ptr + empty_rank, s.to(tl.int64), mask=empty & (empty_rank < M))
    tl.store(ps_ptr + s, tl.full([BLOCK_N], -1, tl.int64), mask=(s >= M) & (s < N))
    n_evict = M - tl.minimum(n_empty, M)
    cv, cscore, cexp = _victim_keys(s, slot, w, E, eos_ptr, woe_ptr, clock, freq_ptr,
                                    last_ptr, crf_ptr, wt_ptr, b_ptr, par_ptr, pow_ptr, D,
                                    POLICY, ROWS_E)
    tl.store(ks_ptr + s, cscore)
    tl.store(kx_ptr + s, tl.where(cv, cexp, -1))
    tl.debug_barrier()
    for r0 in tl.static_range(0, BLOCK_N, ROW_BLOCK):
        r = r0 + tl.arange(0, ROW_BLOCK)
        rexp = tl.load(kx_ptr + r)
        rv = rexp >= 0
        rscore = tl.load(ks_ptr + r)
        before = (cscore[None, :] < rscore[:, None]) | (
            (cscore[None, :] == rscore[:, None]) & (cexp[None, :] < rexp[:, None]))
        vrank = tl.sum((before & cv[None, :]).to(tl.int64), axis=1)       # [ROW_BLOCK]
        tl.store(ps_ptr + n_empty + vrank, r.to(tl.int64), mask=rv & (vrank < n_evict))


@triton.jit
def _update_policy(e, in_wave, clock, freq_ptr, last_ptr, crf_ptr, pow_ptr, D,
                   POLICY: tl.constexpr):
    """The policy's on_access for the wave's experts, at the pre-step clock."""
    if POLICY == 1 or POLICY == 2:
        freq = tl.load(freq_ptr + e, mask=in_wave, other=0)
        tl.store(freq_ptr + e, freq + 1, mask=in_wave)
    if POLICY == 3 or POLICY == 4:
        dt = clock - tl.load(last_ptr + e, mask=in_wave, other=0)
        p = tl.load(pow_ptr + tl.minimum(dt, D - 1), mask=in_wave, other=0.0)
        decayed = tl.load(crf_ptr + e, mask=in_wave, other=0.0) * p
        tl.store(crf_ptr + e, decayed + 1.0, mask=in_wave)
    if POLICY != 1:
        tl.store(last_ptr + e, tl.zeros_like(e).to(tl.int64) + clock, mask=in_wave)


@triton.jit
def _round_half_even(x):
    """torch.round of float64 x with |x| < 2**52 (lrfu_next's |x| < 2**41): adding 2**52 leaves
    no fraction bits, so IEEE addition rounds to an integer, half to even; a zero keeps the sign
    of x, as torch's does."""
    r = tl.where(x >= 0, (x + TWO_52) - TWO_52, (x - TWO_52) + TWO_52)
    return tl.where(r == 0.0, x * 0.0, r)


@triton.jit
def _clamp_fix(x):
    return tl.minimum(tl.maximum(x, -FIX_MAX), FIX_MAX)


@triton.jit
def _learn_next(e, in_wave, any_used, E, wt_ptr, b_ptr, prev_ptr, par_ptr, ROWS_E: tl.constexpr):
    """lrfu_next's learning step (policy.py on_access) when the wave in_wave [BLOCK_E] is not
    empty: delta = round(((in_wave - p(. | prev)) * lr) / (|prev| + 1) * 2**32); bias and the
    rows of prev += delta, clamped to +-2**40; prev = in_wave."""
    in_e = e < E
    p = _predict(e, in_e, prev_ptr, 1, E, wt_ptr, b_ptr, ROWS_E)
    n_prev = tl.sum((tl.load(prev_ptr + e, mask=in_e, other=0) != 0).to(tl.int64), axis=0)
    err = in_wave.to(tl.float64) - p
    delta = _round_half_even(err * tl.load(par_ptr + 3) / (n_prev.to(tl.float64) + 1.0) * FIX_ONE)
    bias = tl.load(b_ptr + e, mask=in_e, other=0.0)
    tl.debug_barrier()              # every read of weight and prev above precedes the writes
    learn = tl.where(any_used, in_e, False)   # not `& any_used`: the interpreter makes that int32
    tl.store(b_ptr + e, _clamp_fix(bias + delta), mask=learn)
    for r0 in range(0, E, ROWS_E):
        i = r0 + tl.arange(0, ROWS_E)
        rows = tl.where(any_used, (i < E) & (tl.load(prev_ptr + i, mask=i < E, other=0) != 0),
                        False)
        ptrs = wt_ptr + i[:, None] * E + e[None, :]                      # [ROWS_E, BLOCK_E]
        m = rows[:, None] & in_e[None, :]
        tl.store(ptrs, _clamp_fix(tl.load(ptrs, mask=m, other=0.0) + delta[None, :]), mask=m)
    tl.debug_barrier()              # the loop above read prev
    tl.store(prev_ptr + e, in_wave.to(tl.uint8), mask=learn)


@triton.jit
def _bump(cnt_ptr, idx, value, any_used):
    old = tl.load(cnt_ptr + idx)
    tl.store(cnt_ptr + idx, tl.where(any_used, old + value, old))


@triton.jit
def _residency_step_kernel(
        ids_ptr, rows_ptr, P, K, E, N, w, soe_ptr, eos_ptr, woe_ptr, cnt_ptr,
        freq_ptr, last_ptr, crf_ptr, wt_ptr, b_ptr, prev_ptr, par_ptr, pow_ptr, D, ps_ptr, pe_ptr,
        pv_ptr, sid_ptr, ks_ptr, kx_ptr, POLICY: tl.constexpr, HAS_ROWS: tl.constexpr,
        FIRST_WAVE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_P: tl.constexpr, ROW_BLOCK: tl.constexpr, ROWS_E: tl.constexpr):
    if FIRST_WAVE:
        _assign_waves(ids_ptr, rows_ptr, P, K, E, N, soe_ptr, woe_ptr, cnt_ptr, HAS_ROWS,
                      BLOCK_E, BLOCK_P)
    e = tl.arange(0, BLOCK_E)
    in_wave = (e < E) & (tl.load(woe_ptr + e, mask=e < E, other=-1) == w)
    miss = in_wave & (tl.load(soe_ptr + e, mask=e < E, other=0) < 0)
    hits = tl.sum((in_wave & ~miss).to(tl.int64), axis=0)
    M = tl.sum(miss.to(tl.int64), axis=0)
    clock = tl.load(cnt_ptr + CLOCK)
    miss_rank = tl.cumsum(miss.to(tl.int32), axis=0).to(tl.int64) - 1
    tl.store(pe_ptr + miss_rank, e.to(tl.int64), mask=miss)                # misses by id
    i = tl.arange(0, BLOCK_N)
    tl.store(pe_ptr + i, tl.full([BLOCK_N], -1, tl.int64), mask=(i >= M) & (i < N))
    tl.store(pv_ptr + i, (i < M).to(tl.uint8), mask=i < N)
    _plan_slots(w, N, M, E, eos_ptr, woe_ptr, clock, freq_ptr, last_ptr, crf_ptr, wt_ptr, b_ptr,
                par_ptr, pow_ptr, D, ps_ptr, ks_ptr, kx_ptr, POLICY, BLOCK_N, ROW_BLOCK, ROWS_E)
    tl.debug_barrier()
    live = i < M
    ps = tl.load(ps_ptr + i, mask=live, other=0)
    pe = tl.load(pe_ptr + i, mask=live, other=0)
    old = tl.load(eos_ptr + ps, mask=live, other=-1)
    evicted = live & (old >= 0)
    tl.store(soe_ptr + old, tl.full([BLOCK_N], -1, tl.int64), mask=evicted)
    tl.debug_barrier()
    tl.store(eos_ptr + ps, pe, mask=live)
    tl.store(soe_ptr + pe, ps, mask=live)
    _update_policy(e, in_wave, clock, freq_ptr, last_ptr, crf_ptr, pow_ptr, D, POLICY)
    any_used = hits + M > 0
    if POLICY == 4:
        _learn_next(e, in_wave, any_used, E, wt_ptr, b_ptr, prev_ptr, par_ptr, ROWS_E)
    _bump(cnt_ptr, HITS, hits, any_used)
    _bump(cnt_ptr, MISSES, M, any_used)
    _bump(cnt_ptr, EVICTIONS, tl.sum(evicted.to(tl.int64), axis=0), any_used)
    _bump(cnt_ptr, WAVES, 1, any_used)
    _bump(cnt_ptr, CLOCK, 1, any_used)
    tl.store(cnt_ptr + LAST_HITS, tl.where(any_used, hits, tl.load(cnt_ptr + LAST_HITS)))
    tl.store(cnt_ptr + LAST_MISSES, tl.where(any_used, M, tl.load(cnt_ptr + LAST_MISSES)))
    tl.debug_barrier()
    for start in range(0, P, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        ids, valid = _pair_ids(ids_ptr, rows_ptr, p, P, K, E, HAS_ROWS)
        valid = valid & (tl.load(woe_ptr + ids, mask=valid, other=-1) == w)
        slot = tl.load(soe_ptr + ids, mask=valid, other=-1)
        tl.store(sid_ptr + p, tl.where(valid, slot, -1), mask=p < P)


def _check(t: torch.Tensor, dtype: torch.dtype, what: str, device: torch.device) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.device != device:
        raise ValueError(f"triton residency_step: {what} must be a contiguous {dtype} tensor on "
                         f"{device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def residency_step(topk_ids: torch.Tensor, row_slots: torch.Tensor | None, wave: int,
                   slot_of_expert: torch.Tensor, expert_of_slot: torch.Tensor,
                   wave_of_expert: torch.Tensor, counters: torch.Tensor, policy_code: int,
                   state: dict[str, torch.Tensor], params: torch.Tensor, decay_pow: torch.Tensor,
                   plan_slots: torch.Tensor, plan_experts: torch.Tensor, plan_valid: torch.Tensor,
                   slot_ids: torch.Tensor) -> None:
    """One wave of one layer, one launch: the signature of ``moe_cache.residency_step``. All
    tensors on the device of topk_ids [T, K] int64; state updated in place; plan [N] and
    slot_ids [T, K] written."""
    dev = topk_ids.device
    i64, f64 = torch.int64, torch.float64
    for t, dt, what in ((topk_ids, i64, "topk_ids"), (slot_of_expert, i64, "slot_of_expert"),
                        (expert_of_slot, i64, "expert_of_slot"), (counters, i64, "counters"),
                        (wave_of_expert, i64, "wave_of_expert"), (params, f64, "params"),
                        (decay_pow, f64, "decay_pow"), (plan_slots, i64, "plan_slots"),
                        (plan_experts, i64, "plan_experts"), (plan_valid, torch.bool, "plan_valid"),
                        (slot_ids, i64, "slot_ids")):
        _check(t, dt, what, dev)
    if policy_code not in (0, 1, 2, 3, 4):
        raise ValueError(f"triton residency_step: policy_code={policy_code}; allowed 0-4")
    if row_slots is not None:
        _check(row_slots, i64, "row_slots", dev)
    for name, t in state.items():
        _check(t, {"crf": f64, "weight": f64, "bias": f64, "prev": torch.bool}.get(name, i64),
               name, dev)
    T, K = topk_ids.shape
    E, N = slot_of_expert.shape[0], expert_of_slot.shape[0]
    if policy_code == 4:
        _check_lrfu_next(state, params, E)
    # Absent state tensors are never read by that policy's branches; any pointer will do.
    freq, last_use = state.get("freq", counters), state.get("last_use", counters)
    crf, weight, bias = (state.get(n, params) for n in ("crf", "weight", "bias"))
    prev = state.get("prev", plan_valid).view(torch.uint8)
    block_e, block_n = triton.next_power_of_2(E), triton.next_power_of_2(N)
    # The victim ranking's key scratch (_plan_slots): from the caching allocator, or the graph's
    # pool inside a capture; no host work.
    key_score = torch.empty(block_n, dtype=f64, device=dev)
    key_expert = torch.empty(block_n, dtype=i64, device=dev)
    _residency_step_kernel[(1,)](
        topk_ids, row_slots if row_slots is not None else topk_ids, T * K, K, E, N, wave,
        slot_of_expert, expert_of_slot, wave_of_expert, counters, freq, last_use, crf, weight,
        bias, prev, params, decay_pow, decay_pow.numel(), plan_slots, plan_experts,
        plan_valid.view(torch.uint8), slot_ids, key_score, key_expert, POLICY=policy_code,
        HAS_ROWS=row_slots is not None, FIRST_WAVE=wave == 0, BLOCK_E=block_e, BLOCK_N=block_n,
        BLOCK_P=BLOCK_P, ROW_BLOCK=min(ROW_BLOCK, block_n), ROWS_E=rows_e(block_e),
        **LAUNCH_OPTIONS)


def rows_e(block_e: int) -> int:
    """lrfu_next's weight rows per tile: [ROWS_E, BLOCK_E] stays within WEIGHT_TILE elements."""
    return max(1, min(block_e, WEIGHT_TILE // block_e))


def _check_lrfu_next(state: dict[str, torch.Tensor], params: torch.Tensor, E: int) -> None:
    """The kernel indexes lrfu_next's state by E: weight [E, E], bias and prev [E], params [4]."""
    sizes = {"weight": E * E, "bias": E, "prev": E}
    if params.numel() < 4 or any(n not in state or state[n].numel() != k
                                 for n, k in sizes.items()):
        raise ValueError(f"triton residency_step: lrfu_next needs state weight [{E}, {E}], bias "
                         f"and prev [{E}] and params [4], got params {tuple(params.shape)} and "
                         f"state { {k: tuple(v.shape) for k, v in state.items()} }")
