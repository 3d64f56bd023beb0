"""The "flashinfer_paged" attention backend (FlashInfer's paged wrappers; NOT YET RUN ON A GPU,
forced only). On CPU: the FlashInfer entry points take every argument the backend passes (when
flashinfer-python is installed), the metadata -> plan arrays conversion against a reference
written here from our block tables, the layer through a stand-in for the wrappers
(``flashinfer_paged_standin.py``, FlashInfer's documented contract in float64) against the
float64 reference and the torch backend, the decode-graph plan seam of
``worker/cuda_graphs.py``, the registry's refusals, that "auto" never picks it, and the
missing-package error. The tests marked ``gpu`` run the real kernels, eagerly and captured."""
from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys

import pytest
import torch
from torch import nn

from vllm.model_executor.forward_context import AttentionMetadata, set_forward_context
from vllm.model_executor.layers.attention import flashinfer_paged as fp
from vllm.model_executor.layers.attention import registry
from vllm.model_executor.layers.attention.interface import AttentionOptions
from vllm.model_executor.layers.attention.registry import (AttentionQuery,
                                                           get_attention_backend,
                                                           select_attention_backend)
from vllm.platforms import platform_for
from vllm.platforms.cuda import CudaPlatform
from vllm.worker.cuda_graphs import CudaDecodeGraphs
from vllm.worker.graph_capture import CudaGraphCapturer, GraphCapturer

from .flashinfer_paged_standin import fake_flashinfer
from .test_attention_options import BATCHES, make_layer, paged_case, run_paged

pytest.importorskip("triton", reason="the backend's KV write is the Triton kernel (pip install "
                                     "triton)")
OPTIONS = {"plain": {}, "window3": dict(sliding_window=3), "window50": dict(sliding_window=50),
           "shared": dict(kv_shared=True), "shared_window": dict(kv_shared=True,
                                                                 sliding_window=4)}
"""Every option combination the backend runs (sinks are refused)."""


class FakeCuda(CudaPlatform):
    def __init__(self, order=None):
        if order is not None:
            self.attention_backends = order


def query(dtype=torch.bfloat16, head_dim=128, platform=None, contiguous=True,
          features=frozenset()):
    return AttentionQuery(platform or FakeCuda(), dtype, head_dim, contiguous, features)


@pytest.fixture
def installed(monkeypatch):
    """flashinfer-python found by the refusal's check (selection never imports it)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flashinfer" else real(name, *a))


def use_standin(attn, api, cache=None):
    """Binds ``cache`` (if given; binding selects the torch backend on CPU), then makes
    flashinfer_paged over the stand-in ``api`` the layer's implementation."""
    if cache is not None:
        attn.kv_cache = cache
    attn.impl = fp.FlashInferPagedAttention(attn.num_heads, attn.head_dim, attn.num_kv_heads,
                                            attn.scale, "l", attn.options, api)
    return attn


def standin_case(opts, api, heads=(6, 2), batch="mixed"):
    """A layer over the stand-in with a paged case bound: (attn, md, q, k, v, ref)."""
    attn = make_layer("torch_sdpa", *heads, **OPTIONS[opts])
    case = paged_case(attn, *BATCHES[batch], dtype=torch.float16)
    return (use_standin(attn, api), *case)


# ---- (a) the entry points ---------------------------------------------------------------------
def _bind(real, name, args, kwargs):
    cls_name, method = name.split(".")
    fn = getattr(getattr(real, cls_name), method)
    inspect.signature(fn).bind(None, *args, **kwargs)          # None: self
    if name == "BatchDecodeWithPagedKVCacheWrapper.plan":
        # plan() forwards **kwargs to _plan_impl: bind there too, keywords included.
        inspect.signature(getattr(real, cls_name)._plan_impl).bind(None, *args, **kwargs)


def test_flashinfer_entry_points_take_what_the_backend_passes(triton_interpreter):
    real = pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    api = fake_flashinfer()
    attn, md, q, k, v, _ = standin_case("window3", api)
    run_paged(attn, md, q, k, v)
    _graph_step("window3", api)
    names = {n for n, _, _ in api.calls}
    assert names == {f"{c}.{m}" for c in ("BatchPrefillWithPagedKVCacheWrapper",
                                          "BatchDecodeWithPagedKVCacheWrapper")
                     for m in ("__init__", "plan", "run")}
    for name, args, kwargs in api.calls:
        _bind(real, name, args, kwargs)
    # The pinned backend and layout are values the installed package accepts.
    real.utils._check_kv_layout("NHD")
    assert "fa2" in inspect.getsource(real.prefill.BatchPrefillWithPagedKVCacheWrapper.__init__)


# ---- (b) the plan arrays ----------------------------------------------------------------------
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_plan_arrays_match_a_reference_from_block_tables(bs):
    g = torch.Generator().manual_seed(bs)
    lens = [1, bs, bs + 1, 3 * bs - 1, 37]
    M = max(-(-n // bs) for n in lens) + 2                        # padded tables
    tables = torch.randint(1, 500, (len(lens), M), generator=g)
    indptr, indices, last = [0], [], []
    for i, n in enumerate(lens):                                  # the plain reference
        pages = (n + bs - 1) // bs
        indices += tables[i, :pages].tolist()
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * bs)
    got = fp.plan_arrays(tables, lens, bs)
    assert all(t.dtype == torch.int32 for t in got)
    assert [t.tolist() for t in got] == [indptr, indices, last]
    assert all(1 <= x <= bs for x in got[2].tolist())


# ---- (c) the layer through the stand-in -------------------------------------------------------
@pytest.mark.parametrize("heads", [(6, 2), (4, 1)], ids=["gqa3", "mqa4"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("opts", list(OPTIONS))
def test_layer_matches_the_torch_backend_and_the_reference(triton_interpreter, opts, batch,
                                                           heads):
    api = fake_flashinfer()
    attn, md, q, k, v, ref = standin_case(opts, api, heads, batch)
    out = run_paged(attn, md, q, k, v)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    # The KV write landed; the wrapper ran on views of our cache's planes (no copy).
    flat = attn.kv_cache.view(attn.kv_cache.shape[0], -1, heads[1], 8)
    assert torch.equal(flat[0][md.slot_mapping], k.view(-1, heads[1], 8))
    if v is not None:
        assert torch.equal(flat[1][md.slot_mapping], v.view(-1, heads[1], 8))
    (kind, (kc, vc)), = api.runs
    assert kind == "BatchPrefillWithPagedKVCacheWrapper"
    assert kc.data_ptr() == attn.kv_cache[0].data_ptr()
    assert vc.data_ptr() == attn.kv_cache[-1].data_ptr()
    assert kc.shape == attn.kv_cache.shape[1:]
    sdpa = make_layer("torch_sdpa", *heads, **OPTIONS[opts])
    sdpa.kv_cache = attn.kv_cache.clone()
    torch.testing.assert_close(run_paged(sdpa, md, q, k, v), out, atol=2e-3, rtol=2e-3)


def test_one_plan_per_step_shared_by_layers(triton_interpreter):
    api = fake_flashinfer()
    a, md, q, k, v, _ = standin_case("plain", api)
    b = use_standin(make_layer("torch_sdpa"), api, a.kv_cache.clone())
    for layer in (a, b, a):
        run_paged(layer, md, q, k, v)
    plans = [n for n, _, _ in api.calls if n.endswith(".plan")]
    assert plans == ["BatchPrefillWithPagedKVCacheWrapper.plan"]
    md2 = AttentionMetadata(**{f: getattr(md, f) for f in md.__dataclass_fields__})
    run_paged(a, md2, q, k, v)                                     # a new step: planned again
    assert sum(n.endswith(".plan") for n, _, _ in api.calls) == 2
    # A different window is another plan (FlashInfer plans window_left).
    c = use_standin(make_layer("torch_sdpa", sliding_window=3), api, a.kv_cache.clone())
    assert c.impl.graph_planner(a.kv_cache) is not a.impl.graph_planner(a.kv_cache)


def test_unplanned_metadata_inside_a_capture_raises():
    attn, md = standin_case("plain", fake_flashinfer(), batch="decodes")[:2]
    with pytest.raises(RuntimeError, match="no plan was made"):
        attn.impl.graph_planner(attn.kv_cache).wrapper_for(md, capturing=True)


def test_sinks_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"does not run sinks: .*trtllm-gen, cuDNN"):
        fp.FlashInferPagedAttention(4, 8, 2, 1.0, options=AttentionOptions(use_sinks=True),
                                    api=fake_flashinfer())


# ---- (d) decode graphs: the plan seam ---------------------------------------------------------
class _Flagging(GraphCapturer):
    """Replays run the function with the stand-in's ``in_graph`` set: a plan there raises."""

    def __init__(self, api):
        self.api, self.replays = api, 0

    def capture(self, fn):
        def replay():
            self.api.in_graph, self.replays = True, self.replays + 1
            try:
                return fn()
            finally:
                self.api.in_graph = False
        return replay


class _TinyModel(nn.Module):
    """Token embedding, then each attention layer as a residual: logits over 40 tokens."""

    def __init__(self, layers, hq=6, hkv=2, d=8):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = torch.randn(40, hq * d, generator=g)
        self.w = [torch.randn(hq * d, n, generator=g) * 0.3 for n in (hq * d, hkv * d, hkv * d)]
        self.layers = nn.ModuleList(layers)

    def forward(self, ids, positions):
        x = self.emb[ids]
        for a in self.layers:
            q, k, v = (x @ w for w in self.w)
            x = x + a(q, k, None if a.options.kv_shared else v)
        return x

    def compute_logits(self, h):
        return h @ self.emb.T


def _decode_md(lens, bs=4, M=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    tables = (torch.randperm(len(lens) * M, generator=g) + 1).view(len(lens), M)
    slots = [int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=tables, seq_lens=torch.tensor(lens),
        query_start_loc=torch.arange(len(lens) + 1), seq_lens_cpu=list(lens),
        query_lens_cpu=[1] * len(lens), num_decodes=len(lens), block_size=bs)


def _graph_step(opts, api):
    """One decode step of a layer over the stand-in through CudaDecodeGraphs (size 4, 3 rows),
    in float16."""
    attn = make_layer("torch_sdpa", **OPTIONS[opts])
    use_standin(attn, api, torch.randn(attn.kv_cache_shape(40, 4), dtype=torch.float16))
    model = _TinyModel([attn])
    model.emb, model.w = model.emb.half(), [w.half() for w in model.w]
    graphs = CudaDecodeGraphs(model, [4], 6, 24, 4, torch.device("cpu"), _Flagging(api))
    return graphs.logits(torch.tensor([1, 2, 3]), torch.tensor([8, 2, 16]), _decode_md([9, 3, 17]))


@pytest.mark.parametrize("opts", ["plain", "shared_window"])
def test_decode_graphs_plan_outside_the_replay_and_equal_eager(triton_interpreter, opts):
    api = fake_flashinfer()
    layers = [make_layer("torch_sdpa", **OPTIONS[opts]) for _ in range(2)]
    for a in layers:
        use_standin(a, api, torch.randn(a.kv_cache_shape(40, 4), dtype=torch.float32))
    model = _TinyModel(layers)
    capturer = _Flagging(api)
    graphs = CudaDecodeGraphs(model, [4, 8], 6, 24, 4, torch.device("cpu"), capturer)
    for seed, lens in enumerate([[9, 3, 17], [10, 4, 18], [5, 7, 2]]):
        md = _decode_md(lens, seed=seed)
        ids, pos = torch.tensor([5, 6, 7]), torch.tensor(lens) - 1
        api.runs.clear()
        got = graphs.logits(ids, pos, md)
        assert {kind for kind, _ in api.runs} == {"BatchDecodeWithPagedKVCacheWrapper"}
        with set_forward_context(md):
            want = model.compute_logits(model(ids, pos))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)     # row batching
    assert capturer.replays == 2                       # step 1 was the warm-up
    # One planner (both layers share plan arguments): one decode plan per step, padded to 4
    # rows (the padding row: context 1, block 0) and read from the fixed buffers.
    plans = [a for n, a, _ in api.calls if n == "BatchDecodeWithPagedKVCacheWrapper.plan"]
    assert len(plans) == 3
    indptr, indices, last = plans[-1][:3]
    assert last.tolist() == [1, 3, 2, 1] and indptr.tolist() == [0, 2, 4, 5, 6]
    assert indices[-1].item() == 0
    inits = [k for n, _, k in api.calls if n == "BatchDecodeWithPagedKVCacheWrapper.__init__"]
    assert len(inits) == 1 and inits[0]["use_cuda_graph"]
    assert inits[0]["paged_kv_indices_buffer"].numel() == 4 * 6


def test_each_graph_metadata_keeps_its_own_wrapper_until_it_is_dropped():
    """Two engines' graphs of the same padded size share a planner: each static metadata gets
    its own wrapper (a captured graph reads that wrapper's buffers, so none may be replaced),
    and a wrapper goes when its metadata does."""
    import gc
    api = fake_flashinfer()
    key = (4, 2, 64, -1, 0.125, torch.float16, torch.device("cpu"))
    planner = fp.FlashInferPlanner(api, key)
    a, b = _decode_md([9, 3, 17, 1]), _decode_md([5, 7, 2, 1], seed=1)
    for md in (a, b, a):
        planner.plan_decode_graph(md, md.seq_lens, md.block_tables)
    inits = [n for n, _, _ in api.calls if n == "BatchDecodeWithPagedKVCacheWrapper.__init__"]
    wa, wb = planner.wrapper_for(a, capturing=True), planner.wrapper_for(b, capturing=True)
    assert len(inits) == 2 and wa is not wb
    del b
    gc.collect()
    assert list(planner._graphs) == [id(a)] and planner.wrapper_for(a, True) is wa


# ---- (e) the registry -------------------------------------------------------------------------
def test_refused_on_cpu_with_a_reason():
    with pytest.raises(ValueError, match=r"'flashinfer_paged' cannot run .* on cpu .*: it runs "
                                         r"on \['cuda'\], not 'cpu'"):
        select_attention_backend(query(platform=platform_for("cpu")), "flashinfer_paged")


@pytest.mark.parametrize("features", [frozenset(), frozenset({"sliding_window", "kv_shared"})])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_selectable_when_forced_never_by_auto(installed, dtype, features):
    q = query(dtype, features=features)
    assert select_attention_backend(q, "flashinfer_paged").name == "flashinfer_paged"
    assert select_attention_backend(q).name != "flashinfer_paged"
    first = query(dtype, platform=FakeCuda(("flashinfer_paged", "torch_sdpa")))
    assert select_attention_backend(first).name == "torch_sdpa"


def test_auto_fails_rather_than_pick_it(installed, monkeypatch):
    from vllm.model_executor.layers.backend_registry import BackendRegistry
    only = BackendRegistry("attention", "attention_backend")
    only.register(get_attention_backend("flashinfer_paged"))
    monkeypatch.setattr(registry, "_REGISTRY", only)
    assert get_attention_backend("flashinfer_paged").refusal(query()) is None
    with pytest.raises(ValueError, match=r"no attention backend can run") as err:
        select_attention_backend(query())
    assert "flashinfer_paged" not in str(err.value)


@pytest.mark.parametrize("q,reason", [
    (query(torch.float32), r"it takes KV cache dtypes .*not torch.float32"),
    (query(head_dim=96), r"it runs head_dim \[64, 128, 256\], not 96"),
    (query(contiguous=False), r"it needs a contiguous KV cache"),
    (query(features=frozenset({"sinks", "sliding_window"})),
     r"it does not implement \['sinks'\]; sinks: FlashInfer 0.7.2 takes sink logits only"),
])
def test_refusals_name_the_reason(installed, q, reason):
    with pytest.raises(ValueError, match=r"'flashinfer_paged' cannot run .*" + reason):
        select_attention_backend(q, "flashinfer_paged")


def test_missing_package_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)         # import and find_spec fail
    with pytest.raises(ValueError, match=r"the flashinfer-python package is not installed \(pip "
                                         r"install flashinfer-python, or the 'cuda' extra"):
        select_attention_backend(query(), "flashinfer_paged")
    with pytest.raises(ImportError, match=r"needs the flashinfer-python package.*'cuda' extra"):
        get_attention_backend("flashinfer_paged").make(4, 128, 2, 1.0)


def test_flashinfer_is_not_imported_by_the_registry():
    code = ("import sys, torch; from vllm.model_executor.layers.attention import registry as r; "
            "from vllm.platforms import platform_for; "
            "r.select_attention_backend(r.AttentionQuery(platform_for('cpu'), torch.float32, 64, "
            "True)); print('flashinfer' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- (f) on a GPU -----------------------------------------------------------------------------
def _on_gpu(attn, cache):
    """``cache`` (CUDA) bound to ``attn`` and run by the real backend (made as the registry
    makes it; the binding itself would select on the cache's platform: forced there)."""
    pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    attn._kv_cache = cache
    attn.impl = get_attention_backend("flashinfer_paged").make(
        attn.num_heads, attn.head_dim, attn.num_kv_heads, attn.scale, "l", attn.options)
    return attn


def _to_cuda(md, *ts):
    fields = {f: getattr(md, f) for f in md.__dataclass_fields__}
    for f in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        fields[f] = fields[f].cuda()
    return (AttentionMetadata(**fields), *(None if t is None else t.cuda() for t in ts))


@pytest.mark.gpu
@pytest.mark.parametrize("opts", list(OPTIONS))
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_matches_the_reference_on_gpu(opts, batch, dtype):
    attn = make_layer("torch_sdpa", 8, 2, 128, **OPTIONS[opts])
    md, q, k, v, ref = paged_case(attn, *BATCHES[batch], dtype=dtype)
    _on_gpu(attn, attn.kv_cache.cuda())
    md, q, k, v = _to_cuda(md, q, k, v)
    out = run_paged(attn, md, q, k, v)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", ["plain", "window3", "shared"])
def test_decode_graph_captured_equals_eager_on_gpu(opts):
    attn = make_layer("torch_sdpa", 8, 2, 128, **OPTIONS[opts])
    _on_gpu(attn, torch.randn(attn.kv_cache_shape(64, 16), dtype=torch.bfloat16, device="cuda"))
    model = _TinyModel([attn], 8, 2, 128).cuda()
    model.emb, model.w = model.emb.cuda().bfloat16(), [w.cuda().bfloat16() for w in model.w]
    graphs = CudaDecodeGraphs(model, [4], 8, 128, 16, torch.device("cuda"), CudaGraphCapturer())
    for seed, lens in enumerate([[9, 30, 17], [10, 31, 18], [50, 2, 100]]):
        md = _decode_md(lens, bs=16, M=8, seed=seed)
        ids, pos = torch.tensor([5, 6, 7]), torch.tensor(lens) - 1
        got = graphs.logits(ids, pos, md)
        assert graphs.refused is None
        with set_forward_context(_to_cuda(md)[0]):
            want = model.compute_logits(model(ids.cuda(), pos.cuda()))
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert graphs.captured_sizes == [4]
