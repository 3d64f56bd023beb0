"""The Triton expert gather (``vllm/kernels/triton/expert_gather.py``) against a plain torch
reference (index_copy over the valid, in-range entries, on raw bytes), and how the CUDA platform
and the expert cache's copy engine find it.

Without a GPU the kernel runs under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1); on a GPU the same tests run the compiled kernel reading a pinned host src
into CUDA slots, and the ``gpu`` tests add a CUDA graph capture and rows past 2 GiB.
"""
from __future__ import annotations

import sys

import pytest
import torch
from triton_kernels import triton_module

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHUNK = 1024 * 8          # words per program (BLOCK * ITERS), checked below


@pytest.fixture(scope="module")
def eg():
    """The module, compiled on a GPU, else interpreted."""
    expert_gather = triton_module("expert_gather")
    assert expert_gather.BLOCK * expert_gather.ITERS == CHUNK
    return expert_gather


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[R, ...] contiguous -> [R, row bytes] uint8, the same memory."""
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def reference(src, dst, experts, slots, valid):
    """dst after the gather, on the CPU: valid entries with 0 <= expert < E, 0 <= slot < N."""
    experts, slots, valid = experts.cpu(), slots.cpu(), valid.cpu()
    E, N = src.shape[0], dst.shape[0]
    keep = valid & (experts >= 0) & (experts < E) & (slots >= 0) & (slots < N)
    idx = keep.nonzero().squeeze(1)
    out = dst.cpu().clone()
    if idx.numel():
        _bytes(out).index_copy_(0, slots[idx], _bytes(src.cpu()).index_select(0, experts[idx]))
    return out


def rows(dtype, E, row, g):
    """[E, *row] of ``dtype`` with random bits (float8 and packed ints from raw bytes)."""
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.randn(E, *row, generator=g).to(dtype)
    nbytes = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (E, *row[:-1], row[-1] * nbytes), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


GARBAGE = (-1, 2 ** 62, -(2 ** 40), 10 ** 9)
"""Ids an invalid entry may hold: the kernel must not read their rows."""


def make_plan(E, N, n_valid, g, n=None):
    """n entries (default N): n_valid at random positions load distinct experts into distinct
    slots; the others hold garbage ids, every other one in range (stale ids of an earlier plan:
    only valid[i] says not to copy them)."""
    n = N if n is None else n
    valid = torch.zeros(n, dtype=torch.bool)
    valid[torch.randperm(n, generator=g)[:n_valid]] = True
    experts = torch.full((n,), -1, dtype=torch.int64)
    slots = torch.full((n,), -1, dtype=torch.int64)
    experts[valid] = torch.randperm(E, generator=g)[:n_valid]
    slots[valid] = torch.randperm(N, generator=g)[:n_valid]
    bad = (~valid).nonzero().squeeze(1)
    for j, i in enumerate(bad.tolist()):
        experts[i], slots[i] = (GARBAGE[j % 4], GARBAGE[(j + 1) % 4]) if j % 2 == 0 else \
            (j % E, j % N)
    return experts, slots, valid


def run(eg, src, dst, experts, slots, valid):
    """The gather on DEVICE (src pinned host memory on a GPU); returns dst on the CPU."""
    if DEVICE == "cuda":
        src = src if src.is_pinned() else src.pin_memory()
        dst = dst.cuda()
        experts, slots, valid = experts.cuda(), slots.cuda(), valid.cuda()
    eg.expert_gather(src, dst, experts, slots, valid)
    return dst.cpu()


def check(eg, src, dst, experts, slots, valid):
    want = reference(src, dst, experts, slots, valid)
    got = run(eg, src, dst.clone(), experts, slots, valid)
    assert torch.equal(_bytes(got), _bytes(want))


CASES = [  # dtype, row shape: bytes per row and the word they move as
    (torch.float32, (3, 5)),              # 60 B: int32 words
    (torch.bfloat16, (64, 48)),           # 6144 B: int64
    (torch.float16, (7, 3)),              # 42 B: int16
    (torch.float8_e4m3fn, (5, 7)),        # 35 B: uint8 (NaN bit patterns included)
    (torch.float8_e4m3fn, (32, 64)),      # 2048 B: int64
    (torch.uint8, (7, 13)),               # 91 B: uint8
    (torch.int32, (4, 16)),               # packed int4 nibbles, 256 B: int64
    (torch.float32, (2 * CHUNK + 3,)),    # 65548 B: int32, 3 chunks, the last partial
    (torch.uint8, (2 * CHUNK + 37,)),     # 16421 B: uint8, 3 chunks, the last partial
]


@pytest.mark.parametrize("dtype,row", CASES)
def test_matches_reference(eg, dtype, row):
    g = torch.Generator().manual_seed(len(row) * 1000 + row[-1])
    E, N = 11, 6
    src, dst = rows(dtype, E, row, g), rows(dtype, N, row, g)
    check(eg, src, dst, *make_plan(E, N, 4, g))


@pytest.mark.parametrize("dtype,row,word", [
    (torch.float32, (3, 5), torch.int32), (torch.bfloat16, (64, 48), torch.int64),
    (torch.float16, (7, 3), torch.int16), (torch.uint8, (7, 13), torch.uint8),
    (torch.int32, (4, 16), torch.int64)])
def test_rows_move_as_the_widest_word(eg, dtype, row, word):
    src = torch.zeros(3, *row, dtype=dtype)
    nbytes = src[0].numel() * src.element_size()
    assert eg._word(nbytes, src, src)[1] == word


def test_misaligned_bases_move_bytes(eg):
    """A src starting one byte into its storage: no wider word divides its address."""
    g = torch.Generator().manual_seed(5)
    E, N, R = 6, 4, 32
    buf = torch.randint(0, 256, (1 + E * R,), dtype=torch.uint8, generator=g)
    src = (buf.pin_memory() if DEVICE == "cuda" else buf)[1:].view(E, R)
    assert eg._word(R, src, torch.zeros(N, R, dtype=torch.uint8))[1] == torch.uint8
    check(eg, src, torch.zeros(N, R, dtype=torch.uint8), *make_plan(E, N, 3, g))


def test_every_entry_valid_the_worst_case(eg):
    """n = N entries, all misses: the whole grid works."""
    g = torch.Generator().manual_seed(6)
    E, N = 40, 32
    src, dst = rows(torch.bfloat16, E, (8, 24), g), rows(torch.bfloat16, N, (8, 24), g)
    experts, slots, valid = make_plan(E, N, N, g)
    assert bool(valid.all())
    check(eg, src, dst, experts, slots, valid)


@pytest.mark.parametrize("n_valid", [1, 5, 21])
def test_entries_past_the_grid_rows_are_copied(eg, n_valid):
    """n = 29 entries over ENTRY_ROWS = 8 rows of programs: each program walks entries y,
    y + 8, ...; valid ones anywhere (the last, 28, included), the rest skipped."""
    assert eg.ENTRY_ROWS == 8
    g = torch.Generator().manual_seed(60 + n_valid)
    E, N = 40, 29
    src, dst = rows(torch.float32, E, (3, 5), g), rows(torch.float32, N, (3, 5), g)
    experts, slots, valid = make_plan(E, N, n_valid, g)
    if n_valid == 1:                          # only the last entry, in the last program row
        valid[:] = False
        valid[-1], experts[-1], slots[-1] = True, 7, 11
    check(eg, src, dst, experts, slots, valid)


def test_all_invalid_leaves_dst_alone(eg):
    g = torch.Generator().manual_seed(7)
    src, dst = rows(torch.float32, 5, (4, 4), g), rows(torch.float32, 3, (4, 4), g)
    experts, slots, valid = make_plan(5, 3, 0, g)
    assert not bool(valid.any()) and int(experts.min()) < 0
    assert torch.equal(run(eg, src, dst.clone(), experts, slots, valid), dst)


def test_out_of_range_ids_on_valid_entries_are_skipped(eg):
    """A kernel cannot raise: valid entries naming an expert outside [0, E) or a slot outside
    [0, N) copy nothing; the in-range entries still copy."""
    g = torch.Generator().manual_seed(8)
    E, N = 5, 4
    src, dst = rows(torch.float16, E, (3, 8), g), rows(torch.float16, N, (3, 8), g)
    experts = torch.tensor([E, -1, 2, 1, 2 ** 62, 4, 0])
    slots = torch.tensor([0, 1, N, -3, 2, 3, 1])
    valid = torch.ones(7, dtype=torch.bool)
    want = reference(src, dst, experts, slots, valid)
    got = run(eg, src, dst.clone(), experts, slots, valid)
    assert torch.equal(got[[0, 2]], dst[[0, 2]])                 # targeted only by bad entries
    assert torch.equal(got[3], src[4]) and torch.equal(got[1], src[0])
    assert torch.equal(_bytes(got), _bytes(want))


def test_more_entries_than_slots_and_empty_cases(eg):
    """n is the plan's length (N in the engine); any n <= 65535 works. n = 0 launches nothing."""
    g = torch.Generator().manual_seed(9)
    E, N = 12, 3
    src, dst = rows(torch.float32, E, (2, 2), g), rows(torch.float32, N, (2, 2), g)
    check(eg, src, dst, *make_plan(E, N, 3, g, n=9))
    empty = torch.empty(0, dtype=torch.int64)
    assert torch.equal(run(eg, src, dst.clone(), empty, empty, empty.bool()), dst)


def _args(device=DEVICE, **kw):
    """Good arguments on ``device`` (src pinned host memory for CUDA), overridden by kw (moved to
    ``device``; src stays on the host)."""
    i64 = torch.int64
    a = dict(src=torch.zeros(4, 8), dst=torch.zeros(2, 8), experts=torch.zeros(2, dtype=i64),
             slots=torch.zeros(2, dtype=i64), valid=torch.ones(2, dtype=torch.bool))
    a.update(kw)
    a = {k: v if k == "src" else v.to(device) for k, v in a.items()}
    if device == "cuda":
        a["src"] = a["src"].pin_memory()
    return a


@pytest.mark.parametrize("kw,match", [
    (dict(dst=torch.zeros(2, 8, dtype=torch.float16)), "src dtype torch.float32 != dst dtype"),
    (dict(dst=torch.zeros(2, 9)), "same row shape"),
    (dict(dst=torch.zeros(8, 2).t()), "dst must be a contiguous tensor"),
    (dict(src=torch.zeros(8, 4).t()), "src must be a contiguous tensor"),
    (dict(src=torch.tensor(1.0)), r"src must be a contiguous tensor of rows"),
    (dict(experts=torch.zeros(2, dtype=torch.int32)), "experts must be a contiguous 1-D "
                                                      "torch.int64"),
    (dict(slots=torch.zeros(4, dtype=torch.int64)[::2]), "slots must be a contiguous"),
    (dict(valid=torch.ones(2, dtype=torch.uint8)), "valid must be a contiguous 1-D torch.bool"),
    (dict(valid=torch.ones(3, dtype=torch.bool)), "one entry each per plan entry, got 2, 2, 3"),
    (dict(experts=torch.zeros(65536, dtype=torch.int64),
          slots=torch.zeros(65536, dtype=torch.int64),
          valid=torch.zeros(65536, dtype=torch.bool)), "at most 65535 plan entries"),
])
def test_bad_arguments_name_the_problem(eg, kw, match):
    with pytest.raises(ValueError, match=match):
        eg.expert_gather(**_args(**kw))


def test_cpu_tensors_only_under_the_interpreter(eg, monkeypatch):
    monkeypatch.setattr(eg, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="on CPU tensors only under TRITON_INTERPRET=1"):
        eg.expert_gather(**_args("cpu"))


# ---- the platform and the copy engine --------------------------------------------------------
def test_cuda_platform_prefers_vllm_c_then_triton(monkeypatch):
    from vllm.kernels.cuda import ops as cuda_ops
    from vllm.kernels.triton.expert_gather import expert_gather
    from vllm.platforms.cuda import CudaPlatform
    monkeypatch.setattr(cuda_ops, "load_cuda_ops", lambda: True)
    assert CudaPlatform().expert_copy_kernel() is cuda_ops.expert_gather
    monkeypatch.setattr(cuda_ops, "load_cuda_ops", lambda: False)
    assert CudaPlatform().expert_copy_kernel() is expert_gather


def test_without_triton_no_kernel_and_one_warning(monkeypatch, vllm_log):
    from vllm.kernels.cuda import ops as cuda_ops
    from vllm.platforms import cuda as cuda_platform
    monkeypatch.setattr(cuda_ops, "load_cuda_ops", lambda: False)
    monkeypatch.setitem(sys.modules, "vllm.kernels.triton.expert_gather", None)  # ImportError
    cuda_platform._triton_expert_gather.cache_clear()
    try:
        assert cuda_platform.CudaPlatform().expert_copy_kernel() is None
        assert cuda_platform.CudaPlatform().expert_copy_kernel() is None     # cached
        assert vllm_log.text.count("'triton' package") == 1
        assert "vllm._C" in vllm_log.text and "pip install triton" in vllm_log.text
    finally:
        cuda_platform._triton_expert_gather.cache_clear()


def _provider():
    """A cached layer's provider on CPU tensors (its step and copy are swapped per test)."""
    from vllm.model_executor.layers.fused_moe.expert_cache.policy import get_policy
    from vllm.model_executor.layers.fused_moe.expert_cache.provider import CachedWeightProvider
    from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency
    from vllm.model_executor.layers.fused_moe.expert_cache.store import HostStore
    weights = {"w13_weight": torch.arange(6 * 8.).view(6, 2, 4),
               "w13_scale": torch.arange(6.).view(6, 1).to(torch.float8_e4m3fn)}
    store = HostStore.from_experts(weights, lambda t: t, None)
    slots = {n: torch.zeros(3, *t.shape[1:], dtype=t.dtype) for n, t in weights.items()}
    return CachedWeightProvider(store, slots, Residency(6, 3, get_policy("lru")), "lru")


def test_cached_layer_is_capturable_with_the_triton_step_and_gather(monkeypatch):
    """CUDA slots with a pinned store copy through ``CudaKernelCopy``: sync-free with the Triton
    gather, so with the Triton residency step the layer has no CUDA graph refusal."""
    from vllm.kernels.cuda import ops as cuda_ops
    from vllm.model_executor.layers.fused_moe.expert_cache import copy as copy_mod
    from vllm.model_executor.layers.fused_moe.expert_cache.residency_step import (
        select_residency_step)
    monkeypatch.setattr(cuda_ops, "load_cuda_ops", lambda: False)
    monkeypatch.setattr(copy_mod, "_cuda_copy_kernel", None)
    p = _provider()
    p.store.pinned = True                         # as from_experts pins it on a CUDA machine
    p.copy = copy_mod.select_copy(p.store, torch.device("cuda"))
    p.step = select_residency_step(p.residency, torch.device("cuda"))
    assert isinstance(p.copy, copy_mod.CudaKernelCopy) and p.copy.sync_free
    assert p.step.name == "triton"
    assert p.cuda_graph_refusal() is None


def test_cuda_copy_engine_runs_the_triton_gather_per_tensor(eg, monkeypatch):
    """``_copy_cuda`` (the CUDA path) with the platform's Triton kernel copies every tensor of
    the store (here CPU tensors, interpreted)."""
    if DEVICE != "cpu":
        pytest.skip("drives CPU tensors through the interpreter")
    from vllm.kernels.cuda import ops as cuda_ops
    from vllm.model_executor.layers.fused_moe.expert_cache import copy as copy_mod
    from vllm.model_executor.layers.fused_moe.expert_cache.residency import LoadPlan
    monkeypatch.setattr(cuda_ops, "load_cuda_ops", lambda: False)
    monkeypatch.setattr(copy_mod, "_cuda_copy_kernel", None)
    p = _provider()
    plan = LoadPlan(slots=torch.tensor([2, -1, 0]), experts=torch.tensor([5, -1, 1]),
                    valid=torch.tensor([True, False, True]))
    copy_mod._copy_cuda(p.store, p.slots, plan)
    for name, src in p.store.tensors.items():
        want = reference(src, torch.zeros_like(p.slots[name]), plan.experts, plan.slots,
                         plan.valid)
        assert torch.equal(_bytes(p.slots[name]), _bytes(want)), name


# ---- on a GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_pinned_host_src_no_sync_and_graph_replay_with_new_plans(eg):
    """Reads the pinned store in place without a host sync; a captured copy replays with new
    plan contents (passed on an H100, 2026-11-26)."""
    g = torch.Generator().manual_seed(10)
    E, N = 9, 5
    src = rows(torch.bfloat16, E, (16, 40), g).pin_memory()
    dst = torch.zeros(N, 16, 40, dtype=torch.bfloat16, device="cuda")
    plan = [t.cuda() for t in make_plan(E, N, 3, g)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        eg.expert_gather(src, dst, *plan)                      # warm-up: compiles, no sync
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eg.expert_gather(src, dst, *plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed, n_valid in ((11, 5), (12, 0), (13, 2)):
        new = make_plan(E, N, n_valid, torch.Generator().manual_seed(seed))
        for t, v in zip(plan, new):
            t.copy_(v)
        before = dst.cpu()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bytes(dst.cpu()), _bytes(reference(src, before, *new)))


@pytest.mark.gpu
def test_src_on_the_device_and_rows_past_2_gib(eg):
    """A src already on dst's device; and expert 2 of rows of 1 GiB + 16 B, which starts past
    2^31 bytes (int64 offsets). An unpinned host src is refused. Passed on an H100 (2026-11-26)."""
    g = torch.Generator().manual_seed(14)
    a = _args("cuda")
    with pytest.raises(ValueError, match="host src must be pinned"):
        eg.expert_gather(**dict(a, src=torch.zeros(4, 8)))
    with pytest.raises(ValueError, match="src on meta: must be pinned host memory"):
        eg.expert_gather(**dict(a, src=torch.zeros(4, 8, device="meta")))
    src = rows(torch.float16, 7, (3, 33), g).cuda()
    dst = torch.zeros(4, 3, 33, dtype=torch.float16, device="cuda")
    plan = make_plan(7, 4, 3, g)
    eg.expert_gather(src, dst, *[t.cuda() for t in plan])
    assert torch.equal(dst.cpu(), reference(src, torch.zeros(4, 3, 33, dtype=torch.float16),
                                            *plan))
    R = 2 ** 30 + 16
    big = torch.empty(3, R, dtype=torch.uint8, pin_memory=True)
    tail = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
    big[2, :1 << 20] = tail.flip(0)
    big[2, -(1 << 20):] = tail
    out = torch.zeros(1, R, dtype=torch.uint8, device="cuda")
    ids = torch.tensor([2], device="cuda")
    eg.expert_gather(big, out, ids, torch.tensor([0], device="cuda"),
                     torch.tensor([True], device="cuda"))
    assert torch.equal(out[0, -(1 << 20):].cpu(), tail)
    assert torch.equal(out[0, :1 << 20].cpu(), tail.flip(0))


@pytest.mark.gpu
def test_a_zero_byte_src_needs_no_pinning_and_copies_nothing(eg):
    """A store with no experts, or with empty rows: nothing to read, so an unpinned (empty) host
    src is not refused and nothing is launched. Passed on an H100 (2026-11-26)."""
    a = _args("cuda")
    for src, dst in ((torch.empty(0, 8), torch.ones(2, 8, device="cuda")),
                     (torch.empty(4, 0), torch.ones(2, 0, device="cuda"))):
        eg.expert_gather(**dict(a, src=src, dst=dst))
        assert torch.equal(dst.cpu(), torch.ones(dst.shape))
