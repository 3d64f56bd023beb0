"""The Triton ``expert_gather_many`` (``vllm/kernels/triton/expert_gather_many.py``) against a
plain per-tensor torch loop: a layer's tensors of every dtype and word size, rows spanning
several chunks, invalid and out-of-range entries, more tensors than one launch takes. Under
Triton's interpreter on CPU; on a GPU (``gpu``) from a pinned host store, and inside a CUDA
graph capture."""
from __future__ import annotations

import pytest
import torch
from triton_kernels import triton_module

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def egm():
    return triton_module("expert_gather_many")


def reference(src, dst, experts, slots, valid):
    """dst after the copy, on the CPU, entry by entry."""
    out = dst.cpu().clone()
    for e, s, ok in zip(experts.tolist(), slots.tolist(), valid.tolist()):
        if ok and 0 <= e < src.shape[0] and 0 <= s < dst.shape[0]:
            out[s] = src[e].cpu()
    return out


def layer(E, g):
    """18 tensors: rows of 2 * 8192 + 6 int64 words (three chunks), 60, 91, 2048, 40 and 6
    bytes (word sizes 8, 4, 1, 8, 8, 2), 12 more of int32 (two launches of the 4-byte group)."""
    shapes = [(torch.int64, (2 * 8192 + 6,)), (torch.float32, (3, 5)), (torch.uint8, (7, 13)),
              (torch.float16, (32, 32)), (torch.float32, (2, 5)), (torch.float16, (3,))]
    shapes += [(torch.int32, (i + 1,)) for i in range(12)]
    return [torch.randint(-1000, 1000, (E, *row), generator=g).to(dtype)
            for dtype, row in shapes]


def plan(n, E, N, g, device):
    experts = torch.randint(0, E, (n,), generator=g)
    slots = torch.randperm(N, generator=g)[:n]
    valid = torch.rand(n, generator=g) < 0.7
    experts[0], valid[0] = 2 ** 40, True               # out of range: copies nothing
    experts[1], valid[1] = -7, False                   # garbage where not valid: unread
    return experts.to(device), slots.to(device), valid.to(device)


def test_matches_the_per_tensor_reference(egm):
    g = torch.Generator().manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    srcs = layer(9, g)
    if device == "cuda":
        srcs = [s.pin_memory() for s in srcs]
    dsts = [torch.full((6, *s.shape[1:]), 3, dtype=s.dtype, device=device) for s in srcs]
    before = [d.cpu().clone() for d in dsts]
    experts, slots, valid = plan(6, 9, 6, g, device)
    egm.expert_gather_many(srcs, dsts, experts, slots, valid)
    for src, dst, old in zip(srcs, dsts, before):
        assert torch.equal(dst.cpu(), reference(src, old, experts, slots, valid))


def test_entries_past_the_grid_rows_are_copied(egm):
    """n = 27 entries over ENTRY_ROWS = 8 rows of programs, valid ones anywhere."""
    from vllm.kernels.triton.expert_gather import ENTRY_ROWS
    assert ENTRY_ROWS == 8
    g = torch.Generator().manual_seed(3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    srcs = layer(30, g)[:4]
    if device == "cuda":
        srcs = [s.pin_memory() for s in srcs]
    dsts = [torch.full((27, *s.shape[1:]), 3, dtype=s.dtype, device=device) for s in srcs]
    before = [d.cpu().clone() for d in dsts]
    experts, slots, valid = plan(27, 30, 27, g, device)
    valid[26] = True                                   # the last entry, in the last row
    egm.expert_gather_many(srcs, dsts, experts, slots, valid)
    for src, dst, old in zip(srcs, dsts, before):
        assert torch.equal(dst.cpu(), reference(src, old, experts, slots, valid))


def test_tables_are_made_once_per_set_of_tensors(egm):
    g = torch.Generator().manual_seed(1)
    srcs = layer(4, g)[:3]
    dsts = [torch.zeros(2, *s.shape[1:], dtype=s.dtype) for s in srcs]
    experts, slots, valid = plan(2, 4, 2, g, "cpu")
    egm.expert_gather_many(srcs, dsts, experts, slots, valid)
    made = len(egm._TABLES)
    egm.expert_gather_many(srcs, dsts, experts, slots, valid)
    assert len(egm._TABLES) == made


def test_bad_arguments_name_the_problem(egm):
    ids = torch.zeros(2, dtype=torch.long)
    ok = torch.ones(2, dtype=torch.bool)
    a, b = torch.zeros(4, 8), torch.zeros(5, 8)
    dst = [torch.zeros(2, 8), torch.zeros(2, 8)]
    with pytest.raises(ValueError, match="tensor 1 has 5 experts"):
        egm.expert_gather_many([a, b], dst, ids, ids, ok)
    with pytest.raises(ValueError, match="as many srcs as dsts"):
        egm.expert_gather_many([a], dst, ids, ids, ok)
    with pytest.raises(ValueError, match="same row shape"):
        egm.expert_gather_many([a], [torch.zeros(2, 9)], ids, ids, ok)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_graph_replays_the_copy_with_new_plans(egm):
    from gather_replay import check_graph_replay
    g = torch.Generator().manual_seed(2)
    srcs = [s.pin_memory() for s in layer(8, g)]
    dsts = [torch.zeros(4, *s.shape[1:], dtype=s.dtype, device="cuda") for s in srcs]
    check_graph_replay(egm.expert_gather_many, srcs, dsts, plan(4, 8, 4, g, "cuda"),
                       plan(4, 8, 4, torch.Generator().manual_seed(3), "cuda"), reference)
