"""lrfu_next's learned next-plan predictor inside the Triton residency step
(``residency_step.py``): p(j | a set of experts) over [ROWS_E, cols] tiles of its [E, E]
weight, and the learning step. Device functions only; the policy and its torch reference are
``expert_cache/policy.py``, whose bits these reproduce (integer sums in units of 2**-32, exact
in any order; IEEE float64 elsewhere, no FMA contraction: the launch's options)."""
from __future__ import annotations

import triton
import triton.language as tl

# policy.py's _FIX_ONE and _FIX_MAX, and 2**52 (rounding to an integer), as constexprs: a
# @triton.jit function may read only constexpr globals.
FIX_ONE, FIX_MAX, TWO_52 = (tl.constexpr(float(2 ** k)) for k in (32, 40, 52))


@triton.jit
def _weight_rows(r0, cols, mask, active, sel_ptr, sel, E, wt_ptr, SMALL_E: tl.constexpr,
                 ROWS_E: tl.constexpr):
    """(ptrs, rows, tile) of weight rows r0 <= i < r0 + ROWS_E at ``cols`` (where ``mask``):
    rows [ROWS_E] the ones with sel_ptr[i] == sel (none unless ``active``), tile
    [ROWS_E, cols] their values, 0.0 elsewhere. SMALL_E: the tile is loaded whatever the rows'
    selection (its load does not wait for the selection's), which applies in registers."""
    i = r0 + tl.arange(0, ROWS_E)
    in_rows = tl.where(active, i < E, False)   # not `& active`: the interpreter makes int32
    rows = in_rows & (tl.load(sel_ptr + i, mask=in_rows, other=0) == sel)
    ptrs = wt_ptr + i[:, None] * E + cols[None, :]
    if SMALL_E:
        tile = tl.load(ptrs, mask=in_rows[:, None] & mask[None, :], other=0.0)
        tile = tl.where(rows[:, None], tile, 0.0)
    else:
        tile = tl.load(ptrs, mask=rows[:, None] & mask[None, :], other=0.0)
    return ptrs, rows, tile


@triton.jit
def _predict(cols, mask, active, sel_ptr, sel, E, wt_ptr, bias, SMALL_E: tl.constexpr,
             BLOCK_E: tl.constexpr, ROWS_E: tl.constexpr):
    """lrfu_next's p[cols] (float64, same shape) given the rows i < E with sel_ptr[i] == sel
    (the wave: wave_of_expert == w; or prev == 1): (bias + sum of weight[i, cols]) / 2**32,
    ``bias`` = bias[cols] (0 where ``mask`` is off), loaded by the caller.
    The terms are integers and the sum stays below 2**53 (policy.py _FIX_MAX), so summing by
    [ROWS_E, cols] tiles gives torch's bits. ``active`` False: nothing is loaded (p is then
    the bias alone). SMALL_E: the tiles are unrolled, so their loads are in flight together."""
    acc = tl.zeros_like(cols).to(tl.float64)
    if SMALL_E:
        for r0 in tl.static_range(0, BLOCK_E, ROWS_E):
            _, _, tile = _weight_rows(r0, cols, mask, active, sel_ptr, sel, E, wt_ptr, SMALL_E,
                                      ROWS_E)
            acc += tl.sum(tile, axis=0)
    else:
        for r0 in range(0, E, ROWS_E):
            _, _, tile = _weight_rows(r0, cols, mask, active, sel_ptr, sel, E, wt_ptr, SMALL_E,
                                      ROWS_E)
            acc += tl.sum(tile, axis=0)
    return (bias + acc) / FIX_ONE


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
def _learn_rows(r0, e, in_e, any_used, E, wt_ptr, prev_ptr, delta, SMALL_E: tl.constexpr,
                ROWS_E: tl.constexpr):
    """Rows r0 <= i < r0 + ROWS_E of prev (the last plan's experts, 0/1): weight[i, :] +=
    delta, clamped (the store masked to those rows)."""
    ptrs, rows, tile = _weight_rows(r0, e, in_e, any_used, prev_ptr, 1, E, wt_ptr, SMALL_E,
                                    ROWS_E)
    tl.store(ptrs, _clamp_fix(tile + delta[None, :]), mask=rows[:, None] & in_e[None, :])


@triton.jit
def _learn_next(e, in_wave, any_used, E, wt_ptr, b_ptr, prev_ptr, par_ptr, bias, prev,
                SMALL_E: tl.constexpr, BLOCK_E: tl.constexpr, ROWS_E: tl.constexpr):
    """lrfu_next's learning step (policy.py on_access) when the wave in_wave [BLOCK_E] is not
    empty: delta = round(((in_wave - p(. | prev)) * lr) / (|prev| + 1) * 2**32); bias and the
    rows of prev += delta, clamped to +-2**40; prev = in_wave. ``bias`` and ``prev``
    [BLOCK_E]: their values at the start of the launch."""
    in_e = e < E
    p = _predict(e, in_e, any_used, prev_ptr, 1, E, wt_ptr, bias, SMALL_E, BLOCK_E, ROWS_E)
    n_prev = tl.sum((prev != 0).to(tl.int64), axis=0)
    err = in_wave.to(tl.float64) - p
    delta = _round_half_even(err * tl.load(par_ptr + 3) / (n_prev.to(tl.float64) + 1.0) * FIX_ONE)
    tl.debug_barrier()              # every read of weight and prev above precedes the writes
    learn = tl.where(any_used, in_e, False)   # not `& any_used`: the interpreter makes that int32
    tl.store(b_ptr + e, _clamp_fix(bias + delta), mask=learn)
    if SMALL_E:
        for r0 in tl.static_range(0, BLOCK_E, ROWS_E):
            _learn_rows(r0, e, in_e, any_used, E, wt_ptr, prev_ptr, delta, SMALL_E, ROWS_E)
    else:
        for r0 in range(0, E, ROWS_E):
            _learn_rows(r0, e, in_e, any_used, E, wt_ptr, prev_ptr, delta, SMALL_E, ROWS_E)
    tl.debug_barrier()              # the loop above read prev
    tl.store(prev_ptr + e, in_wave.to(tl.uint8), mask=learn)
