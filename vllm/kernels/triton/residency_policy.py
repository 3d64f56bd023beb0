"""The expert cache's Triton residency step, its policy parts: the keep scores of
``policy.py`` (same float64 operation order), the victim ranking of a wave's misses, and the
policy state's load and update (``residency_step.py`` runs them; read its docstring)."""
from __future__ import annotations

import triton
import triton.language as tl

from vllm.kernels.triton.lrfu_next import _predict


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
def _victim_keys(s, inb, active, w, E, eos_ptr, woe_ptr, clock, freq_ptr, last_ptr, crf_ptr,
                 wt_ptr, b_ptr, par_ptr, pow_ptr, D, POLICY: tl.constexpr,
                 SMALL_E: tl.constexpr, BLOCK_E: tl.constexpr, ROWS_E: tl.constexpr):
    """(victim, score, expert) of slots s where ``inb``: victims hold an expert that is not in
    wave w. ``active`` False (a wave without a miss; ``inb`` is then all off): no loads."""
    held = tl.load(eos_ptr + s, mask=inb, other=-1)
    victim = inb & (held >= 0)
    victim = victim & (tl.load(woe_ptr + held, mask=victim, other=-1) != w)
    score = _keep_score(held, clock, freq_ptr, last_ptr, crf_ptr, par_ptr, pow_ptr, D, victim,
                        POLICY)
    if POLICY == 4:     # lrfu_next: lrfu's score + p(held | the wave) * next_weight
        bias = tl.load(b_ptr + held, mask=victim, other=0.0)
        p = _predict(held, victim, active, woe_ptr, w, E, wt_ptr, bias, SMALL_E, BLOCK_E,
                     ROWS_E)
        score = score + p * tl.load(par_ptr + 2)
    return victim, score, held


@triton.jit
def _plan_slots(w, N, M, E, eos_ptr, woe_ptr, clock, freq_ptr, last_ptr, crf_ptr, wt_ptr, b_ptr,
                par_ptr, pow_ptr, D, ps_ptr, ks_ptr, kx_ptr, POLICY: tl.constexpr,
                SMALL_E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
                ROW_BLOCK: tl.constexpr, ROWS_E: tl.constexpr):
    """plan_slots[:M]: the empty slots in slot order, then victims by (score, expert id). The
    keys are computed once (lrfu_next's cost a pass over its [E, E] weight) and each row block
    of the ranking reads them back from the scratch ks [BLOCK_N] (score) and kx [BLOCK_N] (the
    victim's expert, -1 for a slot that is no victim): the same bits. A wave without a miss
    (M == 0) masks every load here off (``s < N`` only where M > 0): no slot is empty or a
    victim for it, so nothing chained behind them (the held expert's wave, its policy state,
    lrfu_next's weight rows, the ranking's keys) goes to memory. Masks, not a branch: under
    Triton 3.6 an ``if M > 0`` around this made the lrfu and lrfu_next variants spill."""
    s = tl.arange(0, BLOCK_N)
    slot = tl.where(M > 0, s < N, False)     # not `& (M > 0)`: the interpreter makes int32
    empty = slot & (tl.load(eos_ptr + s, mask=slot, other=0) < 0)
    empty_rank = tl.cumsum(empty.to(tl.int32), axis=0).to(tl.int64) - 1
    n_empty = tl.sum(empty.to(tl.int64), axis=0)
    tl.store(ps_ptr + empty_rank, s.to(tl.int64), mask=empty & (empty_rank < M))
    tl.store(ps_ptr + s, tl.full([BLOCK_N], -1, tl.int64), mask=(s >= M) & (s < N))
    n_evict = M - tl.minimum(n_empty, M)
    cv, cscore, cexp = _victim_keys(s, slot, M > 0, w, E, eos_ptr, woe_ptr, clock, freq_ptr,
                                    last_ptr, crf_ptr, wt_ptr, b_ptr, par_ptr, pow_ptr, D,
                                    POLICY, SMALL_E, BLOCK_E, ROWS_E)
    tl.store(ks_ptr + s, cscore)
    tl.store(kx_ptr + s, tl.where(cv, cexp, -1))
    tl.debug_barrier()
    for r0 in tl.static_range(0, BLOCK_N, ROW_BLOCK):
        r = r0 + tl.arange(0, ROW_BLOCK)
        live = tl.where(M > 0, r < BLOCK_N, False)
        rexp = tl.load(kx_ptr + r, mask=live, other=-1)
        rv = rexp >= 0
        rscore = tl.load(ks_ptr + r, mask=live, other=0.0)
        before = (cscore[None, :] < rscore[:, None]) | (
            (cscore[None, :] == rscore[:, None]) & (cexp[None, :] < rexp[:, None]))
        vrank = tl.sum((before & cv[None, :]).to(tl.int64), axis=1)       # [ROW_BLOCK]
        tl.store(ps_ptr + n_empty + vrank, r.to(tl.int64), mask=rv & (vrank < n_evict))


@triton.jit
def _load_policy(e, in_e, clock, freq_ptr, last_ptr, crf_ptr, pow_ptr, D, POLICY: tl.constexpr):
    """Every expert's (freq, crf * decay_pow[clock - last_use]) [BLOCK_E] (zeros for what the
    policy does not keep), loaded at the start of the launch: only ``_update_policy``, at its
    end, writes that state."""
    freq = tl.zeros_like(e).to(tl.int64)
    decayed = tl.zeros_like(e).to(tl.float64)
    if POLICY == 1 or POLICY == 2:
        freq = tl.load(freq_ptr + e, mask=in_e, other=0)
    if POLICY == 3 or POLICY == 4:
        dt = clock - tl.load(last_ptr + e, mask=in_e, other=0)
        # dt >= 0 (last_use <= clock); the floor only keeps a read in bounds.
        p = tl.load(pow_ptr + tl.maximum(tl.minimum(dt, D - 1), 0), mask=in_e, other=0.0)
        decayed = tl.load(crf_ptr + e, mask=in_e, other=0.0) * p
    return freq, decayed


@triton.jit
def _update_policy(e, in_wave, clock, freq, decayed, freq_ptr, last_ptr, crf_ptr,
                   POLICY: tl.constexpr):
    """The policy's on_access for the wave's experts, at the pre-step clock (``freq`` and
    ``decayed`` from ``_load_policy``)."""
    if POLICY == 1 or POLICY == 2:
        tl.store(freq_ptr + e, freq + 1, mask=in_wave)
    if POLICY == 3 or POLICY == 4:
        tl.store(crf_ptr + e, decayed + 1.0, mask=in_wave)
    if POLICY != 1:
        tl.store(last_ptr + e, tl.zeros_like(e).to(tl.int64) + clock, mask=in_wave)
