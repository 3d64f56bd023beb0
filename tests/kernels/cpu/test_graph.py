"""CPU graphs (``vllm/kernels/cpu/graph.py`` + ``graph.c``): a captured block replayed on new
inputs (written into the tensors the capture read) must give what running the block eagerly on
those inputs gives, bit for bit; the reference is torch itself and the eager kernel calls."""
from __future__ import annotations

import ctypes

import pytest
import torch

from vllm.kernels.cpu import ops
from vllm.kernels.cpu.build import load_cpu_kernels
from vllm.kernels.cpu.graph import CpuGraph, GraphCaptureError, capture


def _captured(fn, *inputs):
    """(graph, output of the capture run) for fn(*inputs)."""
    g = CpuGraph()
    with torch.inference_mode(), capture(g):
        out = fn(*inputs)
    g.finish()
    return g, out


def _refill(gen, *tensors):
    with torch.inference_mode():
        for t in tensors:
            t.copy_((torch.randn(t.shape, generator=gen) * 5).to(t.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 16, 37, 1000])
def test_add_convert_zero_nodes_match_torch(dtype, n):
    gen = torch.Generator().manual_seed(n)
    a, b = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    buf = torch.empty(3, n, dtype=dtype)
    _refill(gen, a, b, buf)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16

    def block(a, b, buf):
        s = a + b                                  # add node
        c = s.to(other)                            # convert node
        buf.zero_()                                # zero node
        return s, c, c.to(dtype)                   # and back
    g, (s, c, back) = _captured(block, a, b, buf)
    assert g.num_nodes == 4
    for seed in range(3):
        _refill(torch.Generator().manual_seed(seed), a, b, buf)
        g.replay()
        want = block(a, b, buf.clone())
        for got, exp in zip((s, c, back), want):
            assert torch.equal(got.view(torch.int16 if got.dtype == torch.bfloat16 else
                                        torch.int32),
                               exp.view(torch.int16 if exp.dtype == torch.bfloat16 else
                                        torch.int32))
        assert not buf.any()


def test_bf16_rounding_of_special_sums_matches_torch():
    """The add node rounds f32 sums to bf16 as torch does, vector lanes included: ties to
    even, denormal results (the vector instruction would flush them, so a vector holding one
    takes the integer path), infinities and overflow; NaN stays NaN (torch's own NaN bits
    differ between its code paths, so only NaN-ness is compared)."""
    tiny = 2.0 ** -133                                    # a bf16 denormal
    nan, inf = float("nan"), float("inf")
    a = [1.0, 1.0078125, -1.0, 3.0, 2.0 ** -126] * 3 + [1.5]              # vector 0: normal
    b = [2.0 ** -8, 2.0 ** -8, -2.0 ** -8, 2.0 ** -7, 0.0] * 3 + [0.25]   # (ties to even)
    a += [0.5] * 7 + [tiny] + [0.75] * 8                  # vector 1: one denormal sum
    b += [0.25] * 7 + [tiny] + [2.0 ** -9] * 8
    a += [nan, inf, -inf, 3.0e38, -3.0e38, 0.0, -0.0, 1.0] * 2
    b += [1.0, 1.0, 2.0, 3.0e38, -3.0e38, -0.0, -0.0, nan] * 2
    a += [tiny, -tiny, 0.0]                               # scalar tail
    b += [tiny, 0.0, -tiny]
    x = torch.tensor(a).to(torch.bfloat16)
    y = torch.tensor(b).to(torch.bfloat16)
    g, out = _captured(lambda u, v: u + v, x, y)
    g.replay()
    want = x + y
    assert torch.equal(out.isnan(), want.isnan()) and int(want.isnan().sum()) == 4
    assert torch.equal(out.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])


def test_embedding_node_matches_torch_and_reports_a_bad_id():
    weight = torch.randn(50, 24, dtype=torch.bfloat16)
    ids = torch.tensor([3, 0, 49, 3])
    g, out = _captured(lambda i: torch.nn.functional.embedding(i, weight), ids)
    ids.copy_(torch.tensor([7, 8, 1, 48]))
    g.replay()
    assert torch.equal(out, weight[[7, 8, 1, 48]])
    ids[2] = 50
    with pytest.raises(RuntimeError, match=r"node 0 \(embedding\) failed with code -2"):
        g.replay()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_calls_replay_on_new_inputs(dtype):
    """Kernels recorded through ``launch`` (a dense layer, RMSNorm, the MoE combine) read the
    new inputs on replay and write the capture's output tensors."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 32, generator=gen).to(dtype)
    packed = ops.prepack(w)
    norm_w = torch.randn(40, generator=gen).to(dtype)
    x = torch.empty(5, 32, dtype=dtype)
    pairs = torch.empty(5, 3, 40, dtype=dtype)
    _refill(gen, x, pairs)

    def block(x, pairs):
        y = ops.dense_linear(x, packed, 40)
        return ops.rms_norm(y, norm_w, 1e-6), ops.moe_sum(pairs)
    g, outs = _captured(block, x, pairs)
    assert g.num_nodes == 3
    for seed in range(3):
        _refill(torch.Generator().manual_seed(seed + 10), x, pairs)
        g.replay()
        for got, want in zip(outs, block(x, pairs)):
            assert torch.equal(got, want)


def test_an_op_without_a_node_refuses_the_capture():
    x = torch.randn(4, 8)
    with pytest.raises(GraphCaptureError, match="mul"):
        _captured(lambda t: t * 2, x)
    with pytest.raises(GraphCaptureError, match="argmax_rows"):   # a kernel the graph lacks
        _captured(ops.argmax_rows, x)
    with pytest.raises(GraphCaptureError, match="add of"):        # broadcasting add
        _captured(lambda t: t + t[0], x)


def test_run_graph_rejects_a_malformed_program():
    lib = load_cpu_kernels()
    failed = ctypes.c_int64(-1)
    for prog in ([999, 0], [0, 2, 1, 2], [11]):     # unknown op, wrong arg count, truncated
        buf = torch.tensor(prog, dtype=torch.int64)
        assert lib.run_graph(buf.data_ptr(), buf.numel(), ctypes.byref(failed)) == -3
        assert failed.value == 0
