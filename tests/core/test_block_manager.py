import random

import pytest

from vllm.core.block_manager import BlockManager
from vllm.core.request import Request
from vllm.sampling_params import SamplingParams


def _req(rid: str) -> Request:
    return Request(rid, None, [1, 2, 3], SamplingParams())


def test_allocate_grows_block_table_to_cover_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = _req("a")
    assert bm.allocate_for(r, 1)
    assert len(r.block_ids) == 1
    assert bm.allocate_for(r, 4)
    assert len(r.block_ids) == 1  # 4 tokens still fit in one block
    assert bm.allocate_for(r, 5)
    assert len(r.block_ids) == 2
    assert bm.allocate_for(r, 17)
    assert len(r.block_ids) == 5
    assert bm.num_free_blocks == 3
    assert bm.usage == pytest.approx(5 / 8)
    bm.check_invariants()


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = _req("a"), _req("b")
    assert bm.allocate_for(a, 6)  # 3 blocks
    assert not bm.can_allocate(3)
    assert not bm.allocate_for(b, 3)  # needs 2, only 1 free
    assert b.block_ids == []
    assert bm.num_free_blocks == 1
    assert bm.can_allocate(2)
    bm.check_invariants()


def test_free_returns_every_block():
    bm = BlockManager(num_blocks=6, block_size=3)
    a, b = _req("a"), _req("b")
    bm.allocate_for(a, 7)
    bm.allocate_for(b, 4)
    a_blocks = set(a.block_ids)
    bm.free(a)
    assert a.block_ids == []
    assert bm.num_free_blocks == 6 - len(b.block_ids)
    assert not a_blocks & set(b.block_ids)
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.usage == 0.0
    bm.check_invariants()


def test_invariants_under_random_operations():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=32, block_size=4)
    reqs = [_req(f"r{i}") for i in range(10)]
    sizes = {r.request_id: 0 for r in reqs}
    for _ in range(500):
        r = rng.choice(reqs)
        if rng.random() < 0.3:
            bm.free(r)
            sizes[r.request_id] = 0
        else:
            target = sizes[r.request_id] + rng.randint(1, 9)
            before = list(r.block_ids)
            if bm.allocate_for(r, target):
                sizes[r.request_id] = target
                assert len(r.block_ids) * 4 >= target
                assert r.block_ids[:len(before)] == before  # the table only grows at the end
            else:
                assert r.block_ids == before
        bm.check_invariants()
        owned = [b for x in reqs for b in x.block_ids]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) + bm.num_free_blocks == 32


def test_bad_sizes_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
