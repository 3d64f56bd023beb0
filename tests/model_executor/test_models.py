"""Our models vs Hugging Face transformers on tiny random checkpoints, through the paged KV path."""
from __future__ import annotations

import pytest
import torch
import transformers

from vllm.model_executor.model_loader import get_model
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.models.registry import get_model_class

from tiny_checkpoints import PagedDriver, build_checkpoint, hf_logits, make_vllm_config

TOL = dict(atol=1e-4, rtol=1e-4)   # fp32 end to end
ARCHS = ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
         "Qwen3ForCausalLM", "LlamaForCausalLM"]


@pytest.fixture(scope="module", params=ARCHS)
def loaded(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_checkpoint(request.param, path)
    return hf, get_model(make_vllm_config(path))


def test_paged_prefill_chunks_decodes_and_mixed_batches(loaded, tokens):
    hf, model = loaded
    a, b = tokens(14), tokens(11)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)

    # (a) one prefill of the whole prompt
    out = PagedDriver(model).step([("a", a[:10])])
    torch.testing.assert_close(out["a"], ref_a[:10], **TOL)

    # (b) the same prompt in two chunks, then (c) single-token decode steps
    drv = PagedDriver(model)
    torch.testing.assert_close(drv.step([("a", a[:6])])["a"], ref_a[:6], **TOL)
    torch.testing.assert_close(drv.step([("a", a[6:10])])["a"], ref_a[6:10], **TOL)
    for p in range(10, 13):
        torch.testing.assert_close(drv.step([("a", [a[p]])], num_decodes=1)["a"],
                                   ref_a[p:p + 1], **TOL)

    # (d) mixed batches: decodes first, then prefills (fresh and chunked), decodes of unequal length
    drv = PagedDriver(model)
    drv.step([("a", a[:7])])
    steps = [([("a", [a[7]]), ("b", b[:5])], 1),
             ([("a", [a[8]]), ("b", b[5:9])], 1),
             ([("a", [a[9]]), ("b", [b[9]])], 2)]
    for chunks, nd in steps:
        before = dict(drv.computed)
        out = drv.step(chunks, num_decodes=nd)
        for sid, toks in chunks:
            ref, p = (ref_a if sid == "a" else ref_b), before.get(sid, 0)
            torch.testing.assert_close(out[sid], ref[p:p + len(toks)], **TOL)


def test_no_metadata_path_is_plain_causal(loaded, tokens):
    hf, model = loaded
    ids = tokens(9)
    with torch.no_grad():
        h = model(torch.tensor(ids), torch.arange(9))
    torch.testing.assert_close(model.compute_logits(h), hf_logits(hf, ids), **TOL)
    assert model.compute_logits(h).dtype == torch.float32


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM",
                                  "Qwen2MoeForCausalLM"])
def test_fused_in_memory_expert_layout(arch, tmp_path, tokens):
    """transformers >= 5 state_dict holds experts fused ([E, 2N, H] / [E, H, N])."""
    hf = build_checkpoint(arch, tmp_path)
    state = hf.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in state), "fixture lost its fused layout"
    with torch.device("cpu"):
        model = get_model_class(arch)(hf.config)
    with torch.no_grad():
        model.load_weights(state.items())
        for m in model.modules():
            if isinstance(m, FusedMoE):
                m.finish_loading(torch.device("cpu"))
    ids = tokens(8)
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(8)))
    torch.testing.assert_close(logits, hf_logits(hf, ids), **TOL)


def test_qwen3_moe_dense_layers_from_config(tmp_path, tokens):
    hf = build_checkpoint("Qwen3MoeForCausalLM", tmp_path, num_hidden_layers=3,
                          decoder_sparse_step=1, mlp_only_layers=[1])
    model = get_model(make_vllm_config(tmp_path))
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["SparseMoeBlock", "GatedMLP", "SparseMoeBlock"]
    ids = tokens(7)
    out = PagedDriver(model).step([("s", ids)])["s"]
    torch.testing.assert_close(out, hf_logits(hf, ids), **TOL)


def test_tied_embeddings_and_llama3_rope(tmp_path, tokens):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    hf = build_checkpoint("LlamaForCausalLM", tmp_path, tie_word_embeddings=True,
                          rope_parameters=rope)
    model = get_model(make_vllm_config(tmp_path))
    assert not hasattr(model, "lm_head")
    ids = tokens(12)
    torch.testing.assert_close(PagedDriver(model).step([("s", ids)])["s"], hf_logits(hf, ids),
                               **TOL)


def test_bf16_checkpoint(tmp_path, tokens):
    """A bf16 checkpoint loads into an fp32 model exactly, and into a bf16 model (bf16 compute)."""
    build_checkpoint("Qwen3MoeForCausalLM", tmp_path, dtype=torch.bfloat16)
    # Reference: HF reloads the bf16 files in fp32 (same rounded weights, fp32 rotary tables).
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    ids = tokens(8)
    ref = hf_logits(hf, ids)
    model32 = get_model(make_vllm_config(tmp_path, "float32"))
    torch.testing.assert_close(PagedDriver(model32).step([("s", ids)])["s"], ref, **TOL)
    model16 = get_model(make_vllm_config(tmp_path, "bfloat16"))
    assert model16.model.embed_tokens.weight.dtype == torch.bfloat16
    out = PagedDriver(model16, dtype=torch.bfloat16).step([("s", ids)])["s"]
    assert out.dtype == torch.float32
    # bf16 compute cannot match fp32; it may be no less accurate than transformers computing in
    # bf16 from the same files: our error against the fp32 reference stays within 1.5x of its
    # error (max and mean; measured ratios 0.75-0.87). A 2% error in one norm weight gives
    # 2.3-2.7x, and the old bound (10% of the logit scale) let it through. (A token whose
    # top-k router scores nearly tie can pick another expert in bf16 and exceed any such
    # bound; the fixture's tokens have none.)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.bfloat16, attn_implementation="eager").eval()
    hf_err = (hf_logits(hf16, ids).float() - ref).abs()
    err = (out - ref).abs()
    assert err.max() <= 1.5 * hf_err.max(), (err.max(), hf_err.max())
    assert err.mean() <= 1.5 * hf_err.mean(), (err.mean(), hf_err.mean())


# (arch, config overrides, which layers slide): transformers' three ways of saying it.
_WINDOWS = [
    ("MixtralForCausalLM", dict(sliding_window=4), [True, True]),
    ("Qwen3MoeForCausalLM", dict(sliding_window=4, use_sliding_window=True), [True, True]),
    ("Qwen3ForCausalLM", dict(sliding_window=4, use_sliding_window=True,
                              layer_types=["full_attention", "sliding_attention"]),
     [False, True]),
    ("Qwen2MoeForCausalLM", dict(sliding_window=4, use_sliding_window=True,
                                 max_window_layers=2), [True, False]),
    ("Qwen2MoeForCausalLM", dict(sliding_window=4, use_sliding_window=False), [False, False]),
]


@pytest.mark.parametrize("arch,overrides,sliding", _WINDOWS)
def test_sliding_window_layers_match_transformers(arch, overrides, sliding, tmp_path, tokens):
    """Prompts past the window: every logit row (prefill chunks and decodes) equals transformers'
    sliding-window masks, layer by layer as its config says."""
    hf = build_checkpoint(arch, tmp_path, **overrides)
    model = get_model(make_vllm_config(tmp_path))
    windows = [layer.self_attn.attn.options.sliding_window for layer in model.model.layers]
    assert windows == [4 if s else None for s in sliding]
    ids = tokens(13)
    ref = hf_logits(hf, ids)
    drv = PagedDriver(model)
    torch.testing.assert_close(drv.step([("a", ids[:5])])["a"], ref[:5], **TOL)
    torch.testing.assert_close(drv.step([("a", ids[5:10])])["a"], ref[5:10], **TOL)
    for p in range(10, 13):
        torch.testing.assert_close(drv.step([("a", [ids[p]])], num_decodes=1)["a"],
                                   ref[p:p + 1], **TOL)
