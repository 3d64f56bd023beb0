"""The one-launch ``moe_align_block_size`` kernel (vllm/kernels/triton/moe_align.py) equals the
torch version exactly, under Triton's interpreter: random ids with skipped ones (-1, >= E), every
block size the tables use, E from 1 to the kernel's limit (1024), pair counts from 1 to its limit
(4096: sorts of 32 to 4096 keys, one to sixteen warps), empty waves (every id skipped), max_ids
promises kept and broken; past the limits the torch version runs. The kernel's outputs are
allocated poisoned (-7), so an entry it fails to write shows. The torch version itself is
checked against a Python loop in test_fused_moe.py."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]


class _PoisonedTorch:
    """torch as the wrapper sees it, with torch.empty filled with -7: an output entry that the
    kernel leaves unwritten differs from the torch version's."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, **kw):
        return torch.full(shape, -7, **kw)


@pytest.fixture
def ma(monkeypatch):
    from vllm.kernels.triton import moe_align
    monkeypatch.setattr(moe_align, "torch", _PoisonedTorch())
    return moe_align


def _assert_same(got, want):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.int64 and a.shape == b.shape
        assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("T,K,E,block_m", [
    (1, 1, 1, 16), (1, 8, 64, 16), (3, 8, 64, 32), (32, 8, 64, 64), (5, 2, 7, 16),
    (37, 4, 13, 128), (300, 3, 5, 32), (3, 2, 40, 16), (17, 6, 257, 16), (512, 8, 128, 64),
    (64, 8, 256, 16), (1, 4, 512, 16), (1, 8, 256, 64), (32, 8, 256, 32), (16, 4, 64, 16),
    (128, 4, 64, 32), (256, 8, 64, 16), (4095, 1, 64, 16), (512, 8, 256, 64), (819, 5, 256, 32),
    (1024, 4, 64, 64), (100, 6, 1024, 16)])
def test_kernel_equals_the_torch_version(ma, T, K, E, block_m):
    """P = T * K of 1 to 4096 (4095: no power of two), ids in [-1, E + 2)."""
    g = torch.Generator().manual_seed(T * 131 + E * 7 + block_m)
    ids = torch.randint(-1, E + 2, (T, K), generator=g)
    _assert_same(ma.moe_align_block_size(ids, block_m, E),
                 ma.moe_align_block_size_torch(ids, block_m, E))


@pytest.mark.parametrize("P", [8, 256, 4095, 4096])
@pytest.mark.parametrize("E", [64, 256])
def test_mixed_skipped_ids_at_decode_and_limit_sizes(ma, P, E):
    """About a third of the ids skipped (negative or >= E, far past it too), the rest skewed
    towards a few experts (groups of many blocks beside groups of one pair), block_m 16 to
    64."""
    g = torch.Generator().manual_seed(P * 3 + E)
    hot = torch.randint(0, E, (4,), generator=g)
    ids = torch.where(torch.rand(P, generator=g) < 0.5, hot[torch.randint(0, 4, (P,), generator=g)],
                      torch.randint(0, E, (P,), generator=g))
    skip = torch.rand(P, generator=g) < 0.3
    ids[skip] = torch.tensor([-1, -5, E, E + 1, 10 ** 6])[torch.randint(0, 5, (int(skip.sum()),),
                                                                         generator=g)]
    for block_m in (16, 32, 64):
        _assert_same(ma.moe_align_block_size(ids.reshape(-1, 1), block_m, E),
                     ma.moe_align_block_size_torch(ids.reshape(-1, 1), block_m, E))


@pytest.mark.parametrize("P", [8, 256, 4096])
@pytest.mark.parametrize("E,block_m", [(64, 16), (64, 64), (256, 16)])
@pytest.mark.parametrize("max_ids", [None, 0, 1, 5])
def test_an_empty_wave(ma, P, E, block_m, max_ids):
    """Every id -1 (a cache's wave with nothing to run; the kernel's early path): sorted_ids all
    P, block_expert all -1, num_padded 0, as the torch version has them, at every S."""
    ids = torch.full((P // 8 if P >= 8 else 1, 8), -1)
    got = ma.moe_align_block_size(ids, block_m, E, max_ids)
    _assert_same(got, ma.moe_align_block_size_torch(ids, block_m, E, max_ids))
    assert (got[0] == P).all() and (got[1] == -1).all() and int(got[2]) == 0


def test_ids_all_past_e_make_an_empty_wave_too(ma):
    ids = torch.randint(64, 200, (32, 8), generator=torch.Generator().manual_seed(3))
    _assert_same(ma.moe_align_block_size(ids, 16, 64),
                 ma.moe_align_block_size_torch(ids, 16, 64))


@pytest.mark.parametrize("P,E,block_m", [(256, 64, 16), (4096, 256, 64), (4096, 64, 16)])
def test_one_expert_and_one_expert_per_pair(ma, P, E, block_m):
    """Every pair on one expert (a group of P / block_m blocks, the sort's keys already in
    order) and pairs spread over every expert in reverse (the keys in reverse order)."""
    for ids in (torch.full((P,), E - 1), (E - 1 - torch.arange(P) % E)):
        _assert_same(ma.moe_align_block_size(ids.reshape(-1, 8), block_m, E),
                     ma.moe_align_block_size_torch(ids.reshape(-1, 8), block_m, E))


def test_a_whole_step_on_one_expert_and_none_at_all(ma):
    """All pairs on one expert (one group spanning many blocks); every pair skipped."""
    for ids in (torch.full((40, 4), 3), torch.full((6, 2), -1)):
        got = ma.moe_align_block_size(ids, 16, 8)
        want = ma.moe_align_block_size_torch(ids, 16, 8)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_narrow_id_dtypes(ma, dtype):
    """int32 ids go to the kernel as they are, others as int64; -1 and ids past E skipped."""
    ids = torch.randint(0, 10, (9, 2), generator=torch.Generator().manual_seed(1))
    if dtype != torch.uint8:
        ids[0, 0] = -1
    got = ma.moe_align_block_size(ids.to(dtype), 16, 8)
    _assert_same(got, ma.moe_align_block_size_torch(ids, 16, 8))


def test_the_kernel_runs_up_to_its_limit_and_torch_past_it(ma, monkeypatch):
    launches = []
    real = ma._align_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]
    monkeypatch.setattr(ma, "_align_kernel", Spy())
    for P in (ma.KERNEL_MAX_PAIRS, ma.KERNEL_MAX_PAIRS + 2):
        ids = torch.randint(0, 16, (P // 2, 2), generator=torch.Generator().manual_seed(P))
        _assert_same(ma.moe_align_block_size(ids, 32, 16),
                     ma.moe_align_block_size_torch(ids, 32, 16))
    assert launches == [(1,)]
    for E in (ma.KERNEL_MAX_EXPERTS, ma.KERNEL_MAX_EXPERTS + 1):
        ids = torch.randint(-1, E, (64, 8), generator=torch.Generator().manual_seed(E))
        _assert_same(ma.moe_align_block_size(ids, 16, E),
                     ma.moe_align_block_size_torch(ids, 16, E))
    assert launches == [(1,), (1,)]


def _padded(P: int, groups: int, block_m: int) -> int:
    """The worst case of ``groups`` expert groups over P pairs, each padded to block_m."""
    return -(-(P + min(groups, P) * (block_m - 1)) // block_m) * block_m


@pytest.mark.parametrize("T,K,E,used,block_m", [(32, 8, 64, 1, 16), (32, 8, 64, 5, 16),
                                                  (9, 2, 7, 3, 32), (40, 4, 13, 13, 16)])
def test_max_ids_shortens_the_padding_and_keeps_the_groups(ma, T, K, E, used, block_m):
    """ids using ``used`` of E experts (and -1s), aligned with max_ids = used and used + 2: the
    same groups as without the bound, in a sorted_ids / block_expert of the bound's worst case
    (a cache's last wave: one expert at N = E - 1 gives 32 + 15 pairs' room, not 32 + 64 * 15)."""
    g = torch.Generator().manual_seed(T * E + used)
    experts = torch.randperm(E, generator=g)[:used]
    ids = experts[torch.randint(0, used, (T, K), generator=g)]
    ids[torch.rand(T, K, generator=g) < 0.3] = -1
    full = ma.moe_align_block_size_torch(ids, block_m, E)
    for max_ids in (used, used + 2):
        S = _padded(T * K, min(E, max_ids), block_m)
        for fn in (ma.moe_align_block_size, ma.moe_align_block_size_torch):
            sorted_ids, block_expert, num_padded = fn(ids, block_m, E, max_ids)
            assert sorted_ids.shape == (S,) and block_expert.shape == (S // block_m,)
            assert torch.equal(num_padded, full[2]) and int(num_padded) <= S
            assert torch.equal(sorted_ids, full[0][:S])
            assert torch.equal(block_expert, full[1][:S // block_m])
            # what the bound cut off was padding only
            assert (full[0][S:] == T * K).all() and (full[1][S // block_m:] == -1).all()


def test_a_broken_max_ids_promise_drops_pairs_and_writes_nothing_past_s(ma):
    """Five experts used under max_ids = 1: the pairs placed past S are dropped by both
    versions alike (the kernel masks its scatter, torch clamps it): no write out of bounds."""
    ids = torch.arange(40).reshape(20, 2) % 5
    got = ma.moe_align_block_size(ids, 16, 8, 1)
    want = ma.moe_align_block_size_torch(ids, 16, 8, 1)
    assert got[0].shape == (_padded(40, 1, 16),)
    _assert_same(got, want)


@pytest.mark.parametrize("P,E,block_m", [(8, 64, 16), (256, 64, 16), (256, 64, 64),
                                         (4096, 256, 32)])
@pytest.mark.parametrize("used,max_ids", [(1, 1), (6, 6), (6, 9), (40, 1), (40, 3), (64, 8)])
def test_max_ids_kept_and_broken_at_decode_and_limit_sizes(ma, P, E, block_m, used, max_ids):
    """ids over ``used`` experts (and -1s) under max_ids: kept (used <= max_ids) the same groups
    as without it, in the bound's S; broken (used > max_ids) the torch version's drops, with
    num_padded still the full count (past S)."""
    g = torch.Generator().manual_seed(P + used * 7 + max_ids)
    experts = torch.randperm(E, generator=g)[:used]
    ids = experts[torch.randint(0, used, (P,), generator=g)]
    ids[torch.rand(P, generator=g) < 0.2] = -1
    got = ma.moe_align_block_size(ids.reshape(-1, 8), block_m, E, max_ids)
    want = ma.moe_align_block_size_torch(ids.reshape(-1, 8), block_m, E, max_ids)
    _assert_same(got, want)
    S = _padded(P, min(E, max_ids), block_m)
    assert got[0].shape == (S,)
    if used <= max_ids:
        full = ma.moe_align_block_size_torch(ids.reshape(-1, 8), block_m, E)
        assert torch.equal(got[0], full[0][:S]) and torch.equal(got[2], full[2])


def test_max_ids_must_not_be_negative(ma):
    with pytest.raises(ValueError, match="max_ids=-1 must be >= 0"):
        ma.moe_align_block_size(torch.zeros(2, 2, dtype=torch.int64), 16, 4, -1)
