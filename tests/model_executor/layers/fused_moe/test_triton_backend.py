"""The "triton" MoE backend (``fused_moe/triton_experts.py``) through the registry and the engine:
selected on CPU only under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
without a GPU), refused with the reason otherwise, never chosen by "auto" on CPU, and a tiny
model's greedy tokens equal the torch backend's, with and without the expert cache (Qwen3-MoE:
silu; GPT-OSS: expert biases and the clamped swigluoai)."""
from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.fused_moe.modular_kernel import MOE_ACTIVATIONS, MoEKernelQuery
from vllm.model_executor.layers.fused_moe.registry import select_moe_backend
from vllm.platforms import platform_for

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

# Every test here runs (or selects for) Triton on CPU tensors: interpreter only (conftest).
pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]
E, K = 6, 2          # the tiny Qwen3-MoE config (tests/model_executor/tiny_checkpoints.py)


def query(activation="silu", dtype=torch.float32, scheme="unquantized", bias=False):
    return MoEKernelQuery(scheme, activation, dtype, 48, 24, platform_for("cpu"), bias)


@pytest.fixture
def interpreted(triton_interpreter):
    """Triton kernels on CPU tensors (tests/conftest.py: skipped where the interpreter is off)."""


@pytest.mark.parametrize("activation", MOE_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_selected_on_cpu_under_the_interpreter(interpreted, activation, dtype):
    assert select_moe_backend(query(activation, dtype, bias=True), "triton").name == "triton"
    assert select_moe_backend(query(activation, dtype)).name != "triton"   # not in CPU's order


def test_refused_with_the_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"moe_backend='triton' cannot run .* on cpu: Triton "
                                         r"kernels run on CUDA, or on CPU only under "
                                         r"TRITON_INTERPRET=1; not on 'cpu'"):
        select_moe_backend(query(), "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"'triton' cannot run .*quantized path runs gated "
                                         r"activations only, not 'relu2_no_mul'"):
        select_moe_backend(query("relu2_no_mul", scheme="nvfp4"), "triton")


def _prompts():
    return [[5, 17, 99, 3], [250, 7], list(range(40, 70)), [11] * 9]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny GPT-OSS whose expert biases are non-zero (HF initialises them to zero)."""
    import transformers
    from tiny_checkpoints import TINY
    from tiny_models import VOCAB, make_tokenizer
    path = tmp_path_factory.mktemp("gpt_oss")
    make_tokenizer(path)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(TINY["GptOssForCausalLM"](
        vocab_size=VOCAB, eos_token_id=0, bos_token_id=0, pad_token_id=0)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(str(path))
    return str(path)


def _run(path, **kw):
    from vllm import LLM, SamplingParams
    llm = LLM(path, device="cpu", dtype="float32", **kw)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate(_prompts(), params)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]
    backends = {m.quant_method.backend_name for m in llm.llm_engine.runner.moe_layers}
    return tokens, logprobs, backends, llm


def _tokens_equal_torch_backend(path, caches):
    ref, ref_lp, backends, _ = _run(path, moe_backend="torch", enforce_eager=True)
    assert backends == {"torch"}
    for cache in caches:
        got, got_lp, backends, llm = _run(path, moe_backend="triton", moe_expert_cache_size=cache)
        assert backends == {"triton"}
        assert got == ref, f"moe_expert_cache_size={cache}"
        torch.testing.assert_close(got_lp, ref_lp, atol=1e-4, rtol=0)
        if cache:
            assert llm.get_moe_cache_stats()["misses"] > 0


def test_tiny_model_tokens_equal_torch_backend(interpreted, tiny_model_factory):
    _tokens_equal_torch_backend(tiny_model_factory("Qwen3MoeForCausalLM"), (0, K, E - 1))


def test_gpt_oss_biased_swigluoai_tokens_equal_torch_backend(interpreted, gpt_oss):
    _tokens_equal_torch_backend(gpt_oss, (0, 3))


def test_a_cached_step_s_last_wave_gets_grids_for_its_one_expert(interpreted, tiny_model_factory,
                                                                 monkeypatch):
    """At N = E - 1 a step needing every expert runs two waves, the second with one expert:
    its align (and so its GEMM and activation grids) is sized for one group of pairs, not for
    E - 1; tokens still equal the uncached run's."""
    from vllm.kernels.triton import fused_moe as fm
    calls, align = [], fm.moe_align_block_size

    def recording(topk_ids, block_m, num_experts, max_ids=None):
        out = align(topk_ids, block_m, num_experts, max_ids)
        calls.append((topk_ids.numel(), block_m, num_experts, max_ids, out[0].numel()))
        return out
    monkeypatch.setattr(fm, "moe_align_block_size", recording)
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    ref, *_ = _run(path, moe_backend="triton", enforce_eager=True)
    assert {c[3] for c in calls} == {None}                 # uncached: one bound-free pass
    calls.clear()
    got, *_ = _run(path, moe_backend="triton", moe_expert_cache_size=E - 1, enforce_eager=True)
    assert got == ref
    last_waves = [c for c in calls if c[3] == 1]
    assert last_waves and all(c[2] == E - 1 for c in calls)
    for P, block_m, _, _, S in last_waves:
        assert P >= E and S == -(-(P + block_m - 1) // block_m) * block_m
    assert all(c[3] == min(E - 1, c[0]) for c in calls if c[3] != 1)
