"""The Triton attention backend (``triton_paged``) through the registry, the ``Attention`` layer
and the engine: where it is chosen or refused, that the layer gives the torch backend's results
with every option, and that a tiny model decodes the default CPU backend's greedy tokens.

Without a GPU its kernels run under Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py);
the kernels themselves are tested in tests/kernels/triton/test_triton_paged_attention.py.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from vllm.model_executor.layers.attention import AttentionQuery, select_attention_backend
from vllm.model_executor.layers.attention.interface import AttentionImpl
from vllm.platforms import platform_for
from vllm.platforms.interface import DeviceCapability

from .test_attention_options import BATCHES, OPTIONS, make_layer, paged_case, run_paged

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
# Every test here runs (or selects for) Triton on CPU tensors: interpreter only (conftest).
pytestmark = pytest.mark.usefixtures("triton_interpreter")

REFUSED_ON_CPU = (r"attention_backend='triton_paged' cannot run .*: Triton kernels run on "
                  r"CUDA, or on CPU only under TRITON_INTERPRET=1; not on 'cpu'")


def _query(dtype=torch.float16, contiguous=True, device="cpu", features=frozenset(),
           head_dim=16):
    return AttentionQuery(platform_for(device), dtype, head_dim, contiguous, features)


@pytest.fixture
def interpreter(triton_interpreter):
    """Triton kernels on CPU tensors (tests/conftest.py: skipped where the interpreter is off)."""


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_forced_on_cpu_under_the_interpreter_with_every_feature(interpreter, dtype):
    q = _query(dtype, features=frozenset({"sliding_window", "sinks", "kv_shared"}))
    assert select_attention_backend(q, "triton_paged").name == "triton_paged"
    assert select_attention_backend(q).name != "triton_paged"     # CPU's order is unchanged


def test_refused_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=REFUSED_ON_CPU):
        select_attention_backend(_query(), "triton_paged")
    with pytest.raises(ValueError, match=REFUSED_ON_CPU):
        make_layer("triton_paged").kv_cache = torch.zeros(2, 4, 4, 2, 8)


def test_refused_without_triton_and_for_a_non_contiguous_cache(interpreter, monkeypatch):
    with pytest.raises(ValueError, match=r"needs a contiguous KV cache"):
        select_attention_backend(_query(contiguous=False, device="cuda"), "triton_paged")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"the 'triton' package is not installed"):
        select_attention_backend(_query(device="cuda"), "triton_paged")
    assert select_attention_backend(_query(device="cuda")).name == "torch_sdpa"


def test_auto_on_cuda_and_graph_safety():
    """CUDA's first choice (pure selection: no device touched); the only capturable backend."""
    assert select_attention_backend(_query(torch.bfloat16, device="cuda")).name == \
        "triton_paged"
    layer = make_layer("triton_paged")
    layer.kv_cache = torch.zeros(layer.kv_cache_shape(4, 4))
    assert layer.impl.cuda_graph_safe is True
    assert AttentionImpl.cuda_graph_safe is False
    assert "backend=triton_paged" in repr(layer)


def test_fp32_caches_too_wide_for_sm120_are_refused_there_only(monkeypatch):
    """SM120 has 99 KiB of shared memory a program, SM90 227 KiB. The refused cases are the
    compiled ones over 99 KiB (tests/build: two planes at D = 576, 111,680 B; one plane at
    D = 1024, 132,160 B); MLA's one plane at D = 576 (74,816 B) and two planes at D = 512
    (99,392 B) fit. "auto" takes the next backend. Selection asks the device only for fp32
    past D = 256."""
    asked = []

    def capability(self, device=None):
        asked.append(device)
        return DeviceCapability(*cc)
    monkeypatch.setattr(type(platform_for("cuda")), "get_device_capability", capability)
    one = frozenset({"kv_shared"})
    for cc, d, features, want in (((9, 0), 576, frozenset(), "triton_paged"),
                                  ((12, 0), 576, frozenset(), "torch_sdpa"),
                                  ((12, 0), 512, frozenset(), "triton_paged"),
                                  ((12, 0), 576, one, "triton_paged"),
                                  ((12, 0), 768, one, "triton_paged"),
                                  ((12, 0), 1024, one, "torch_sdpa"),
                                  ((9, 0), 1024, one, "triton_paged")):
        q = _query(torch.float32, device="cuda", head_dim=d, features=features)
        assert select_attention_backend(q).name == want, (cc, d, features)
    cc = (12, 0)
    with pytest.raises(ValueError, match=r"an fp32 KV cache of 2 plane\(s\) at head_dim=576 "
                                         r"needs about 111 KB of shared memory per program, "
                                         r"over the 99 KiB of SM120; use a 16-bit dtype"):
        select_attention_backend(_query(torch.float32, device="cuda", head_dim=576),
                                 "triton_paged")
    n = len(asked)
    for dtype, d in ((torch.bfloat16, 576), (torch.float32, 256)):
        assert select_attention_backend(_query(dtype, device="cuda", head_dim=d),
                                        "triton_paged").name == "triton_paged"
    assert len(asked) == n


@pytest.mark.parametrize("batch", ["mixed", "decodes", "chunks"])
@pytest.mark.parametrize("opts", list(OPTIONS))
def test_layer_equals_torch_backend(opts, batch):
    """The same layer inputs through triton_paged and torch_sdpa: the same outputs and the same
    cache (GQA 6:2, shuffled blocks, every option combination)."""
    outs, caches = [], []
    for backend in ("triton_paged", "torch_sdpa"):
        attn = make_layer(backend, **OPTIONS[opts])
        md, q, k, v, ref = paged_case(attn, *BATCHES[batch])
        assert attn.impl.name == backend
        outs.append(run_paged(attn, md, q, k, v))
        caches.append(attn.kv_cache)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0].double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0], caches[1])


def test_layer_in_half_precision_at_a_model_head_dim():
    """fp16, D = 80 (not a power of two), block 16 with window and sinks, long contexts."""
    attn = make_layer("triton_paged", 4, 2, 80, sliding_window=21, use_sinks=True)
    md, q, k, v, ref = paged_case(attn, [(70, 1), (33, 1), (17, 17), (50, 20)], 2, bs=16,
                                  dtype=torch.float16)
    out = run_paged(attn, md, q, k, v)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "GptOssForCausalLM"])
def test_tiny_model_greedy_tokens_equal_the_default_backend(tiny_model_factory, arch):
    """fp32, block size 4 and an 8-token step budget: prompts of several blocks prefilled in
    chunks, then decodes (GPT-OSS: sinks and a sliding window on alternate layers)."""
    from vllm import LLM, SamplingParams
    path = tiny_model_factory(arch)
    prompts = [[(7 * i + 3) % 150 + 3 for i in range(19)], [5, 9, 11, 40, 2, 77]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("auto", "triton_paged"):
        llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=8,
                  max_num_seqs=2, attention_backend=backend)
        layers = llm.llm_engine.runner.attn_layers
        assert layers and {m.impl.name for m in layers} == \
            {"triton_paged" if backend == "triton_paged" else "cpu_paged"}
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    assert tokens["triton_paged"] == tokens["auto"]
