"""The C expert kernel against the per-expert torch loop reference (``torch_ref``)."""
from __future__ import annotations

import pytest
import torch

from vllm.kernels.cpu.ops import prepack
from vllm.model_executor.layers.fused_moe.cpu_kernel import expert_pairs_cpu
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation
from vllm.model_executor.layers.fused_moe.torch_ref import expert_pairs_ref


def _case(T, E=8, K=2, H=32, N=16, dtype=torch.float32, seed=0, skip_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * N, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(E, H, N, generator=g) * 0.2).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.zeros(0, K, dtype=torch.int64)
    if skip_frac:
        ids = torch.where(torch.rand(T, K, generator=g) < skip_frac, -1, ids)
    w = torch.rand(T, K, generator=g).to(dtype)
    return x, w13, w2, w, ids


def _ref_f32(x, w13, w2, w, ids, activation="silu"):
    """The reference in f32 on the same (possibly bf16-rounded) inputs."""
    out = torch.zeros(*ids.shape, x.shape[1])
    expert_pairs_ref(x.float(), w13.float(), w2.float(), w.float(), ids, out, activation)
    return out


# H, N: multiples of the 64-column block, a ragged last block, and columns outside any vector.
SHAPES = [(32, 16), (128, 64), (48, 20), (24, 7), (200, 96)]


@pytest.mark.parametrize("H,N", SHAPES)
@pytest.mark.parametrize("T", [1, 5, 67])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_matches_reference_f32(H, N, T, activation):
    x, w13, w2, w, ids = _case(T, H=H, N=N, seed=T + H)
    got = torch.zeros(T, 2, H)
    expert_pairs_cpu(x, prepack(w13), prepack(w2), w, ids, got, activation)
    torch.testing.assert_close(got, _ref_f32(x, w13, w2, w, ids, activation), atol=2e-5,
                               rtol=1e-4)


def _ref_bf16_hidden(x, w13, w2, w, ids):
    """The bf16 kernel's contract in f32 math: bf16 inputs, f32 accumulation, the hidden
    activation rounded to bf16 before the down projection (as the model's bf16 torch forward
    rounds it), the output rounded once."""
    out = torch.zeros(*ids.shape, x.shape[1])
    for (t, k), e in zip(torch.cartesian_prod(torch.arange(ids.shape[0]),
                                              torch.arange(ids.shape[1])).tolist(),
                         ids.flatten().tolist()):
        if e < 0:
            continue
        gate, up = (w13[e].float() @ x[t].float()).chunk(2)
        h = (torch.nn.functional.silu(gate) * up).bfloat16().float()
        out[t, k] = (w2[e].float() @ h) * w[t, k].float()
    return out


@pytest.mark.parametrize("H,N", SHAPES)
def test_matches_reference_bf16(H, N):
    x, w13, w2, w, ids = _case(33, H=H, N=N, dtype=torch.bfloat16, seed=H)
    got = torch.zeros(33, 2, H, dtype=torch.bfloat16)
    expert_pairs_cpu(x, prepack(w13), prepack(w2), w, ids, got)
    # Differs from the reference only in f32 summation order (and so, rarely, in which way a
    # hidden value rounds to bf16): within bf16 resolution.
    torch.testing.assert_close(got.float(), _ref_bf16_hidden(x, w13, w2, w, ids), atol=1e-2,
                               rtol=1e-2)


@pytest.mark.parametrize("H,N", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_biases_and_swigluoai_match_reference(H, N, dtype, tol):
    """GPT-OSS's experts: biases after each projection, the clamped activation (a small limit,
    so both clamps bite). bf16: the reference rounds after each op, the kernel adds the biases
    to its f32 accumulators: within bf16 resolution."""
    x, w13, w2, w, ids = _case(37, H=H, N=N, dtype=dtype, seed=N, skip_frac=0.2)
    g = torch.Generator().manual_seed(H)
    b13 = torch.randn(8, 2 * N, generator=g).to(dtype)
    b2 = torch.randn(8, H, generator=g).to(dtype)
    act = MoEActivation("swigluoai", alpha=1.702, limit=0.5)
    got = torch.zeros(37, 2, H, dtype=dtype)
    expert_pairs_cpu(x, prepack(w13), prepack(w2), w, ids, got, act, b13, b2)
    want = torch.zeros(37, 2, H)
    expert_pairs_ref(x.float(), w13.float(), w2.float(), w.float(), ids, want, act,
                     b13.float(), b2.float())
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("H,N", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_non_gated_relu2_matches_reference(H, N, dtype, tol, bias):
    """Nemotron-H's experts: w13 is the up projection alone [E, N, H], relu(up)^2, no gate.
    Squaring grows the values: the tolerance scales with the output's magnitude (bf16: the
    kernel rounds the f32 hidden once, the reference not at all)."""
    x, w13, w2, w, ids = _case(37, H=H, N=N, dtype=dtype, seed=N + 1, skip_frac=0.2)
    w13 = (w13[:, :N] * 0.5).contiguous()
    g = torch.Generator().manual_seed(H)
    b13, b2 = (torch.randn(8, n, generator=g).to(dtype) if bias else None for n in (N, H))
    got = torch.zeros(37, 2, H, dtype=dtype)
    expert_pairs_cpu(x, prepack(w13), prepack(w2), w, ids, got, "relu2_no_mul", b13, b2)
    want = torch.zeros(37, 2, H)
    expert_pairs_ref(x.float(), w13.float(), w2.float(), w.float(), ids, want, "relu2_no_mul",
                     *(None if b is None else b.float() for b in (b13, b2)))
    torch.testing.assert_close(got.float(), want, atol=tol * max(1.0, want.abs().max().item()),
                               rtol=tol)
    with pytest.raises(ValueError, match=r"do not match \[T, K\], \[G, N\*K\]"):
        expert_pairs_cpu(x, prepack(w13), prepack(w2[:, :, :-1]), w, ids, got, "relu2_no_mul")


def test_skipped_and_out_of_range_pairs_untouched():
    x, w13, w2, w, ids = _case(40, skip_frac=0.4, seed=3)
    ids[0, 0] = 8                                  # == E: out of range, skipped like -1
    got = torch.full((40, 2, 32), -3.0)
    expert_pairs_cpu(x, prepack(w13), prepack(w2), w, ids, got)
    valid = (ids >= 0) & (ids < 8)
    assert torch.equal(got[~valid], torch.full_like(got[~valid], -3.0))
    ref = _ref_f32(x, w13, w2, w, torch.where(valid, ids, -1))
    torch.testing.assert_close(got[valid], ref[valid], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pair_value_independent_of_batch_and_waves(dtype):
    """The invariant the expert cache's bitwise equality rests on."""
    x, w13, w2, w, ids = _case(37, E=6, K=3, H=80, N=40, dtype=dtype, seed=9)
    p13, p2 = prepack(w13), prepack(w2)
    whole = torch.zeros(37, 3, 80, dtype=dtype)
    expert_pairs_cpu(x, p13, p2, w, ids, whole)
    alone = torch.zeros_like(whole)
    for t in range(37):
        expert_pairs_cpu(x[t:t + 1], p13, p2, w[t:t + 1], ids[t:t + 1], alone[t:t + 1])
    assert torch.equal(alone, whole)
    waves = torch.zeros_like(whole)
    for lo in (0, 2, 4):                       # experts {0,1}, {2,3}, {4,5} in separate calls
        expert_pairs_cpu(x, p13, p2, w, torch.where((ids >= lo) & (ids < lo + 2), ids, -1), waves)
    assert torch.equal(waves, whole)


def test_empty_batch_and_no_valid_pair_leave_out_untouched():
    x, w13, w2, w, ids = _case(0)
    out = torch.zeros(0, 2, 32)
    expert_pairs_cpu(x, prepack(w13), prepack(w2), w, ids, out)   # no pairs: no error
    assert out.shape == (0, 2, 32)
    x, w13, w2, w, ids = _case(3)
    out = torch.full((3, 2, 32), 7.0)
    expert_pairs_cpu(x, prepack(w13), prepack(w2), w, torch.full_like(ids, -1), out)
    assert torch.equal(out, torch.full((3, 2, 32), 7.0))           # -1 ids: pairs not written
    ids[1, 0] = -1
    out = torch.full((3, 2, 32), 7.0)
    expert_pairs_cpu(x, prepack(w13), prepack(w2), w, ids, out)
    assert torch.equal(out[1, 0], torch.full((32,), 7.0))
    assert not torch.equal(out[1, 1], torch.full((32,), 7.0))       # its other pair was


def test_prepack_layout():
    """Written out by index: block b of 64 output columns is its [n, width] transpose."""
    w = torch.arange(130 * 3, dtype=torch.float32).reshape(130, 3)   # cols 130 = 64 + 64 + 2
    flat = prepack(w)
    expect = []
    for start in (0, 64, 128):
        width = min(64, 130 - start)
        expect += [w[start + c, i].item() for i in range(3) for c in range(width)]
    assert flat.tolist() == expect


def test_bad_inputs_named():
    x, w13, w2, w, ids = _case(4)
    out = torch.zeros(4, 2, 32)
    with pytest.raises(TypeError, match="share one dtype"):
        expert_pairs_cpu(x, prepack(w13).bfloat16(), prepack(w2), w, ids, out)
    with pytest.raises(ValueError, match="do not match"):
        expert_pairs_cpu(x, w13, w2, w, ids, out)          # not packed
    with pytest.raises(ValueError, match="contiguous"):
        expert_pairs_cpu(x, prepack(w13), prepack(w2), w, ids, out.transpose(0, 1))


def test_rejects_out_of_the_wrong_shape():
    x, w13, w2, w, ids = _case(4)
    with pytest.raises(ValueError, match="do not match"):
        expert_pairs_cpu(x, prepack(w13), prepack(w2), w, ids, torch.zeros(3, 2, 32))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("T,K,H", [(1, 1, 16), (7, 4, 48), (300, 8, 40)])
def test_moe_sum_matches_torch_sum(dtype, tol, T, K, H):
    from vllm.kernels.cpu.ops import moe_sum
    g = torch.Generator().manual_seed(T + K)
    pairs = (torch.randn(T, K, H, generator=g) * 3).to(dtype)
    got = moe_sum(pairs)
    assert got.shape == (T, H) and got.dtype == dtype
    # Reference: k order, in f32, rounded once.
    want = pairs[:, 0].float()
    for k in range(1, K):
        want = want + pairs[:, k].float()
    torch.testing.assert_close(got, want.to(dtype), atol=0, rtol=0)
    torch.testing.assert_close(got, pairs.sum(dim=1), atol=tol, rtol=tol)
