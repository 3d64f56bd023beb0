"""The exp12 decode-gather (``vllm/kernels/triton/exp12_gather.py``) against the original bf16
experts: for each valid, in-range plan entry, the slot holds the expert's exact bits; other
slots are untouched. Planes come from ``link_codec.encode`` (its own tests check it against the
original bits). Under Triton's interpreter on CPU; the ``gpu`` test reads pinned planes on CUDA
and replays a captured copy."""
from __future__ import annotations

import pytest
import torch
from triton_kernels import triton_module

from vllm.model_executor.layers.fused_moe.expert_cache.link_codec import encode

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kg():
    return triton_module("exp12_gather")


def _experts(E: int, row: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(E, *row, generator=g).mul_(0.05).to(torch.bfloat16)
    flat = t.view(E, -1)
    flat[0, :6] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-40, 1e-30],
                               dtype=torch.bfloat16)
    flat[E - 1, -3:] = torch.tensor([3e-20, -7e-25, 1e25], dtype=torch.bfloat16)   # escapes
    return t


def _expected(src, dst, experts, slots, valid):
    out = dst.cpu().clone()
    E, N = src.shape[0], dst.shape[0]
    for e, s, v in zip(experts.tolist(), slots.tolist(), valid.tolist()):
        if v and 0 <= e < E and 0 <= s < N:
            out[s] = src[e]
    return out.view(torch.int16)


def _run(kg, src, N, experts, slots, valid):
    c = encode(src)
    planes = tuple(p.to(DEVICE) for p in c.planes)
    dst = torch.full((N, *src.shape[1:]), -2.0, dtype=torch.bfloat16, device=DEVICE)
    before = dst.cpu().clone()
    plan = [torch.tensor(x, device=DEVICE) for x in (experts, slots)]
    kg.exp12_gather(planes, dst, *plan, torch.tensor(valid, device=DEVICE))
    return dst.cpu().view(torch.int16), _expected(src, before, torch.tensor(experts),
                                                  torch.tensor(slots), torch.tensor(valid))


@pytest.mark.parametrize("row", [(4, 32), (40, 1024), (3, 128)])
def test_slots_hold_the_exact_experts(kg, row):
    """(40, 1024): 40,960 weights, two chunks of 16,384 and a partial one."""
    src = _experts(6, row, 0)
    got, want = _run(kg, src, 4, [5, 0, 3, 2], [1, 3, 0, 2], [True, True, True, False])
    assert torch.equal(got, want)


def test_more_entries_than_grid_rows_and_invalid_ones(kg):
    src = _experts(12, (2, 128), 1)
    experts = list(range(11, -1, -1))
    slots = list(range(12))
    valid = [i % 3 != 1 for i in range(12)]
    got, want = _run(kg, src, 12, experts, slots, valid)
    assert torch.equal(got, want)


def test_out_of_range_ids_are_skipped_and_none_valid_copies_nothing(kg):
    src = _experts(3, (2, 128), 2)
    got, want = _run(kg, src, 2, [7, -1, 1, 0], [0, 1, 5, 1], [True, True, True, True])
    assert torch.equal(got, want)
    got, want = _run(kg, src, 2, [0, 1], [0, 1], [False, False])
    assert torch.equal(got, want) and bool((got.view(torch.bfloat16) == -2.0).all())


@pytest.mark.parametrize("bad,needle", [("dst_dtype", "bfloat16"), ("lo_width", "lo must be"),
                                        ("esc_dtype", "esc_index must be")])
def test_bad_arguments_name_the_problem(kg, bad, needle):
    src = _experts(2, (2, 128), 3)
    planes = list(encode(src).planes)
    dst = torch.zeros(2, 2, 128, dtype=torch.bfloat16)
    if bad == "dst_dtype":
        dst = dst.float()
    elif bad == "lo_width":
        planes[0] = planes[0][:, :128].contiguous()
    else:
        planes[3] = planes[3].long()
    plan = (torch.tensor([0]), torch.tensor([1]), torch.tensor([True]))
    with pytest.raises(ValueError, match=needle):
        kg.exp12_gather(tuple(planes), dst, *plan)


@pytest.mark.gpu
def test_pinned_planes_no_sync_and_graph_replay(kg):
    src = _experts(9, (64, 256), 4)
    c = encode(src, lambda shape, dtype: torch.empty(shape, dtype=dtype).pin_memory())
    dst = torch.zeros(5, 64, 256, dtype=torch.bfloat16, device="cuda")
    plan = [torch.tensor(x, device="cuda") for x in ([8, 2, 0], [4, 0, 1], [True, True, True])]
    torch.cuda.set_sync_debug_mode("error")
    try:
        kg.exp12_gather(c.planes, dst, *plan)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kg.exp12_gather(c.planes, dst, *plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for experts, slots, valid in (([1, 5, 7], [2, 3, 4], [True, False, True]),
                                  ([3, 3, 3], [0, 1, 2], [False, False, False])):
        before = dst.cpu()
        for t, v in zip(plan, (experts, slots, valid)):
            t.copy_(torch.tensor(v))
        graph.replay()
        torch.cuda.synchronize()
        want = _expected(src, before, torch.tensor(experts), torch.tensor(slots),
                         torch.tensor(valid))
        assert torch.equal(dst.cpu().view(torch.int16), want)


def test_decode_programs_leave_escaped_weights_to_the_patch_program(kg):
    """The two kinds of program write disjoint weights, so on a GPU neither waits on the other:
    with the escape lists emptied, the escaped positions keep dst's old value and the others
    are decoded."""
    src = _experts(2, (2, 128), 5)
    c = encode(src)
    escaped = c.esc_index[0][c.esc_index[0] >= 0].long()          # expert 0's
    assert escaped.numel() > 0
    c.esc_index.fill_(-1)
    dst = torch.full((1, 2, 128), -2.0, dtype=torch.bfloat16, device=DEVICE)
    plan = [torch.tensor(x, device=DEVICE) for x in ([0], [0], [True])]
    kg.exp12_gather(tuple(p.to(DEVICE) for p in c.planes), dst, *plan)
    got = dst.cpu().view(-1)
    keep = torch.zeros(256, dtype=torch.bool)
    keep[escaped] = True
    assert bool((got[keep] == -2.0).all())
    assert torch.equal(got[~keep].view(torch.int16), src[0].reshape(-1)[~keep].view(torch.int16))
