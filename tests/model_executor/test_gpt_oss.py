"""GPT-OSS against transformers' GptOssForCausalLM on tiny random checkpoints: greedy tokens (long
prompts past the sliding window, mixed batches), paged logits, the published MXFP4 layout (packed
here, read by transformers' own dequantizer as the reference), and the expert cache."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from vllm import LLM, SamplingParams
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader import get_model

from tiny_checkpoints import TINY, PagedDriver, hf_logits, make_vllm_config
from tiny_models import VOCAB, make_tokenizer

E, TOP_K, I, WINDOW = 8, 2, 32, 8
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _prompts():
    """Lengths 3..40: shorter and longer than the window (8), batched together."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 40, 6, 23)]


def build(path, seed=0):
    """A random tiny GPT-OSS with a tokenizer; every bias and sink non-zero (HF initialises the
    expert biases to zero), sinks large enough to matter."""
    make_tokenizer(path)
    torch.manual_seed(seed)
    config = TINY["GptOssForCausalLM"](vocab_size=VOCAB, eos_token_id=0, bos_token_id=0,
                                       pad_token_id=0)
    config._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 1.0 if name.endswith("sinks") else 0.1)
    model.save_pretrained(str(path))
    return model


def pack_mxfp4(codes):
    """e2m1 codes [..., C] -> published blocks [..., C/32, 16]: code 2j low nibble, 2j+1 high."""
    lo, hi = codes[..., 0::2].to(torch.int32), codes[..., 1::2].to(torch.int32)
    return (lo + 16 * hi).to(torch.uint8).reshape(*codes.shape[:-1], -1, 16)


def dequant_mxfp4(codes, scales):
    """The test's reference: codes [..., C], e8m0 scales [..., C/32] -> float32 [..., C]."""
    mag = torch.tensor(E2M1)[(codes % 8).long()]
    return torch.where(codes >= 8, -mag, mag) * (
        2.0 ** (scales.float() - 127)).repeat_interleave(32, dim=-1)


def build_mxfp4(hf, path, seed=1):
    """The checkpoint of ``hf`` with random MXFP4 experts (rows = outputs, gate/up interleaved
    as published) and bf16 biases. Returns {name: dequantized [E, in, out] as HF holds it}."""
    make_tokenizer(path)
    g = torch.Generator().manual_seed(seed)
    state, want = {}, {}
    for name, t in hf.state_dict().items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            state[name] = t.bfloat16() if name.endswith("_bias") else t.clone()
            continue
        out_dim, in_dim = t.shape[2], t.shape[1]
        codes = torch.randint(0, 16, (E, out_dim, in_dim), generator=g, dtype=torch.uint8)
        scales = torch.randint(121, 125, (E, out_dim, in_dim // 32), generator=g, dtype=torch.uint8)
        state[name + "_blocks"], state[name + "_scales"] = pack_mxfp4(codes), scales
        want[name] = dequant_mxfp4(codes, scales).transpose(1, 2)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    config["quantization_config"] = MXFP4
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return want


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(float path, its HF model, mxfp4 path, transformers' model loaded from that path)."""
    path, mx_path = tmp_path_factory.mktemp("gpt_oss"), tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf = build(path)
    want = build_mxfp4(hf, mx_path)
    hf_mx = transformers.AutoModelForCausalLM.from_pretrained(
        str(mx_path), dtype=torch.float32, attn_implementation="eager").eval()
    # transformers' MXFP4 reader (dequantizing on CPU) gives the test's own reference weights.
    for name, w in want.items():
        assert torch.equal(hf_mx.get_parameter(name), w), name
    return str(path), hf, str(mx_path), hf_mx


def hf_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def greedy(path, n=32, **kw):
    outs = LLM(path, **kw).generate(_prompts(), SamplingParams(temperature=0, max_tokens=n,
                                                               ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("which", ["float", "mxfp4"])
def test_greedy_matches_transformers(checkpoints, which):
    path, hf, mx_path, hf_mx = checkpoints
    path, hf = (path, hf) if which == "float" else (mx_path, hf_mx)
    got = greedy(path, max_num_seqs=8)
    assert got == [hf_greedy(hf, p, 32) for p in _prompts()]


def test_layout_sinks_windows_and_backends(checkpoints):
    path, hf, _, _ = checkpoints
    assert get_model(make_vllm_config(path)).model.layers[0].mlp.experts.quant_method \
        .backend_name == "cpu_kernel"
    config = make_vllm_config(path)
    config.kernel_config.moe_backend = "torch"          # experts as loaded (cpu_kernel packs)
    model = get_model(config)
    for i, (ours, theirs) in enumerate(zip(model.model.layers, hf.model.layers)):
        attn = ours.self_attn.attn
        assert attn.options.sliding_window == (WINDOW if i % 2 == 0 else None)
        assert torch.equal(attn.sinks, theirs.self_attn.sinks)
        experts, gu = ours.mlp.experts, theirs.mlp.experts.gate_up_proj   # gu [E, H, 2I]
        assert torch.equal(experts.w13_weight[3, :I], gu[3, :, 0::2].T)     # gate rows
        assert torch.equal(experts.w13_weight[3, I:], gu[3, :, 1::2].T)     # up rows
        assert torch.equal(experts.w13_bias[3, I:], theirs.mlp.experts.gate_up_proj_bias[3, 1::2])


@pytest.mark.parametrize("truncate", [None, True])
def test_published_yarn_rope_equals_transformers(truncate):
    """GPT-OSS's published rope (the config's default: YaRN factor 32 over 4096 positions,
    beta 32/1, truncate false), and with truncation: the same inverse frequencies bit for bit
    and the same cos/sin scale."""
    config = transformers.GptOssConfig()
    if truncate is not None:
        config.rope_parameters["truncate"] = truncate
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](config)
    rope = get_rope(config, config.head_dim)
    assert torch.equal(rope.inv_freq, inv_freq) and rope.attention_scaling == scale


def test_paged_prefill_chunks_and_decodes_past_the_window(checkpoints, tokens):
    path, hf, _, _ = checkpoints
    model = get_model(make_vllm_config(path))
    a, b = tokens(30, VOCAB), tokens(13, VOCAB)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    drv = PagedDriver(model)
    tol = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drv.step([("a", a[:5])])["a"], ref_a[:5], **tol)
    torch.testing.assert_close(drv.step([("a", a[5:19])])["a"], ref_a[5:19], **tol)
    steps = [([("a", [a[19]]), ("b", b[:10])], 1), ([("a", [a[20]]), ("b", b[10:12])], 1),
             ([("a", [a[21]]), ("b", [b[12]])], 2)]
    for chunks, nd in steps:
        before = dict(drv.computed)
        out = drv.step(chunks, num_decodes=nd)
        for sid, toks in chunks:
            ref, p = (ref_a if sid == "a" else ref_b), before.get(sid, 0)
            torch.testing.assert_close(out[sid], ref[p:p + len(toks)], **tol)


@pytest.mark.parametrize("which", ["float", "mxfp4"])
def test_expert_cache_tokens_equal_uncached(checkpoints, which):
    path = checkpoints[0] if which == "float" else checkpoints[2]
    want = greedy(path, n=12, dtype="bfloat16")
    for n in (1, TOP_K, E // 2):
        got = greedy(path, n=12, dtype="bfloat16", moe_expert_cache_size=n)
        assert got == want, n


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_graph_decode_equals_eager(checkpoints, monkeypatch, dtype):
    """Decode steps replayed from CPU graphs (sinks, windows, the C expert kernel with biases
    and swigluoai all have nodes) give the eager engine's tokens and logprobs, bit for bit."""
    from vllm.worker.cpu_graphs import DecodeGraphs
    monkeypatch.setattr(DecodeGraphs, "CAPTURE_AFTER", 1)     # capture at a size's first step
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
              for m in (3, 9, 14, 6, 11)]                    # the batch shrinks: sizes 4, 2, 1
    runs = []
    for eager in (True, False):
        llm = LLM(checkpoints[0], dtype=dtype, enforce_eager=eager, max_num_seqs=8)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                     for o in llm.generate(_prompts(), params)])
    graphs = llm.llm_engine.runner.decode_graphs
    assert graphs.refused is None and len(graphs._graphs) >= 2
    assert runs[0] == runs[1]


def test_missing_expert_tensor_named(checkpoints, tmp_path):
    path = checkpoints[0]
    state = load_file(os.path.join(path, "model.safetensors"))
    del state["model.layers.2.mlp.experts.down_proj_bias"]
    save_file(state, os.path.join(tmp_path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts\.0\.w2\.bias"):
        get_model(make_vllm_config(tmp_path))
