"""The Triton fused-MoE kernels (``vllm/kernels/triton/fused_moe.py``) against plain references
written here: ``moe_align_block_size`` against a Python loop, and the fused experts against a
dense fp32 loop over each token's top-k choices (not the code under test, nor torch_ref).

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py), in fp32 and fp16 only: the interpreter's tl.dot is wrong on bf16 inputs
(numpy has no bf16), so bf16 is checked by the ``gpu`` test on CUDA.
"""
from __future__ import annotations

import pytest
import torch
from triton_kernels import triton_module
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACTIVATIONS = ("silu", "gelu", "swigluoai", "relu2_no_mul")
ALPHA, LIMIT = 1.702, 7.0


@pytest.fixture(scope="module")
def km():
    """The kernel module, compiled on a GPU, else interpreted."""
    return triton_module("fused_moe")


# ---- references ----------------------------------------------------------------------------
def align_ref(ids: list[int], block_m: int, E: int):
    """Per expert in id order: its pair indices ascending, padded with P to a block_m multiple."""
    P = len(ids)
    out, experts = [], []
    for e in range(E):
        group = [p for p, i in enumerate(ids) if i == e]
        if not group:
            continue
        group += [P] * (-len(group) % block_m)
        out += group
        experts += [e] * (len(group) // block_m)
    return out, experts


def act_ref(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu2_no_mul":
        return F.relu(h) ** 2
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return gate * torch.sigmoid(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
    return (up + 1) * gate * torch.sigmoid(ALPHA * gate)


def moe_ref(x, w13, w2, topk_w, ids, activation="silu", b13=None, b2=None, chunk=256):
    """fp32 pairs [T, K, H]: for each token t and choice k with 0 <= ids[t, k] < G,
    topk_w[t, k] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e]); other pairs NaN."""
    x, w13, w2, topk_w = x.float(), w13.float(), w2.float(), topk_w.float()
    T, K = ids.shape
    G, H = w2.shape[:2]
    out = torch.full((T, K, H), float("nan"), device=x.device)
    for t0 in range(0, T, chunk):                    # tokens in chunks, then each choice k
        for k in range(K):
            e = ids[t0:t0 + chunk, k]
            ok = (e >= 0) & (e < G)
            e = e.clamp(0, G - 1)
            h = torch.einsum("th,tnh->tn", x[t0:t0 + chunk], w13[e])
            if b13 is not None:
                h = h + b13.float()[e]
            y = torch.einsum("tn,thn->th", act_ref(h, activation), w2[e])
            if b2 is not None:
                y = y + b2.float()[e]
            y = y * topk_w[t0:t0 + chunk, k, None]
            out[t0:t0 + chunk, k] = torch.where(ok[:, None], y, out[t0:t0 + chunk, k])
    return out


def make(T, E, K, H, N, dtype=torch.float32, activation="silu", bias=False, seed=0,
         G=None, device=DEVICE):
    """Random inputs; ids are K distinct experts per token out of E, and G >= E weight rows."""
    g = torch.Generator().manual_seed(seed)
    G = G or E
    rows = 2 * N if activation != "relu2_no_mul" else N
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(G, rows, H, generator=g) / H ** 0.5
    w2 = torch.randn(G, H, N, generator=g) / N ** 0.5
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    w = torch.rand(T, K, generator=g)
    b13 = torch.randn(G, rows, generator=g) * 0.5 if bias else None
    b2 = torch.randn(G, H, generator=g) * 0.5 if bias else None
    cast = lambda t: None if t is None else t.to(dtype).to(device)   # noqa: E731
    return cast(x), cast(w13), cast(w2), cast(w), ids.to(device), cast(b13), cast(b2)


def check(km, T, E, K, H, N, dtype=torch.float32, activation="silu", bias=False, seed=0,
          config=None):
    x, w13, w2, w, ids, b13, b2 = make(T, E, K, H, N, dtype, activation, bias, seed)
    got = km.fused_moe(x, w13, w2, w, ids, activation, ALPHA, LIMIT, b13, b2, config=config)
    want = moe_ref(x, w13, w2, w, ids, activation, b13, b2).sum(dim=1)
    assert got.dtype == dtype and got.shape == (T, H)
    # bf16: the torch backends' own bf16 error against this reference reaches ~5e-2 (relu^2).
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


# ---- moe_align_block_size ------------------------------------------------------------------
@pytest.mark.parametrize("T,K,E,block_m", [(1, 1, 1, 16), (5, 2, 7, 16), (37, 4, 13, 16),
                                           (64, 2, 8, 64), (300, 3, 5, 32), (3, 2, 40, 16),
                                           (0, 2, 4, 16)])
def test_align_matches_python_reference(km, T, K, E, block_m):
    g = torch.Generator().manual_seed(T * 31 + E)
    ids = torch.randint(-1, E + 2, (T, K), generator=g)             # -1 and >= E: skipped
    sorted_ids, block_expert, num_padded = km.moe_align_block_size(ids.to(DEVICE), block_m, E)
    P = T * K
    want, experts = align_ref(ids.flatten().tolist(), block_m, E)
    S = -(-(P + min(E, P) * (block_m - 1)) // block_m) * block_m    # fixed worst case
    assert sorted_ids.dtype == block_expert.dtype == num_padded.dtype == torch.int64
    assert sorted_ids.shape == (S,) and block_expert.shape == (S // block_m,)
    assert num_padded.tolist() == [len(want)]
    assert sorted_ids.tolist() == want + [P] * (S - len(want))      # padding: the sentinel P
    assert block_expert.tolist() == experts + [-1] * (S // block_m - len(experts))


def test_align_rejects_bad_arguments(km):
    ids = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="block_m=0"):
        km.moe_align_block_size(ids, 0, 4)
    with pytest.raises(ValueError, match="num_experts=0"):
        km.moe_align_block_size(ids, 16, 0)
    with pytest.raises(ValueError, match="must be integer, not torch.float32"):
        km.moe_align_block_size(ids.float(), 16, 4)


# ---- fused experts -------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_activation_with_and_without_bias(km, dtype, activation, bias):
    # H = 40: a partial K block; N = 24: partial N blocks (2N = 48 < BLOCK_N).
    check(km, 19, 7, 3, 40, 24, dtype, activation, bias, seed=len(activation) + bias)


SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2)


@pytest.mark.parametrize("T,E,K,H,N,config", [
    (1, 1, 1, 16, 16, None),            # one token, one expert
    (4, 4, 4, 32, 16, None),            # K = E: every expert
    (33, 13, 2, 72, 40, SMALL),         # several K, N and grouped M blocks; E = 13
    (70, 3, 2, 48, 80, SMALL),          # N = 80 > the activation's 64 columns
    (300, 11, 3, 24, 24, None),         # the middle default entry (BLOCK_M 32, GROUP_M 8)
])
def test_shapes(km, T, E, K, H, N, config):
    check(km, T, E, K, H, N, config=config, seed=T + E)


@pytest.mark.parametrize("T,dtype", [(8191, torch.float32), (8192, torch.float16),
                                     (8193, torch.float32)])
def test_around_8192_tokens(km, T, dtype):
    """The seed's crash shape (int32 index math); tiny H and N keep the interpreter quick."""
    check(km, T, 5, 2, 16, 16, dtype, seed=T)


def subset_slot_ids(T: int, K: int, G: int) -> torch.Tensor:
    """[T, K] slot ids (on DEVICE) over three of G slots (1, 4, 6), distinct per token (a repeat
    becomes -1), and two past the slots (G, G + 5), which the kernels skip."""
    g = torch.Generator().manual_seed(5)
    slots = torch.tensor([1, 4, 6])[torch.randint(0, 3, (T, K), generator=g)]
    slots[:, 1] = torch.where(slots[:, 0] == slots[:, 1], -1, slots[:, 1])   # distinct per token
    slots[3, 0], slots[7, 1] = G, G + 5                              # out of range: skipped
    return slots.to(DEVICE)


def check_skipped_pairs_and_waves(run, ids: torch.Tensor, want: torch.Tensor, G: int,
                                  assert_close) -> None:
    """``run(ids, out, max_ids)`` writes the pairs of ``ids`` into out [T, K, H]: the valid
    pairs (ids in [0, G)) match ``want`` (``assert_close(got, want)``), the other rows keep what
    was there (3.0: the expert cache's waves), and two waves (slot 4, then the rest, with
    max_ids 1 and 2: their distinct slots) equal one call bit for bit."""
    T, K, H = want.shape
    out = torch.full((T, K, H), 3.0, device=DEVICE)
    run(ids, out, None)
    valid = (ids >= 0) & (ids < G)
    assert_close(out[valid], want[valid])
    assert torch.equal(out[~valid], torch.full_like(out[~valid], 3.0))
    waves = torch.full((T, K, H), 3.0, device=DEVICE)
    for wave, max_ids in (((ids == 4), 1), ((ids != 4), 2)):
        run(torch.where(wave, ids, -1), waves, max_ids)
    assert torch.equal(waves, out)


def close_1e4(got, want):
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_slot_ids_with_unused_slots_and_skipped_pairs(km):
    """G = 9 slots, ids use three of them; -1 and ids >= G are skipped: their rows of out keep
    what was there (the expert cache's waves), and two waves equal one call."""
    T, K, H, N, G = 23, 2, 32, 16, 9
    x, w13, w2, w, _, b13, b2 = make(T, G, K, H, N, bias=True, G=G)
    ids = subset_slot_ids(T, K, G)

    def run(ids, out, max_ids):                  # no bound: grids sized for every slot
        km.fused_moe_pairs(x, w13, w2, w, ids, out, "silu", ALPHA, LIMIT, b13, b2)
    check_skipped_pairs_and_waves(run, ids, moe_ref(x, w13, w2, w, ids, "silu", b13, b2), G,
                                  close_1e4)


def _bounded_waves_equal_one_call(km, dtype):
    """Two waves with their bounds (max_ids: the distinct slots each holds), and looser or no
    bounds: the shorter grids compute the same pairs, bit for bit, as grids sized for every
    slot."""
    T, K, H, N, G = 32, 2, 32, 16, 9
    x, w13, w2, w, _, b13, b2 = make(T, G, K, H, N, dtype, bias=True, G=G)
    g = torch.Generator().manual_seed(7)
    first = torch.randperm(G, generator=g)[:2 * K]
    ids = torch.stack([first[torch.randperm(2 * K, generator=g)[:K]] for _ in range(T)])
    ids = ids.to(DEVICE)
    want = torch.full((T, K, H), 3.0, device=DEVICE, dtype=dtype)
    km.fused_moe_pairs(x, w13, w2, w, ids, want, "silu", ALPHA, LIMIT, b13, b2)
    for wave, bound in (((ids == first[0]), 1), ((ids != first[0]), 2 * K - 1)):
        for max_ids in (bound, bound + 3, None):
            got = torch.full((T, K, H), 3.0, device=DEVICE, dtype=dtype)
            km.fused_moe_pairs(x, w13, w2, w, torch.where(wave, ids, -1), got, "silu", ALPHA,
                               LIMIT, b13, b2, max_ids=max_ids)
            assert torch.equal(got[wave], want[wave]), (bound, max_ids)
            assert torch.equal(got[~wave], torch.full_like(got[~wave], 3.0))


def test_max_ids_bounded_grids_give_the_same_pairs(km):
    """A cache's waves with their bounds (``WaveIds.max_ids``)."""
    _bounded_waves_equal_one_call(km, torch.float32)


def test_rejects_bad_inputs(km):
    x, w13, w2, w, ids, _, _ = make(4, 4, 2, 32, 16)
    out = torch.zeros(4, 2, 32, device=DEVICE)
    bad = [((x, w13.half(), w2, w, ids, out), r"w13 is torch.float16 .*x is torch.float32"),
           ((x, w13, w2, w, ids, out, "relu"), r"activation='relu' is invalid"),
           ((x, w13, w2, w, ids, out, "relu2_no_mul"), r"need w13 \(4, 16, 32\)"),
           ((x, w13, w2, w[:3], ids, out), r"topk_weights \[T=4, K\]"),
           ((x, w13, w2, w, ids, out.transpose(0, 1)), r"out must be a contiguous \[T, K, H\]"),
           ((x.long(), w13, w2, w, ids, out), r"x.dtype=torch.int64 is not supported")]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            km.fused_moe_pairs(*args)
    assert not out.any()


def test_pinned_host_weights_are_readable_only_from_cuda():
    """The uva design's weights: pinned host memory, read in place by a CUDA kernel; nothing
    else off x's device passes."""
    from types import SimpleNamespace

    from vllm.kernels.triton.fused_moe import host_readable

    def host(pinned):
        return SimpleNamespace(device=torch.device("cpu"), is_pinned=lambda: pinned)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert host_readable(host(True), cuda)
    assert not host_readable(host(False), cuda)
    assert not host_readable(host(True), cpu)
    assert not host_readable(SimpleNamespace(device=torch.device("cuda", 1),
                                             is_pinned=lambda: False), cuda)


def test_block_size_tables():
    from vllm.kernels.triton.fused_moe_config import (_check_entry, get_moe_config,
                                                      load_table, table_file_name)
    assert table_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    assert load_table("NVIDIA H100 80GB HBM3")[0] == "NVIDIA_H100_80GB_HBM3.json"
    assert load_table("Some CPU")[0] == load_table("")[0] == "fused_moe_default.json"
    small, large = get_moe_config(768, 1), get_moe_config(768, 10 ** 6)
    assert small["BLOCK_M"] < large["BLOCK_M"]
    assert get_moe_config(768, 1, "NVIDIA H100 80GB HBM3")["num_stages"] == 4
    with pytest.raises(ValueError, match="BLOCK_N=48 is invalid: must be a power of two"):
        _check_entry({**small, "BLOCK_N": 48}, "t.json")
    with pytest.raises(ValueError, match=r"lacks \['GROUP_M'\]"):
        _check_entry({k: v for k, v in small.items() if k != "GROUP_M"}, "t.json")


def test_tables_are_keyed_by_shape_never_by_expert_count(tmp_path, monkeypatch):
    """A "N=<intermediate>" list applies to that shape at any expert count (a cached layer's
    kernels see its slots: the same blocks as uncached, so the same f32 sums); an
    "E=...,N=..." key is refused with the reason."""
    import json

    from vllm.kernels.triton import fused_moe_config as fc
    entry = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
             "num_stages": 2}
    default = [{**entry, "max_m": None, "BLOCK_N": 64}]
    monkeypatch.setattr(fc, "CONFIG_DIR", str(tmp_path))
    (tmp_path / "Dev_A.json").write_text(json.dumps(
        {"default": default, "N=768": [{**entry, "max_m": None}]}))
    (tmp_path / "Dev_B.json").write_text(json.dumps(
        {"default": default, "E=64,N=768": [{**entry, "max_m": None}]}))
    fc.load_table.cache_clear()
    try:
        assert fc.get_moe_config(768, 3, "Dev A")["BLOCK_N"] == 32
        assert fc.get_moe_config(1536, 3, "Dev A")["BLOCK_N"] == 64
        with pytest.raises(ValueError, match=r"key 'E=64,N=768' is invalid: must be 'default' "
                                             r"or 'N=<intermediate size>'"):
            fc.load_table("Dev B")
    finally:
        fc.load_table.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_compiled_on_cuda(dtype, activation):
    """The compiled kernels on the GPU (bf16 included), at model-like shapes and the default
    (untuned) block sizes."""
    from vllm.kernels.triton import fused_moe as km
    for T, E, K, H, N in [(1, 64, 8, 512, 256), (77, 64, 8, 512, 256), (8192, 16, 2, 256, 128),
                          (8193, 7, 3, 96, 40)]:
        for bias in (False, True):
            check(km, T, E, K, H, N, dtype, activation, bias, seed=T)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_max_ids_bounded_grids_on_cuda(dtype):
    """The compiled kernels with a cache wave's bounded grids: the same bits as unbounded."""
    from vllm.kernels.triton import fused_moe as km
    _bounded_waves_equal_one_call(km, dtype)


@pytest.mark.gpu
def test_pinned_host_weights_on_cuda_equal_device_weights():
    """The uva design: the kernels read w13/w2 from pinned host memory in place, bit for bit
    what they compute from the same weights on the device."""
    from vllm.kernels.triton import fused_moe as km
    x, w13, w2, w, ids, _, _ = make(33, 16, 4, 256, 128, torch.bfloat16, device="cuda")
    want = torch.zeros(33, 4, 256, dtype=torch.bfloat16, device="cuda")
    km.fused_moe_pairs(x, w13, w2, w, ids, want, "silu", ALPHA, LIMIT)
    got = torch.zeros_like(want)
    km.fused_moe_pairs(x, w13.cpu().pin_memory(), w2.cpu().pin_memory(), w, ids, got, "silu",
                       ALPHA, LIMIT)
    assert torch.equal(got, want)
