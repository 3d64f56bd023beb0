"""DeepSeek-V2/V3 (MLA over a latent paged KV cache) vs transformers on tiny random checkpoints:
32 greedy tokens through chunked prefill + decodes in mixed batches equal HF's greedy
``generate``, per-token logits match HF's, an FP8 block checkpoint matches HF run on its
dequantized weights, and the expert cache changes no token."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from vllm import LLM, SamplingParams
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod, quantize_fp8
from vllm.model_executor.model_loader import get_model

from tiny_checkpoints import TINY, PagedDriver, hf_logits, make_vllm_config

TOL = dict(atol=1e-4, rtol=1e-4)    # fp32 end to end
NEW_TOKENS = 32
V2_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
           "mscale_all_dim": 0.707, "original_max_position_embeddings": 64}
CASES = {   # name -> (arch, config overrides)
    "v3": ("DeepseekV3ForCausalLM", {"num_hidden_layers": 3}),
    "v3-rope-halves": ("DeepseekV3ForCausalLM", {"rope_interleave": False, "n_group": 1,
                                                 "topk_group": 1, "norm_topk_prob": False,
                                                 "rope_parameters": None}),
    "v2-lite": ("DeepseekV2ForCausalLM", {"rope_parameters": V2_YARN,
                                          "routed_scaling_factor": 1.5}),
    # One kept group of 4 experts: group-limited routing differs from plain greedy top-2.
    "v2-group-limited": ("DeepseekV2ForCausalLM", {
        "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1, "q_lora_rank": 20,
        "routed_scaling_factor": 2.0, "attention_bias": True, "num_hidden_layers": 3}),
}


def build(arch: str, path, seed: int = 0, **overrides):
    """Save a random tiny model (V3: with a random router correction bias, which HF initialises
    to zeros) to ``path``; return the fp32 eager HF model."""
    torch.manual_seed(seed)
    config = TINY[arch](**overrides)
    config._attn_implementation = "eager"
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(layer.mlp, "gate", None)
            if bias is not None and hasattr(bias, "e_score_correction_bias"):
                bias.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(str(path))
    return model


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 20, (n,), generator=g)]


@torch.no_grad()
def hf_greedy(hf, prompt: list[int]) -> list[int]:
    """HF's greedy ``generate`` (with its cache), EOS not special (as ours: no stop checks)."""
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                      max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + NEW_TOKENS
    return out[0, len(prompt):].tolist()


def paged_greedy(model, ps: list[list[int]], chunk: int = 5):
    """Greedy-decode every prompt through PagedDriver: prompt i starts at step i, prompts are
    fed in chunks of ``chunk`` tokens, decodes come first in each step. Returns (generated
    tokens, logits rows [prompt + generated - 1, V]) per prompt."""
    drv = PagedDriver(model, num_blocks=96, block_size=4)
    fed = [0] * len(ps)
    gen: list[list[int]] = [[] for _ in ps]
    rows: list[list[torch.Tensor]] = [[] for _ in ps]
    step = 0
    while any(len(g) < NEW_TOKENS for g in gen):
        decodes, prefills = [], []
        for i, p in enumerate(ps):
            if i > step or len(gen[i]) == NEW_TOKENS:
                continue
            if fed[i] == len(p):
                decodes.append((str(i), [gen[i][-1]]))
            else:
                prefills.append((str(i), p[fed[i]:fed[i] + chunk]))
        out = drv.step(decodes + prefills, num_decodes=len(decodes))
        for sid, toks in decodes + prefills:
            i = int(sid)
            rows[i].append(out[sid])
            if fed[i] < len(ps[i]):
                fed[i] += len(toks)
            if fed[i] == len(ps[i]):        # the prompt is in: its last row picks a token
                gen[i].append(int(out[sid][-1].argmax()))
        step += 1
    return gen, [torch.cat(r) for r in rows]


def check_against(hf, model, ps):
    gen, logits = paged_greedy(model, ps)
    for p, g, lg in zip(ps, gen, logits):
        assert g == hf_greedy(hf, p)
        torch.testing.assert_close(lg, hf_logits(hf, p + g[:-1]), **TOL)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers(case, tmp_path):
    """32 greedy tokens of 4 prompts (chunked prefill, decodes, mixed batches) equal HF's."""
    arch, overrides = CASES[case]
    hf = build(arch, tmp_path, **overrides)
    model = get_model(make_vllm_config(tmp_path))
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    # The cache holds the latent: one kv head of kv_lora_rank + qk_rope_head_dim.
    assert all(a.num_kv_heads == 1 and a.head_dim == 16 + 8 for a in attn)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["GatedMLP"] + ["DeepseekMoE"] * (len(kinds) - 1)
    check_against(hf, model, prompts(4, 160, seed=len(case)))


def test_torch_paths(torch_paths, tmp_path):
    """Without the C kernels every layer takes its torch path (other devices, torch.compile)."""
    arch, overrides = CASES["v3"]
    hf = build(arch, tmp_path, **overrides)
    check_against(hf, get_model(make_vllm_config(tmp_path)), prompts(2, 160, seed=3))


def test_multi_token_prediction_layer_is_skipped(tmp_path):
    """DeepSeek-V3 checkpoints carry an MTP layer after the last one (model.layers.{L}.*): it
    is not part of the causal LM and is skipped; any other unknown tensor still fails."""
    build("DeepseekV3ForCausalLM", tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(48, 96)
    save_file(tensors, path, metadata={"format": "pt"})
    get_model(make_vllm_config(tmp_path))
    tensors["model.layers.1.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="extra.weight"):
        get_model(make_vllm_config(tmp_path))


def test_correction_bias_loads_in_f32(tmp_path):
    """The V3 fixture's random correction bias is loaded exactly, in f32 (HF keeps it so)."""
    hf = build("DeepseekV3ForCausalLM", tmp_path)
    model = get_model(make_vllm_config(tmp_path))
    moe = model.model.layers[1].mlp.experts
    ref = hf.model.layers[1].mlp.gate.e_score_correction_bias
    torch.testing.assert_close(moe.e_score_correction_bias, ref, rtol=0, atol=0)
    assert moe.e_score_correction_bias.dtype == torch.float32 and ref.abs().max() > 0.05


# ---- FP8 block checkpoints -----------------------------------------------------------------
def _dequant(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    """Test-local block dequantization: weight = fp8 * its block's scale."""
    bo, bi = block
    out, inp = q.shape
    return q.float() * s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]


def write_fp8_block(src, dst, block, ref_dir=None) -> None:
    """Write ``src`` in DeepSeek-V3's own FP8 layout to ``dst``: every linear weight but the
    router and lm_head as e4m3 + weight_scale_inv per block; and to ``ref_dir`` (if given) the
    same checkpoint dequantized to fp32, the reference's weights."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, ref = {}, {}
    for name, t in tensors.items():
        linear = name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")
        if not linear:
            out[name] = ref[name] = t
            continue
        q = quantize_fp8(t, "block", block)
        out[name], out[name + "_scale_inv"] = q["weight"], q["weight_scale_inv"]
        ref[name] = _dequant(q["weight"], q["weight_scale_inv"], block)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
          "weight_block_size": list(block)}
    for path, state, cfg in ((dst, out, {**config, "quantization_config": qc}),
                             (ref_dir, ref, config)):
        if path is None:
            continue
        os.makedirs(path, exist_ok=True)
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)


@pytest.mark.parametrize("block", [(128, 128), (8, 16)])
def test_fp8_block_checkpoint(tmp_path, block):
    """An FP8 block checkpoint (experts FP8, dense linears dequantized at load) against HF run
    on the dequantized weights."""
    fp32 = build("DeepseekV3ForCausalLM", tmp_path / "src")
    write_fp8_block(tmp_path / "src", tmp_path / "fp8", block, tmp_path / "ref")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ref"), dtype=torch.float32, attn_implementation="eager").eval()
    ids = list(range(3, 40))
    assert (hf_logits(hf, ids) - hf_logits(fp32, ids)).abs().max() > 1e-2   # FP8 is visible
    model = get_model(make_vllm_config(tmp_path / "fp8"))
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moe and all(isinstance(m.quant_method, Fp8MoEMethod) for m in moe)
    check_against(hf, model, prompts(3, 160, seed=5))


def test_fp8_dense_pairs_in_any_order(tmp_path):
    """A sharded checkpoint may list a scale before its weight: the dense pair still meets."""
    from vllm.model_executor.layers.quantization.fp8_dense import dequantize_dense_fp8
    build("DeepseekV3ForCausalLM", tmp_path / "src")
    write_fp8_block(tmp_path / "src", tmp_path / "fp8", (8, 16))
    items = sorted(load_file(os.path.join(tmp_path / "fp8", "model.safetensors")).items())
    forward = dict(dequantize_dense_fp8(items, (8, 16)))
    backward = dict(dequantize_dense_fp8(items[::-1], (8, 16)))
    assert forward.keys() == backward.keys()
    assert not any(k.endswith("scale_inv") and ".experts." not in k for k in forward)
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    for k in forward:
        assert torch.equal(bits(forward[k]), bits(backward[k])), k


def test_fp8_dense_weight_without_scale_fails(tmp_path):
    build("DeepseekV3ForCausalLM", tmp_path / "src")
    write_fp8_block(tmp_path / "src", tmp_path / "fp8", (128, 128))
    path = os.path.join(tmp_path / "fp8", "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="o_proj.weight_scale_inv is missing"):
        get_model(make_vllm_config(tmp_path / "fp8"))


# ---- the expert cache through the engine ---------------------------------------------------
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8-block"])
def test_expert_cache_changes_no_token(tmp_path, fp8):
    """vllm.LLM at moe_expert_cache_size N in {1, top_k, E/2}: the tokens and logprobs of N=0,
    which are HF's greedy tokens (fp32)."""
    from tiny_models import VOCAB, make_tokenizer
    hf = build("DeepseekV3ForCausalLM", tmp_path / "src", num_hidden_layers=3, vocab_size=VOCAB,
               eos_token_id=0, bos_token_id=0, pad_token_id=0)
    path = tmp_path / "src"
    if fp8:
        path = tmp_path / "fp8"
        write_fp8_block(tmp_path / "src", path, (128, 128))
    make_tokenizer(path)
    ps = prompts(6, 300, seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run(**kw):
        llm = LLM(str(path), **kw)
        outs = [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                          for d in o.outputs[0].logprobs])
                for o in llm.generate(ps, params)]
        return outs, llm

    ref, _ = run()
    if not fp8:
        assert [list(t) for t, _ in ref[:3]] == [hf_greedy(hf, p)[:12] for p in ps[:3]]
    E, K = 8, 2
    for n in (1, K, E // 2):
        got, llm = run(moe_expert_cache_size=n)
        assert got == ref, f"capacity {n}"
        assert llm.get_moe_cache_stats()["misses"] > 0
