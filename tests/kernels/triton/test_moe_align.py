"""The one-launch ``moe_align_block_size`` kernel (vllm/kernels/triton/moe_align.py) equals the
torch version exactly, under Triton's interpreter: random ids with skipped ones (-1, >= E), every
block size the tables use, E from 1 to 257 (one-hot tiles of 16 to 128 pairs), pair counts from
1 to the kernel's limit (many chunks, padded blocks); past the limit the torch version runs.
The torch version itself is checked against a Python loop in test_fused_moe.py."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]


@pytest.fixture
def ma():
    from vllm.kernels.triton import moe_align
    return moe_align


@pytest.mark.parametrize("T,K,E,block_m", [
    (1, 1, 1, 16), (1, 8, 64, 16), (3, 8, 64, 32), (32, 8, 64, 64), (5, 2, 7, 16),
    (37, 4, 13, 128), (300, 3, 5, 32), (3, 2, 40, 16), (17, 6, 257, 16), (512, 8, 128, 64),
    (64, 8, 256, 16), (1, 4, 512, 16)])
def test_kernel_equals_the_torch_version(ma, T, K, E, block_m):
    g = torch.Generator().manual_seed(T * 131 + E * 7 + block_m)
    ids = torch.randint(-1, E + 2, (T, K), generator=g)
    got = ma.moe_align_block_size(ids, block_m, E)
    want = ma.moe_align_block_size_torch(ids, block_m, E)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)


def test_a_whole_step_on_one_expert_and_none_at_all(ma):
    """All pairs on one expert (one group spanning many blocks); every pair skipped."""
    for ids in (torch.full((40, 4), 3), torch.full((6, 2), -1)):
        got = ma.moe_align_block_size(ids, 16, 8)
        want = ma.moe_align_block_size_torch(ids, 16, 8)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16])
def test_narrow_id_dtypes(ma, dtype):
    ids = torch.randint(0, 8, (9, 2), generator=torch.Generator().manual_seed(1))
    got = ma.moe_align_block_size(ids.to(dtype), 16, 8)
    want = ma.moe_align_block_size_torch(ids, 16, 8)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


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
        got = ma.moe_align_block_size(ids, 32, 16)
        want = ma.moe_align_block_size_torch(ids, 32, 16)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert launches == [(1,)]


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
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_max_ids_must_not_be_negative(ma):
    with pytest.raises(ValueError, match="max_ids=-1 must be >= 0"):
        ma.moe_align_block_size(torch.zeros(2, 2, dtype=torch.int64), 16, 4, -1)
