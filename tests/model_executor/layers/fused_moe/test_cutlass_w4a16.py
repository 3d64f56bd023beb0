"""The "cutlass_w4a16" MoE backend (GPTQ INT4 on CUTLASS's SM90 mixed-input grouped GEMM; NOT YET
RUN ON A GPU, forced only). On CPU: the packed layout against a dequantizer of the bytes written
here and against ``GptqMoEMethod.dequantize``, a hand-computed byte example, the refusals, the
pair path (a FusedMoE layer) against the torch backend through a stand-in of the op written from
its contract (cutlass_w4a16_standin.py), cached == uncached bitwise, no host reads, and the
shared workspace under capture. The ``gpu`` tests run the compiled op against the stand-in and
the backend against the torch backend on an SM 9.0 device."""
from __future__ import annotations

import pytest
import torch
from host_sync_audit import audit_host_syncs
from model_executor.layers.fused_moe.cutlass_w4a16_standin import standin_mm, standin_ops
from model_executor.tiny_checkpoints import layer_config
from pair_checks import assert_pairs_independent

from vllm.config import set_current_vllm_config
from vllm.kernels.cuda.ops import W4A16MoEOps
from vllm.model_executor.layers.fused_moe import cutlass_w4a16 as cw
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation, MoEKernelQuery
from vllm.model_executor.layers.fused_moe.registry import get_moe_backend, select_moe_backend
from vllm.model_executor.layers.quantization.compressed_tensors import \
    CompressedTensorsW4A16MoEMethod
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
from vllm.model_executor.layers.quantization.gptq import GptqMoEMethod, quantize_gptq
from vllm.model_executor.layers.quantization.utils import pack_int4
from vllm.platforms import DeviceCapability, platform_for
from vllm.platforms.cuda import CudaPlatform

E, H, N, TOP_K = 4, 128, 64, 2
BF16 = torch.bfloat16


# ---- GPTQ experts --------------------------------------------------------------------------
def gptq_expert(gs, sym, fmt, seed=0):
    """One expert's layer tensors (w13 = [gate; up] halves fused along dim 0, as the loader).
    pack-quantized checkpoints load into this same layout (as gptq_v2)."""
    method = GptqMoEMethod(gs, sym, False, fmt)
    g = torch.Generator().manual_seed(seed)
    gate, up, down = (torch.randn(*s, generator=g) * 0.1 for s in ((N, H), (N, H), (H, N)))
    return method.expert_from_checkpoint(
        *(quantize_gptq(w, gs, sym, checkpoint_format=fmt) for w in (gate, up, down)))


def read_packed(packed, p, gs):
    """The test's reading of the packed bytes: W[n, k] = q * s, q the signed nibbles (an
    arithmetic shift of int8 sign-extends them), s [groups, rows] per column k // gs."""
    b = packed[f"{p}_qweight"].view(torch.int8).to(torch.int32)
    lo, hi = (b << 28) >> 28, b >> 4                          # low nibble: even k
    q = torch.stack([lo, hi], dim=-1).flatten(-2).float()     # [R, K]
    K = q.shape[-1]
    group = K if gs == -1 or gs >= K else gs
    return q * packed[f"{p}_scales"].float().repeat_interleave(group, dim=0).t()


METHODS = {"gptq": lambda gs, sym: GptqMoEMethod(gs, sym, False, "gptq"),
           "gptq_v2": lambda gs, sym: GptqMoEMethod(gs, sym, False, "gptq_v2"),
           "compressed": lambda gs, sym: CompressedTensorsW4A16MoEMethod(gs, sym)}


# ---- (1) the layout ------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", list(METHODS))
@pytest.mark.parametrize("gs", [64, 128, -1])
def test_packed_bytes_dequantize_to_the_methods_weights(fmt, gs):
    method = METHODS[fmt](gs, True)
    t = gptq_expert(gs, True, "gptq" if fmt == "gptq" else "gptq_v2")
    want13, want2 = method.dequantize(t, torch.float32)
    one = cw.pack_gptq_for_cutlass(method, t)
    stacked = cw.pack_gptq_for_cutlass(method, {n: torch.stack([v, v]) for n, v in t.items()})
    assert one["w13_qweight"].shape == (2 * N, H // 2) and one["w2_qweight"].shape == (H, N // 2)
    g13, g2 = (1 if gs == -1 else max(k // gs, 1) for k in (H, N))
    assert one["w13_scales"].shape == (g13, 2 * N) and one["w2_scales"].shape == (g2, H)
    assert one["w13_qzeros"] is t["w13_qzeros"]                  # unread: symmetric only
    assert one["w13_qweight"].dtype == torch.uint8 and one["w13_scales"].dtype == BF16
    for n in one:
        assert torch.equal(stacked[n][1], one[n]), n
    for p, want in (("w13", want13), ("w2", want2)):
        got = read_packed(one, p, gs)
        # bf16 scales: 2^-9 relative
        torch.testing.assert_close(got, want, rtol=2 ** -8, atol=2 ** -8 * want.abs().max())


def tiny_expert(u_row0, zero, scale, fmt):
    """N = 8, H = 8, one group: w13 row 0 holds u_row0, every other value 8."""
    u13, u2 = torch.full((16, 8), 8), torch.full((8, 8), 8)
    u13[0] = torch.tensor(u_row0)
    stored = zero - (1 if fmt == "gptq" else 0)
    return {"w13_qweight": pack_int4(u13, dim=1), "w2_qweight": pack_int4(u2, dim=1),
            "w13_qzeros": pack_int4(torch.full((16, 1), stored), dim=0),
            "w2_qzeros": pack_int4(torch.full((8, 1), stored), dim=0),
            "w13_scales": torch.full((16, 1), scale, dtype=torch.float16),
            "w2_scales": torch.full((8, 1), scale, dtype=torch.float16),
            "w13_g_idx": torch.zeros(2, 8, dtype=torch.int32),
            "w2_g_idx": torch.zeros(1, 8, dtype=torch.int32)}


def test_bytes_of_a_hand_computed_row():
    # u = [0, 15, 8, 7, 1, 2, 3, 4] -> q = u - 8 = [-8, 7, 0, -1, -7, -6, -5, -4] -> nibbles
    # [8, 7, 0, 15, 9, 10, 11, 12] -> bytes (k even low): 0x78, 0xF0, 0xA9, 0xCB.
    t = tiny_expert([0, 15, 8, 7, 1, 2, 3, 4], 8, 0.5, "gptq_v2")
    got = cw.pack_gptq_for_cutlass(GptqMoEMethod(-1, True, False, "gptq_v2"), t)
    assert got["w13_qweight"][0].tolist() == [0x78, 0xF0, 0xA9, 0xCB]
    assert got["w13_qweight"][1].tolist() == [0, 0, 0, 0]                  # u = 8: q = 0
    assert got["w13_scales"].tolist() == [[0.5] * 16]
    # v1 stores zero - 1: 7 is the symmetric zero 8.
    t = tiny_expert([3] * 8, 8, 0.25, "gptq")
    got = cw.pack_gptq_for_cutlass(GptqMoEMethod(-1, True, False, "gptq"), t)
    assert got["w13_qweight"][0].tolist() == [0xBB] * 4                    # 3 - 8 = -5: 0xB
    # Any other zero point is refused (the kernel has none).
    with pytest.raises(ValueError, match=r"symmetric GPTQ only .*w13_qzeros holds others: "
                                         r"CUTLASS 4.2's grouped .*'triton'"):
        cw.pack_gptq_for_cutlass(GptqMoEMethod(-1, True, False, "gptq"),
                                 tiny_expert([3] * 8, 3, 0.25, "gptq"))


# ---- (2) refusals --------------------------------------------------------------------------
class FakeCuda(CudaPlatform):
    """A CUDA platform of a given SM, without a GPU, with or without the op."""

    def __init__(self, sm: int, ops=None, order=None):
        self.sm, self.ops = sm, ops
        if order is not None:
            self.moe_backends = order

    def get_device_capability(self, device=None):
        return DeviceCapability(self.sm // 10, self.sm % 10)

    def w4a16_moe_ops(self):
        return self.ops


def query(scheme="w4a16-gptq", platform=None, dtype=BF16, hidden=H, inter=N, act="silu"):
    return MoEKernelQuery(scheme, act, dtype, hidden, inter,
                          platform or FakeCuda(90, standin_ops()))


def test_forced_only():
    q = query(platform=FakeCuda(90, standin_ops(), ("cutlass_w4a16", "torch")))
    assert select_moe_backend(q, "cutlass_w4a16").name == "cutlass_w4a16"
    assert select_moe_backend(q).name != "cutlass_w4a16"
    assert not get_moe_backend("cutlass_w4a16").auto


@pytest.mark.parametrize("q,reason", [
    (query(platform=FakeCuda(100, standin_ops())), r"SM <= 90, the device is SM 100"),
    (query(platform=FakeCuda(80, standin_ops())), r"SM >= 90, the device is SM 80"),
    (query(platform=FakeCuda(90, None)), r"vllm._C was built without the CUTLASS W4A16 grouped "
                                         r"GEMM \(it needs the nvidia-cutlass headers and 9.0a "
                                         r"among the CUDA architectures"),
    (query(hidden=96), r"hidden_size a multiple of 64, not 96"),
    (query(inter=32), r"intermediate_size a multiple of 64, not 32"),
    (query("fp8-block"), r"it handles schemes \['w4a16-gptq'\], not 'fp8-block'"),
    (query(dtype=torch.float16), r"it takes dtypes \['torch.bfloat16'\], not torch.float16"),
    (query(act="relu2_no_mul"), r"activations \['silu', 'gelu', 'swigluoai'\], not "
                                r"'relu2_no_mul'"),
    (query(platform=platform_for("cpu")), r"it runs on \['cuda'\], not 'cpu'"),
])
def test_refusals(q, reason):
    with pytest.raises(ValueError, match=r"'cutlass_w4a16' cannot run .*" + reason):
        select_moe_backend(q, "cutlass_w4a16")


def test_refusal_names_the_sm():
    assert "not SM 100" in cw.cutlass_w4a16_refusal(query(platform=FakeCuda(100, standin_ops())))
    assert cw.cutlass_w4a16_refusal(query()) is None


def test_bind_and_pack_refusals():
    kernel = cw.CutlassW4A16Experts(MoEActivation(), standin_ops())
    with pytest.raises(ValueError, match=r"asymmetric gptq \(sym=False, zero points\): CUTLASS "
                                         r"4.2's grouped mixed-input GEMM .*'triton'"):
        kernel.bind_scheme(GptqMoEMethod(64, False, False))
    with pytest.raises(ValueError, match=r"group_size=32: .*-1 \(the whole input\) or a multiple "
                                         r"of 64; use 'triton'"):
        kernel.bind_scheme(GptqMoEMethod(32, True, False))
    with pytest.raises(ValueError, match=r"runs w4a16-gptq only, not fp8-channel"):
        kernel.bind_scheme(Fp8MoEMethod("channel"))
    with pytest.raises(ValueError, match=r"gated activations only"):
        cw.CutlassW4A16Experts(MoEActivation("relu2_no_mul"), standin_ops())
    method = GptqMoEMethod(64, True, False)
    t = gptq_expert(64, True, "gptq")
    t["w13_g_idx"] = t["w13_g_idx"][:, torch.randperm(H)].contiguous()     # act order
    with pytest.raises(ValueError, match=r"w13_g_idx is permuted \(act order\) but .* "
                                         r"desc_act=false"):
        cw.pack_gptq_for_cutlass(method, t)
    act_order = GptqMoEMethod(64, True, True)
    t["w13_g_idx"][1] = t["w13_g_idx"][1].flip(0)                         # up != gate
    with pytest.raises(ValueError, match=r"gate and up have different act-order permutations"):
        cw.pack_gptq_for_cutlass(act_order, t)
    t["w13_g_idx"] = torch.zeros(2, H, dtype=torch.int32)                 # one group of H
    with pytest.raises(ValueError, match=r"groups are not all of 64 columns"):
        cw.pack_gptq_for_cutlass(act_order, t)
    with pytest.raises(ValueError, match=r"group_size=32"):
        cw.pack_gptq_for_cutlass(GptqMoEMethod(32, True, False), gptq_expert(
            32, True, "gptq"))


def test_missing_op_names_the_build(monkeypatch):
    monkeypatch.setattr(CudaPlatform, "w4a16_moe_ops", lambda self: None)
    with pytest.raises(ValueError, match=r"built without the CUTLASS W4A16 .*docs/build.md"):
        get_moe_backend("cutlass_w4a16").make(MoEActivation(), None)


# ---- (3, 4) the pair path through the stand-in --------------------------------------------
def build(backend, gs=64, sym=True, act="silu", cache=0, ops=None, seed=0, device="cpu",
          config=None):
    """A bf16 FusedMoE layer of GPTQ experts; ``ops``: run cutlass_w4a16 over them (selected
    as ``backend`` first, then the kernel replaced before loading, as on a CPU-only machine)."""
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * N, H, generator=g) * 0.1, torch.randn(E, H, N, generator=g) * 0.1
    method = GptqMoEMethod(gs, sym, False, "gptq", act)
    with set_current_vllm_config(config or layer_config(cache, moe_backend=backend)), \
            torch.device(device):
        layer = FusedMoE(E, TOP_K, H, N, activation=act, params_dtype=BF16, quant_method=method)
        if ops is not None:
            layer.quant_method.kernel = cw.CutlassW4A16Experts(layer.activation, ops)
            layer.quant_method.kernel.bind_scheme(method)
        for e in range(E):
            for shard, kind, w in (("w1", "w13", w13[e][:N]), ("w3", "w13", w13[e][N:]),
                                   ("w2", "w2", w2[e])):
                for s, t in quantize_gptq(w, gs, sym).items():
                    layer.load_expert_weight(f"{kind}_{s}", method.load_transform(s, kind, t),
                                             e, shard)
    layer.finish_loading(torch.device(device))
    return layer


def inputs(T, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    return x.to(device, BF16), logits.to(device)


def assert_close_to(got, want, bound=0.02):
    """bf16 tolerance: relative error of the whole output, and elementwise."""
    got, want = got.float(), want.float()
    assert ((got - want).norm() / want.norm()).item() < bound
    torch.testing.assert_close(got, want, rtol=0.03, atol=0.03 * want.abs().max().item())


@pytest.mark.parametrize("gs,sym,act", [(64, True, "silu"), (128, True, "gelu"),
                                        (-1, True, "swigluoai")])
def test_layer_close_to_the_torch_backend(gs, sym, act):
    ref = build("torch", gs, sym, act)
    got = build("torch", gs, sym, act, ops=standin_ops())
    assert got.quant_method.kernel.name == "cutlass_w4a16"
    for T in (1, 5, 16):
        x, logits = inputs(T, T)
        assert_close_to(got(x, logits), ref(x, logits))


def test_cached_equals_uncached_bitwise():
    """Two slots: slot ids, several waves into one ``out``; every pair equal bit for bit."""
    plain = build("torch", ops=standin_ops())
    cached = build("torch", cache=2, ops=standin_ops())
    assert cached.expert_cache is not None and plain.expert_cache is None
    for T in (1, 7, 16):
        x, logits = inputs(T, 10 + T)
        assert torch.equal(cached(x, logits), plain(x, logits))


def test_pairs_independent_and_skipped_pairs_untouched():
    layer = build("torch", ops=standin_ops())
    kernel, weights = layer.quant_method.kernel, layer.weight_provider.slot_weights()
    g = torch.Generator().manual_seed(3)
    x, wts = torch.randn(6, H, generator=g).to(BF16), torch.rand(6, TOP_K, generator=g)
    ids = torch.randint(0, E, (6, TOP_K), generator=g)
    assert_pairs_independent(kernel, weights, x, wts, ids, E)
    ids[::2, 0] = -1                                     # some pairs skipped
    out = torch.full((6, TOP_K, H), 7.0, dtype=BF16)
    kernel.apply_pairs(weights, x, wts, ids, out)
    assert (out[::2, 0] == 7.0).all() and not (out[1::2, 0] == 7.0).all()
    assert not (out[:, 1] == 7.0).all(dim=-1).any()


def test_no_host_reads_of_device_data():
    """The glue around the op (sort, offsets, gathers, scatter) reads nothing on the host, so a
    capture can record it; the op is replaced by a no-op (the stand-in reads offsets)."""
    layer = build("torch", ops=standin_ops())
    weights = layer.weight_provider.slot_weights()
    kernel = cw.CutlassW4A16Experts(MoEActivation(), W4A16MoEOps(lambda *a: None,
                                                                 lambda g, d: 256))
    kernel.bind_scheme(layer.quant_method)
    ids = torch.tensor([[0, 3], [-1, 1], [2, 2]])
    out = torch.zeros(3, TOP_K, H, dtype=BF16)
    x, wts = inputs(3, 0)[0], torch.rand(3, TOP_K)
    kernel.apply_pairs(weights, x, wts, ids, out)                  # sizes the workspace
    with torch.inference_mode(), audit_host_syncs():
        kernel.apply_pairs(weights, x, wts, ids, out)


def test_workspace_shared_and_never_grown_in_a_capture(monkeypatch):
    from vllm.model_executor.layers.fused_moe import workspace
    ws = workspace.SharedWorkspace("cutlass_w4a16")
    cpu = torch.device("cpu")
    assert ws.current(cpu) is None
    first = ws.get(cpu, 100)
    assert ws.get(cpu, 64) is first and ws.current(cpu) is first
    monkeypatch.setattr(workspace, "capturing", lambda device: True)
    assert ws.get(cpu, 100) is first
    with pytest.raises(RuntimeError, match=r"cutlass_w4a16: a CUDA-graph capture needs a "
                                           r"1000-byte workspace on cpu, but 100 bytes were "
                                           r"allocated"):
        ws.get(cpu, 1000)
    monkeypatch.setattr(workspace, "capturing", lambda device: False)
    assert ws.get(cpu, 1000).numel() == 1000 and ws.retired == [first]   # kept for graphs


# ---- (5) on a GPU --------------------------------------------------------------------------
def skip_unless_runs():
    cuda = platform_for("cuda")
    cap = cuda.get_device_capability() if torch.cuda.is_available() else None
    if cap is None or cap.to_int() != 90:
        pytest.skip(f"needs an SM 9.0 CUDA device, not {cap}")
    if cuda.w4a16_moe_ops() is None:
        pytest.skip(cw.BUILD_HINT)
    return cuda.w4a16_moe_ops()


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [64, 128, 256])
def test_compiled_op_equals_the_standin(group_size):
    ops = skip_unless_runs()
    g = torch.Generator().manual_seed(group_size)
    G, K, Nn, P = 5, 256, 192, 40
    offsets = torch.tensor([3, 3, 17, 17, 30, 36])         # empty groups; rows outside skipped
    a = torch.randn(P, K, generator=g).to(BF16)
    w = torch.randint(0, 256, (G, Nn, K // 2), generator=g, dtype=torch.uint8)
    scales = (torch.rand(G, K // group_size, Nn, generator=g) * 0.02 + 0.001).to(BF16)
    want = torch.full((P, Nn), 3.0, dtype=BF16)
    standin_mm(a, w, scales, want, offsets, group_size, torch.empty(256, dtype=torch.uint8))
    dev = [t.cuda() for t in (a, w, scales)]
    d = torch.full((P, Nn), 3.0, dtype=BF16, device="cuda")
    ws = torch.empty(ops.workspace_bytes(G, d.device), dtype=torch.uint8, device="cuda")
    ops.mm(*dev, d, offsets.cuda(), group_size, ws)
    got = d.cpu()
    assert (got[:3] == 3.0).all() and (got[36:] == 3.0).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                               atol=2e-2 * want.float().abs().max().item())


def gpu_config(backend, cache=0):
    """A layer config on the CUDA device (``layer_config`` is the CPU one)."""
    from vllm.config import (CacheConfig, DeviceConfig, KernelConfig, MoECacheConfig,
                             SchedulerConfig, VllmConfig)
    return VllmConfig(None, CacheConfig(), SchedulerConfig(), MoECacheConfig(cache_size=cache),
                      DeviceConfig("cuda"), kernel_config=KernelConfig(moe_backend=backend))


def gpu_layer(backend, cache=0):
    return build(backend, cache=cache, device="cuda", config=gpu_config(backend, cache))


@pytest.mark.gpu
@pytest.mark.parametrize("cache", [0, 2])
def test_backend_matches_the_torch_backend_on_gpu(cache):
    skip_unless_runs()
    ref, got = gpu_layer("torch"), gpu_layer("cutlass_w4a16", cache)
    assert got.quant_method.backend_name == "cutlass_w4a16"
    for T in (1, 7, 64):
        x, logits = inputs(T, T, "cuda")
        assert_close_to(got(x, logits), ref(x, logits))
