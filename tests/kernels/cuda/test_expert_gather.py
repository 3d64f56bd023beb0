"""The CUDA expert gather (csrc/moe/expert_gather.cu) against a plain torch loop: for each valid
plan entry, dst[slot] = src[expert]. Needs a CUDA GPU and a CUDA build (vllm._C)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops():
    from vllm.kernels.cuda import ops
    if not ops.load_cuda_ops():
        pytest.skip("vllm._C is not built: VLLM_TARGET_DEVICE=cuda pip install "
                    "--no-build-isolation -e .")
    return ops


def reference(src, dst, experts, slots, valid):
    out = dst.cpu().clone()
    for e, s, ok in zip(experts.tolist(), slots.tolist(), valid.tolist()):
        if ok:
            out[s] = src[e].cpu()
    return out


def plan(E, N, n_valid, g, device):
    experts = torch.randperm(E, generator=g)[:N].clone()
    slots = torch.randperm(N, generator=g)
    valid = torch.zeros(N, dtype=torch.bool)
    valid[:n_valid] = True
    experts[~valid] = -1                       # garbage ids where not valid: must not be read
    return experts.to(device), slots.to(device), valid.to(device)


# Rows of 6144, 60, 91, 2048, 40 and 6 bytes: every access width (16, 4, 1, 16, 8, 2 bytes).
@pytest.mark.parametrize("dtype,row", [(torch.bfloat16, (64, 48)), (torch.float32, (3, 5)),
                                       (torch.uint8, (7, 13)), (torch.float8_e4m3fn, (32, 64)),
                                       (torch.float32, (2, 5)), (torch.float16, (3,))])
@pytest.mark.parametrize("pinned_host", [True, False])
def test_matches_reference(ops, dtype, row, pinned_host):
    g = torch.Generator().manual_seed(0)
    E, N = 11, 6
    src = torch.randn(E, *row, generator=g).to(dtype)
    src = src.pin_memory() if pinned_host else src.cuda()
    dst = torch.randn(N, *row, generator=g).to(dtype).cuda()
    experts, slots, valid = plan(E, N, 4, g, "cuda")
    expected = reference(src, dst, experts, slots, valid)
    ops.expert_gather(src, dst, experts, slots, valid)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu().view(torch.uint8), expected.view(torch.uint8))


def test_large_rows_span_many_blocks(ops):
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, 255, (5, 3 * 65536 + 48), dtype=torch.uint8, generator=g).pin_memory()
    dst = torch.zeros(3, src.shape[1], dtype=torch.uint8, device="cuda")
    experts, slots, valid = (torch.tensor([4, 0, -1], device="cuda"),
                             torch.tensor([2, 0, 1], device="cuda"),
                             torch.tensor([True, True, False], device="cuda"))
    ops.expert_gather(src, dst, experts, slots, valid)
    assert torch.equal(dst.cpu(), reference(src, torch.zeros_like(dst), experts, slots, valid))


@pytest.mark.parametrize("pattern", ["scattered", "last only", "all", "none"])
def test_entries_past_the_grid_rows_are_copied(ops, pattern):
    """29 entries over the kernel's 8 rows of blocks (kEntryRows): each block walks entries y,
    y + 8, ...; valid ones anywhere, the last (row 4's fourth) included, with rows of several
    64 KiB chunks and kUnroll-wide loads ending in a partial pass. A block whose entries are all
    invalid leaves after reading their flags together; the others must still copy theirs."""
    g = torch.Generator().manual_seed(9)
    E, N, R = 40, 29, 2 * 65536 + 4096 + 48
    src = torch.randint(0, 255, (E, R), dtype=torch.uint8, generator=g).pin_memory()
    dst = torch.zeros(N, R, dtype=torch.uint8, device="cuda")
    experts = torch.randperm(E, generator=g)[:N].clone()
    slots = torch.randperm(N, generator=g)
    valid = {"scattered": torch.rand(N, generator=g) < 0.4,
             "last only": torch.arange(N) == N - 1, "all": torch.ones(N, dtype=torch.bool),
             "none": torch.zeros(N, dtype=torch.bool)}[pattern]
    experts[~valid] = -1
    experts, slots, valid = experts.cuda(), slots.cuda(), valid.cuda()
    ops.expert_gather(src, dst, experts, slots, valid)
    assert torch.equal(dst.cpu(), reference(src, torch.zeros_like(dst), experts, slots, valid))


def test_no_host_sync_and_graph_capturable(ops):
    g = torch.Generator().manual_seed(2)
    src = torch.randn(8, 4, 16, generator=g).pin_memory()
    dst = torch.zeros(4, 4, 16, device="cuda")
    experts, slots, valid = plan(8, 4, 3, g, "cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.expert_gather(src, dst, experts, slots, valid)     # warm-up, no sync allowed
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ops.expert_gather(src, dst, experts, slots, valid)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    dst.zero_()
    new = plan(8, 4, 4, torch.Generator().manual_seed(3), "cuda")
    for t, v in zip((experts, slots, valid), new):
        t.copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), reference(src, torch.zeros(4, 4, 16), *new))


def test_bad_arguments_name_the_problem(ops):
    src = torch.zeros(4, 8)                                    # not pinned
    dst = torch.zeros(2, 8, device="cuda")
    ids = torch.zeros(2, dtype=torch.long, device="cuda")
    ok = torch.ones(2, dtype=torch.bool, device="cuda")
    with pytest.raises(ValueError, match="expert_gather: a host src must be pinned"):
        ops.expert_gather(src, dst, ids, ids, ok)
    with pytest.raises(ValueError, match="same row shape"):
        ops.expert_gather(src.pin_memory(), torch.zeros(2, 9, device="cuda"), ids, ids, ok)
    with pytest.raises(ValueError, match="int64"):
        ops.expert_gather(src.pin_memory(), dst, ids.int(), ids, ok)


def test_the_compiled_checks_raise_into_python(ops):
    """The C++ checks behind the Python ones: their error reaches Python as a RuntimeError. In
    a subprocess: on the H100 image (torch 2.11, g++ 13.3 of /opt/gcc) a C++ exception thrown
    from vllm._C crashed the process (SIGSEGV), which must fail this test, not the session."""
    code = """if True:
        import torch, vllm._C
        src, dst = torch.zeros(4, 8), torch.zeros(2, 8, device="cuda")
        ids = torch.zeros(2, dtype=torch.long, device="cuda")
        ok = torch.ones(2, dtype=torch.bool, device="cuda")
        try:
            torch.ops._C.expert_gather(src, dst, ids, ids, ok)
        except RuntimeError as e:
            print(str(e).splitlines()[0])
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert "expert_gather: a host src must be pinned" in proc.stdout


def test_a_zero_byte_src_needs_no_pinning_and_copies_nothing(ops):
    """A store with no experts, or with empty rows, has no bytes to read: torch need not call its
    storage pinned, and the call returns without a launch (bad plans still raise)."""
    ids = torch.zeros(2, dtype=torch.long, device="cuda")
    ok = torch.ones(2, dtype=torch.bool, device="cuda")
    for src, dst in ((torch.empty(0, 8), torch.ones(2, 8, device="cuda")),
                     (torch.empty(4, 0), torch.ones(2, 0, device="cuda"))):
        before = dst.clone()
        ops.expert_gather(src, dst, ids, ids, ok)
        torch.cuda.synchronize()
        assert torch.equal(dst, before)
        with pytest.raises(ValueError, match="int64"):
            ops.expert_gather(src, dst, ids.int(), ids, ok)


def test_cuda_platform_hands_it_to_the_expert_cache(ops):
    """The CUDA platform hands the kernels to the expert cache's copy engine."""
    from vllm.platforms import platform_for
    assert platform_for("cuda").expert_copy_kernel() is ops.expert_gather
    if ops.has_expert_gather_many():
        assert platform_for("cuda").expert_copy_many_kernel() is ops.expert_gather_many


def _layer(g, E, pinned_host):
    """A GPTQ-like layer's tensors with E experts: every access width (rows of 6144, 60, 91,
    2048, 40 and 6 bytes) and dtype, plus 12 more small ones (18 tensors: two launches)."""
    shapes = [(torch.bfloat16, (64, 48)), (torch.float32, (3, 5)), (torch.uint8, (7, 13)),
              (torch.int32, (16, 32)), (torch.float32, (2, 5)), (torch.float16, (3,))]
    shapes += [(torch.int32, (i + 1,)) for i in range(12)]
    srcs = [torch.randn(E, *row, generator=g).mul(100).to(dtype) for dtype, row in shapes]
    return [s.pin_memory() if pinned_host else s.cuda() for s in srcs]


@pytest.mark.parametrize("pinned_host", [True, False])
def test_many_matches_the_reference_for_every_tensor(ops, pinned_host):
    if not ops.has_expert_gather_many():
        pytest.skip("this vllm._C predates expert_gather_many: rebuild it")
    g = torch.Generator().manual_seed(4)
    E, N = 11, 6
    srcs = _layer(g, E, pinned_host)
    dsts = [torch.full((N, *s.shape[1:]), 7, dtype=s.dtype, device="cuda") for s in srcs]
    experts, slots, valid = plan(E, N, 4, g, "cuda")
    before = [d.cpu().clone() for d in dsts]
    ops.expert_gather_many(srcs, dsts, experts, slots, valid)
    torch.cuda.synchronize()
    for src, dst, old in zip(srcs, dsts, before):
        assert torch.equal(dst.cpu(), reference(src, old, experts, slots, valid))


def test_many_is_graph_capturable_without_a_host_sync(ops):
    from gather_replay import check_graph_replay
    if not ops.has_expert_gather_many():
        pytest.skip("this vllm._C predates expert_gather_many: rebuild it")
    g = torch.Generator().manual_seed(5)
    srcs = _layer(g, 8, True)
    dsts = [torch.zeros(4, *s.shape[1:], dtype=s.dtype, device="cuda") for s in srcs]
    check_graph_replay(ops.expert_gather_many, srcs, dsts, plan(8, 4, 3, g, "cuda"),
                       plan(8, 4, 4, torch.Generator().manual_seed(6), "cuda"), reference)


def test_many_refuses_tensors_that_disagree(ops):
    if not ops.has_expert_gather_many():
        pytest.skip("this vllm._C predates expert_gather_many: rebuild it")
    ids = torch.zeros(2, dtype=torch.long, device="cuda")
    ok = torch.ones(2, dtype=torch.bool, device="cuda")
    a, b = torch.zeros(4, 8).pin_memory(), torch.zeros(5, 8).pin_memory()
    dst = [torch.zeros(2, 8, device="cuda"), torch.zeros(2, 8, device="cuda")]
    with pytest.raises(ValueError, match="tensor 1 has 5 experts"):
        ops.expert_gather_many([a, b], dst, ids, ids, ok)
    with pytest.raises(ValueError, match="as many srcs as dsts, at least one: got 1 and 2"):
        ops.expert_gather_many([a], dst, ids, ids, ok)
    with pytest.raises(ValueError, match="host src must be pinned"):
        ops.expert_gather_many([torch.zeros(4, 8)], dst[:1], ids, ids, ok)
