"""The expert cache's residency step as one Triton launch per layer and step (CUDA): all of the
step's waves, planned one after the other by one program.

The contract and the decisions are those of ``vllm/kernels/cpu/moe_cache.c`` (read its header):
wave 0 ranks the needed experts resident-first and fixes their waves; each wave makes its
experts resident (hits keep their slots; misses, in expert-id order, take the empty slots in
slot order, then the slots of held experts outside the wave by ascending (keep score, expert
id)), updates the policy state at the pre-step clock and the counters, and writes the miss list
and the slot ids. The torch reference (``expert_cache/residency_step.py``: ``reference_step``) is
what both kernels are tested against, bit for bit.

One program (grid (1,)) does the waves: E and N are a few hundred at most, so a wave is a
handful of vector operations over [E] and [N] plus an [N, N] comparison that ranks the victims
(its loads masked off when the wave has no miss: an all-hits step does not wait on them),
with ``debug_barrier`` between the phases that read what an earlier phase stored; lrfu_next
(policy 4) adds loops over [ROWS_E, E] tiles of its weight [E, E] (masked to the rows of the
wave or of ``prev``; ROWS_E * BLOCK_E <= WEIGHT_TILE for E <= 2048). A launch of one wave
(``ONE_WAVE``: a decode step whose T*K fits the slots) is that body alone; a launch of W waves
runs wave 0's assignment, then a loop of W bodies with a ``debug_barrier`` between them (later
waves read the residency the earlier ones left; their copies run after the earlier waves'
kernels, so planning them first is safe). No host read: the step's shapes are fixed, so the
launch can be captured in a CUDA graph.

Latency: a program this small is a chain of dependent memory round trips (each an L2 latency
or more), and a cached layer runs one on every decode step, so the all-hits path
keeps that chain short. State that nothing in the launch writes before reading it (the
residency before placement, the policy state with its decay factor, lrfu_next's bias and
prev, the counters) is loaded before the phases that need it; wave 0 hands its waves over in
registers; a load waits only on what its address needs (a pair's slot and its wave both on
the pair's id; lrfu_next's weight tiles, for E <= SMALL_E, on nothing: loaded unrolled, with
the rows' selection applied in registers). lrfu_next runs on 8 warps (its float64 tiles; on 4,
63 slots took 255 registers and spilled under Triton 3.6), the others on 4, or 8 for several
waves (``num_warps``), all compiled with ``maxnreg`` 255: ptxas otherwise capped some
variants at 64 or 128 registers and spilled (Triton 3.6, SM120).

Timed on an H100 (2026-11-27, probe shape, lrfu_next, batch 1, all hits at N = 63): 15.7 us a
layer, the cache's whole all-hits cost at batch 1 but the 1.8 us copy; at N = 16, 12.0 us.
Since then a one-wave launch can run in two parts (``PARTS``, ``part=``): "route" (the wave's
assignment, miss list, victim ranking, placement and slot ids; an all-hits step branches past
the ranking) and "account" (the policy state, lrfu_next's learning and the counters, from the
route's wave_of_expert, plan_valid and eviction count), which ``KernelStep`` forks onto a side
stream beside the wave's copy and expert kernels. A launch of several waves (a batch whose
T*K exceeds the slots) splits too when the step's experts fit one wave, as an all-hits decode
step at batch 32 and 63 of 64 slots: the route plans every wave (the later ones empty) and
leaves a flag for the account, which then accounts every wave; when they do not fit, the
route runs each wave whole and the account nothing (a later wave's route ranks victims by the
state the earlier wave's account leaves). The same state after both as after "all" (the
interpreter tests). Not yet timed on a GPU. Differences from
the C kernel: a valid pair with an id >= E routes nowhere (a launch cannot raise; the router
never produces one), and its only scratch is the victim ranking's [BLOCK_N] keys, allocated
per call (from the graph's pool inside a capture).

Floating point: keep scores are float64 computed in the reference's operation order; the launch
passes ``enable_fp_fusion=False`` so ``crf * p * w1 + r * w0`` is not contracted into an FMA,
and float64 division lowers to IEEE round-to-nearest ``div.rn.f64`` (as torch's); lrfu_next's
predictor and learning step (``lrfu_next.py``) round as ``torch.round`` does with
``(x + 2**52) - 2**52`` (libdevice's rint has no interpreter version), and its sums are of
integers (exact in any order). The ``gpu`` test checks those bits against the reference on
CUDA (passed for every policy on an H100, 2026-11-26 and, with the launch of several waves,
2026-11-27).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.cpu.moe_cache import check_wave_outputs
from vllm.kernels.triton.lrfu_next import _learn_next
from vllm.kernels.triton.residency_policy import _load_policy, _plan_slots, _update_policy

# Counter indices (residency.py's counters) and the padding-row slot, as constexprs: a @triton.jit
# function may read only constexpr globals.
CLOCK, HITS, MISSES, EVICTIONS, LAST_HITS, LAST_MISSES, WAVES, STEP_WAVES = (
    tl.constexpr(i) for i in range(8))
PAD_SLOT_ID = tl.constexpr(-1)
ALL, ROUTE, ACCOUNT = (tl.constexpr(i) for i in range(3))
PARTS = {"all": 0, "route": 1, "account": 2}
"""A one-wave launch's parts (``residency_step(part=)``): the whole wave; its plan, maps and
slot ids (what the copy and the expert kernels wait for); the policy state and counters it
leaves (nothing of this step reads them: a side stream runs them beside the experts)."""
LAUNCH_OPTIONS = {"enable_fp_fusion": False, "maxnreg": 255}
"""Compile options of every launch (no FMA contraction; tests/build compiles with these)."""
BLOCK_P = 256       # pairs per chunk of the loops over topk_ids
ROW_BLOCK = 32      # victim rows ranked per [ROW_BLOCK, BLOCK_N] comparison
WEIGHT_TILE = 2048  # lrfu_next: elements of one [ROWS_E, cols] tile of its weight loops
SMALL_E = 64        # up to this many experts, lrfu_next's weight tiles load unrolled


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
def _assign_waves(ids_ptr, rows_ptr, P, K, E, N, soe, woe_ptr, cnt_ptr,
                  HAS_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    """Wave 0: wave_of_expert[e] = rank / N for needed e (resident first, then by id), else -1;
    returns those values [BLOCK_E]. ``soe``: slot_of_expert [BLOCK_E] (-1 past E)."""
    e = tl.arange(0, BLOCK_E)
    in_e = e < E
    # The first chunk's ids are loaded before the first store: their latency overlaps it.
    ids, valid = _pair_ids(ids_ptr, rows_ptr, tl.arange(0, BLOCK_P), P, K, E, HAS_ROWS)
    tl.store(woe_ptr + e, tl.full([BLOCK_E], -1, tl.int64), mask=in_e)
    tl.debug_barrier()
    tl.store(woe_ptr + ids, tl.zeros([BLOCK_P], tl.int64), mask=valid)
    for start in range(BLOCK_P, P, BLOCK_P):
        ids, valid = _pair_ids(ids_ptr, rows_ptr, start + tl.arange(0, BLOCK_P), P, K, E, HAS_ROWS)
        tl.store(woe_ptr + ids, tl.zeros([BLOCK_P], tl.int64), mask=valid)
    tl.debug_barrier()
    needed = in_e & (tl.load(woe_ptr + e, mask=in_e, other=-1) == 0)
    resident = soe >= 0
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
    woe = tl.where(needed, rank // N, -1)
    tl.store(woe_ptr + e, woe, mask=in_e)
    tl.store(cnt_ptr + STEP_WAVES, (n_needed + N - 1) // N)
    tl.debug_barrier()
    return woe


@triton.jit
def _bump(cnt_ptr, idx, old, value, any_used):
    tl.store(cnt_ptr + idx, tl.where(any_used, old + value, old))


@triton.jit
def _wave_step(
        ids_ptr, rows_ptr, P, K, E, N, w, soe_ptr, eos_ptr, woe_ptr, cnt_ptr,
        freq_ptr, last_ptr, crf_ptr, wt_ptr, b_ptr, prev_ptr, par_ptr, pow_ptr, D, ps_ptr, pe_ptr,
        pv_ptr, sid_ptr, ks_ptr, kx_ptr, ev_ptr, POLICY: tl.constexpr, HAS_ROWS: tl.constexpr,
        FIRST_WAVE: tl.constexpr, SMALL_E: tl.constexpr, BLOCK_E: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, ROW_BLOCK: tl.constexpr,
        ROWS_E: tl.constexpr, PART: tl.constexpr):
    """Wave w, from the state the waves before it left: its plan (ps, pe, pv [N]) and slot ids
    (sid [P]) written, the state updated. PART (``PARTS``): all of it; ROUTE, the plan, the
    maps and the slot ids, leaving the wave's eviction count at ev_ptr; ACCOUNT, the policy
    state and the counters from what ROUTE left (the wave's experts in woe, its misses in pv,
    its evictions at ev_ptr), so the same state as ALL's."""
    e = tl.arange(0, BLOCK_E)
    in_e = e < E
    # What nothing in this launch writes before reading it is loaded early, so each load's
    # latency overlaps the phases before its use instead of adding a round trip: here the
    # residency before placement, the policy state, lrfu_next's bias and prev; the counters
    # once the ranking is done (they wait in registers through the placement and learning).
    if PART != ACCOUNT:
        soe = tl.load(soe_ptr + e, mask=in_e, other=-1)
    clock = tl.load(cnt_ptr + CLOCK)
    if PART != ROUTE:
        freq, decayed = _load_policy(e, in_e, clock, freq_ptr, last_ptr, crf_ptr, pow_ptr, D,
                                     POLICY)
        bias = tl.zeros_like(e).to(tl.float64)
        prev = tl.zeros_like(e).to(tl.uint8)
        if POLICY == 4:
            bias = tl.load(b_ptr + e, mask=in_e, other=0.0)
            prev = tl.load(prev_ptr + e, mask=in_e, other=0)
    if PART == ACCOUNT:
        woe = tl.load(woe_ptr + e, mask=in_e, other=-1)
    elif FIRST_WAVE:
        woe = _assign_waves(ids_ptr, rows_ptr, P, K, E, N, soe, woe_ptr, cnt_ptr, HAS_ROWS,
                            BLOCK_E, BLOCK_P)
    else:
        woe = tl.load(woe_ptr + e, mask=in_e, other=-1)
    in_wave = in_e & (woe == w)
    i = tl.arange(0, BLOCK_N)
    if PART == ACCOUNT:
        M = tl.sum(tl.load(pv_ptr + i, mask=i < N, other=0).to(tl.int64), axis=0)
        hits = tl.sum(in_wave.to(tl.int64), axis=0) - M
        n_evicted = tl.load(ev_ptr)
    else:
        miss = in_wave & (soe < 0)
        hits = tl.sum((in_wave & ~miss).to(tl.int64), axis=0)
        M = tl.sum(miss.to(tl.int64), axis=0)
        miss_rank = tl.cumsum(miss.to(tl.int32), axis=0).to(tl.int64) - 1
        tl.store(pe_ptr + miss_rank, e.to(tl.int64), mask=miss)                # misses by id
        tl.store(pe_ptr + i, tl.full([BLOCK_N], -1, tl.int64), mask=(i >= M) & (i < N))
        tl.store(pv_ptr + i, (i < M).to(tl.uint8), mask=i < N)
        if PART == ROUTE:
            # A branch, not only masks (ALL's way): without the learning beside it the route
            # compiles it without a spill (maxnreg 255), and an all-hits step then skips the
            # victim ranking's [N, N] work, not only its loads. The plan's padding, which
            # _plan_slots also writes, is written either way.
            tl.store(ps_ptr + i, tl.full([BLOCK_N], -1, tl.int64), mask=(i >= M) & (i < N))
            if M > 0:
                _plan_slots(w, N, M, E, eos_ptr, woe_ptr, clock, freq_ptr, last_ptr, crf_ptr,
                            wt_ptr, b_ptr, par_ptr, pow_ptr, D, ps_ptr, ks_ptr, kx_ptr, POLICY,
                            SMALL_E, BLOCK_E, BLOCK_N, ROW_BLOCK, ROWS_E)
        else:
            _plan_slots(w, N, M, E, eos_ptr, woe_ptr, clock, freq_ptr, last_ptr, crf_ptr, wt_ptr,
                        b_ptr, par_ptr, pow_ptr, D, ps_ptr, ks_ptr, kx_ptr, POLICY, SMALL_E,
                        BLOCK_E, BLOCK_N, ROW_BLOCK, ROWS_E)
        tl.debug_barrier()
    if PART != ROUTE:
        old_hits, old_misses = tl.load(cnt_ptr + HITS), tl.load(cnt_ptr + MISSES)
        old_evictions, old_waves = tl.load(cnt_ptr + EVICTIONS), tl.load(cnt_ptr + WAVES)
        old_last_hits = tl.load(cnt_ptr + LAST_HITS)
        old_last_misses = tl.load(cnt_ptr + LAST_MISSES)
    if PART != ACCOUNT:
        live = i < M
        ps = tl.load(ps_ptr + i, mask=live, other=0)
        pe = tl.load(pe_ptr + i, mask=live, other=0)
        old = tl.load(eos_ptr + ps, mask=live, other=-1)
        evicted = live & (old >= 0)
        tl.store(soe_ptr + old, tl.full([BLOCK_N], -1, tl.int64), mask=evicted)
        tl.debug_barrier()
        tl.store(eos_ptr + ps, pe, mask=live)
        tl.store(soe_ptr + pe, ps, mask=live)
        n_evicted = tl.sum(evicted.to(tl.int64), axis=0)
        if PART == ROUTE:
            tl.store(ev_ptr, n_evicted)
    if PART != ROUTE:
        _update_policy(e, in_wave, clock, freq, decayed, freq_ptr, last_ptr, crf_ptr, POLICY)
        any_used = hits + M > 0
        if POLICY == 4:
            _learn_next(e, in_wave, any_used, E, wt_ptr, b_ptr, prev_ptr, par_ptr, bias, prev,
                        SMALL_E, BLOCK_E, ROWS_E)
        _bump(cnt_ptr, HITS, old_hits, hits, any_used)
        _bump(cnt_ptr, MISSES, old_misses, M, any_used)
        _bump(cnt_ptr, EVICTIONS, old_evictions, n_evicted, any_used)
        _bump(cnt_ptr, WAVES, old_waves, 1, any_used)
        _bump(cnt_ptr, CLOCK, clock, 1, any_used)
        tl.store(cnt_ptr + LAST_HITS, tl.where(any_used, hits, old_last_hits))
        tl.store(cnt_ptr + LAST_MISSES, tl.where(any_used, M, old_last_misses))
    if PART != ACCOUNT:
        tl.debug_barrier()
        for start in range(0, P, BLOCK_P):
            p = start + tl.arange(0, BLOCK_P)
            ids, valid = _pair_ids(ids_ptr, rows_ptr, p, P, K, E, HAS_ROWS)
            # Both reads wait on the ids only (the slot is dropped where the wave differs).
            wave = tl.load(woe_ptr + ids, mask=valid, other=-1)
            slot = tl.load(soe_ptr + ids, mask=valid, other=-1)
            tl.store(sid_ptr + p, tl.where(valid & (wave == w), slot, -1), mask=p < P)


@triton.jit
def _residency_step_kernel(
        ids_ptr, rows_ptr, P, K, E, N, w0, num_waves, soe_ptr, eos_ptr, woe_ptr, cnt_ptr,
        freq_ptr, last_ptr, crf_ptr, wt_ptr, b_ptr, prev_ptr, par_ptr, pow_ptr, D, ps_ptr, pe_ptr,
        pv_ptr, sid_ptr, ks_ptr, kx_ptr, ev_ptr, POLICY: tl.constexpr, HAS_ROWS: tl.constexpr,
        FIRST_WAVE: tl.constexpr, ONE_WAVE: tl.constexpr, SMALL_E: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
        ROW_BLOCK: tl.constexpr, ROWS_E: tl.constexpr, PART: tl.constexpr):
    """Waves [w0, w0 + num_waves), one after the other; wave i's plan at i * N, slot ids at
    i * P. ONE_WAVE (num_waves == 1: a step with min(E, T*K) <= N, as every batch-1 decode
    step) is the wave's body alone (or its PART), wave 0 handing its waves over in registers:
    the code of a launch per wave. Otherwise wave 0's assignment runs first, then a loop runs
    the body once per wave (PART ROUTE: the routes alone when the step's experts fit one wave,
    ev_ptr[num_waves] telling the ACCOUNT launch so, else whole waves)."""
    if ONE_WAVE:
        _wave_step(ids_ptr, rows_ptr, P, K, E, N, w0, soe_ptr, eos_ptr, woe_ptr, cnt_ptr,
                   freq_ptr, last_ptr, crf_ptr, wt_ptr, b_ptr, prev_ptr, par_ptr, pow_ptr, D,
                   ps_ptr, pe_ptr, pv_ptr, sid_ptr, ks_ptr, kx_ptr, ev_ptr, POLICY, HAS_ROWS,
                   FIRST_WAVE, SMALL_E, BLOCK_E, BLOCK_N, BLOCK_P, ROW_BLOCK, ROWS_E, PART)
    elif PART == ACCOUNT:
        # The route left every wave's account to this launch (ev[num_waves] == 1) only when
        # the waves after the first are empty; otherwise it ran them all whole.
        if tl.load(ev_ptr + num_waves) != 0:
            _waves(ids_ptr, rows_ptr, P, K, E, N, w0, num_waves, soe_ptr, eos_ptr, woe_ptr,
                   cnt_ptr, freq_ptr, last_ptr, crf_ptr, wt_ptr, b_ptr, prev_ptr, par_ptr,
                   pow_ptr, D, ps_ptr, pe_ptr, pv_ptr, sid_ptr, ks_ptr, kx_ptr, ev_ptr, POLICY,
                   HAS_ROWS, SMALL_E, BLOCK_E, BLOCK_N, BLOCK_P, ROW_BLOCK, ROWS_E, ACCOUNT)
    else:
        if FIRST_WAVE:
            e = tl.arange(0, BLOCK_E)
            soe = tl.load(soe_ptr + e, mask=e < E, other=-1)
            _assign_waves(ids_ptr, rows_ptr, P, K, E, N, soe, woe_ptr, cnt_ptr, HAS_ROWS,
                          BLOCK_E, BLOCK_P)
        # ROUTE: when the step's experts fit one wave, the later waves are empty and no wave's
        # route reads what an earlier wave's account writes, so every route runs here and
        # every account in the ACCOUNT launch; else each wave whole, as ALL.
        split = False
        if PART == ROUTE:
            split = tl.load(cnt_ptr + STEP_WAVES) <= 1
            tl.store(ev_ptr + num_waves, split.to(tl.int64))
        if split:
            _waves(ids_ptr, rows_ptr, P, K, E, N, w0, num_waves, soe_ptr, eos_ptr, woe_ptr,
                   cnt_ptr, freq_ptr, last_ptr, crf_ptr, wt_ptr, b_ptr, prev_ptr, par_ptr,
                   pow_ptr, D, ps_ptr, pe_ptr, pv_ptr, sid_ptr, ks_ptr, kx_ptr, ev_ptr, POLICY,
                   HAS_ROWS, SMALL_E, BLOCK_E, BLOCK_N, BLOCK_P, ROW_BLOCK, ROWS_E, ROUTE)
        else:
            _waves(ids_ptr, rows_ptr, P, K, E, N, w0, num_waves, soe_ptr, eos_ptr, woe_ptr,
                   cnt_ptr, freq_ptr, last_ptr, crf_ptr, wt_ptr, b_ptr, prev_ptr, par_ptr,
                   pow_ptr, D, ps_ptr, pe_ptr, pv_ptr, sid_ptr, ks_ptr, kx_ptr, ev_ptr, POLICY,
                   HAS_ROWS, SMALL_E, BLOCK_E, BLOCK_N, BLOCK_P, ROW_BLOCK, ROWS_E, ALL)


@triton.jit
def _waves(ids_ptr, rows_ptr, P, K, E, N, w0, num_waves, soe_ptr, eos_ptr, woe_ptr, cnt_ptr,
           freq_ptr, last_ptr, crf_ptr, wt_ptr, b_ptr, prev_ptr, par_ptr, pow_ptr, D, ps_ptr,
           pe_ptr, pv_ptr, sid_ptr, ks_ptr, kx_ptr, ev_ptr, POLICY: tl.constexpr,
           HAS_ROWS: tl.constexpr, SMALL_E: tl.constexpr, BLOCK_E: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, ROW_BLOCK: tl.constexpr,
           ROWS_E: tl.constexpr, PART: tl.constexpr):
    """``_wave_step``'s PART for waves [w0, w0 + num_waves) after wave 0's assignment, one
    after the other: wave i's plan at i * N, slot ids at i * P, eviction count at ev_ptr + i."""
    for i in range(0, num_waves):
        # Every thread's stores of the wave before are visible to the next wave's loads.
        tl.debug_barrier()
        _wave_step(ids_ptr, rows_ptr, P, K, E, N, w0 + i, soe_ptr, eos_ptr, woe_ptr, cnt_ptr,
                   freq_ptr, last_ptr, crf_ptr, wt_ptr, b_ptr, prev_ptr, par_ptr, pow_ptr, D,
                   ps_ptr + i * N, pe_ptr + i * N, pv_ptr + i * N, sid_ptr + i * P, ks_ptr,
                   kx_ptr, ev_ptr + i, POLICY, HAS_ROWS, False, SMALL_E, BLOCK_E, BLOCK_N,
                   BLOCK_P, ROW_BLOCK, ROWS_E, PART)


def _check(t: torch.Tensor, dtype: torch.dtype, what: str, device: torch.device) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.device != device:
        raise ValueError(f"triton residency_step: {what} must be a contiguous {dtype} tensor on "
                         f"{device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def residency_step(topk_ids: torch.Tensor, row_slots: torch.Tensor | None, wave: int,
                   slot_of_expert: torch.Tensor, expert_of_slot: torch.Tensor,
                   wave_of_expert: torch.Tensor, counters: torch.Tensor, policy_code: int,
                   state: dict[str, torch.Tensor], params: torch.Tensor, decay_pow: torch.Tensor,
                   plan_slots: torch.Tensor, plan_experts: torch.Tensor, plan_valid: torch.Tensor,
                   slot_ids: torch.Tensor, num_waves: int = 1, part: str = "all",
                   evictions: torch.Tensor | None = None) -> None:
    """Waves [wave, wave + num_waves) of one layer, one launch: the signature of
    ``moe_cache.residency_step``. All tensors on the device of topk_ids [T, K] int64; state
    updated in place; plans [num_waves, N] and slot_ids [num_waves, T, K] written.
    ``part`` (``PARTS``): "route" then "account" with the same arguments and ``evictions``
    int64 (the route's eviction count per wave, for the account; with several waves, from wave
    0, one more element: whether the account has the waves to do) leave what "all" leaves;
    "account" reads the plan "route" wrote and writes nothing "route" wrote."""
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
    if part not in PARTS:
        raise ValueError(f"triton residency_step: part={part!r}; allowed {list(PARTS)}")
    if part != "all":
        need = 1 if num_waves == 1 else num_waves + 1
        if (num_waves > 1 and wave != 0) or evictions is None or evictions.numel() != need:
            raise ValueError(f"triton residency_step: part={part!r} of waves [{wave}, "
                             f"{wave + num_waves}) needs them to start at wave 0 and an "
                             f"evictions tensor of {need} elements (one per wave, and the "
                             "route's flag when several)")
        _check(evictions, i64, "evictions", dev)
    if row_slots is not None:
        _check(row_slots, i64, "row_slots", dev)
    for name, t in state.items():
        _check(t, {"crf": f64, "weight": f64, "bias": f64, "prev": torch.bool}.get(name, i64),
               name, dev)
    T, K = topk_ids.shape
    E, N = slot_of_expert.shape[0], expert_of_slot.shape[0]
    check_wave_outputs("triton residency_step", num_waves, T, K, N,
                       (plan_slots, plan_experts, plan_valid), slot_ids, row_slots)
    if policy_code == 4:
        _check_lrfu_next(state, params, E)
    # Absent state tensors are never read by that policy's branches; any pointer will do.
    freq, last_use = state.get("freq", counters), state.get("last_use", counters)
    crf, weight, bias = (state.get(n, params) for n in ("crf", "weight", "bias"))
    prev = state.get("prev", plan_valid).view(torch.uint8)
    block_e, block_n = triton.next_power_of_2(E), triton.next_power_of_2(N)
    # The victim ranking's key scratch (_plan_slots): from the caching allocator, or the graph's
    # pool inside a capture; no host work.
    need_keys = part != "account"            # the account ranks nothing
    key_score = torch.empty(block_n, dtype=f64, device=dev) if need_keys else params
    key_expert = torch.empty(block_n, dtype=i64, device=dev) if need_keys else counters
    _residency_step_kernel[(1,)](
        topk_ids, row_slots if row_slots is not None else topk_ids, T * K, K, E, N, wave,
        num_waves, slot_of_expert, expert_of_slot, wave_of_expert, counters, freq, last_use,
        crf, weight, bias, prev, params, decay_pow, decay_pow.numel(), plan_slots, plan_experts,
        plan_valid.view(torch.uint8), slot_ids, key_score, key_expert,
        evictions if evictions is not None else counters, POLICY=policy_code,
        HAS_ROWS=row_slots is not None, FIRST_WAVE=wave == 0, ONE_WAVE=num_waves == 1,
        SMALL_E=block_e <= SMALL_E, BLOCK_E=block_e, BLOCK_N=block_n, BLOCK_P=BLOCK_P,
        ROW_BLOCK=min(ROW_BLOCK, block_n), ROWS_E=rows_e(block_e), PART=PARTS[part],
        num_warps=num_warps(policy_code, num_waves), **LAUNCH_OPTIONS)


def num_warps(policy_code: int, num_waves: int = 1) -> int:
    """lrfu_next's [ROWS_E, BLOCK_N] float64 weight tiles over 8 warps (64 slots of 64 experts
    spilled over 4 under Triton 3.6); the other policies' [E] and [N] vectors over 4, but over 8
    in a launch of several waves: its loop holds more registers than one wave's body (63 slots
    of 64 experts: capped at 128 and spilling 4-8 bytes for SM120 under 3.6 on 4 warps; 112-122
    and none on 8)."""
    return 8 if policy_code == 4 or num_waves > 1 else 4


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
