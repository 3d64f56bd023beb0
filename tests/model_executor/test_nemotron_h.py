"""Nemotron-H (Mamba-2 + attention + MLP + MoE) vs transformers on tiny random checkpoints, fp32:
32 greedy tokens through chunked prefill (prompts longer than one prefill chunk and than the
Mamba chunk_size) and decodes in batches of mixed lengths, a sequence preempted and recomputed
from token 0, per-token logits; then through ``vllm.LLM`` (with preemption forced by a tiny KV
cache), the expert cache at N in {1, top_k, E/2} equal to no cache, and state slots returned
after an abort."""
from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.model_loader import get_model

from tiny_checkpoints import PagedDriver, hf_logits, make_vllm_config

TOL = dict(atol=1e-4, rtol=1e-4)
NEW_TOKENS = 32
E, TOP_K = 8, 2


def tiny_config(pattern: str = "M*EM-E", **kw) -> transformers.NemotronHConfig:
    """Mamba: 6 heads of 4 in 2 groups, state 8, conv 4, chunk_size 8 (prompts span several
    chunks). MoE: 8 experts in 4 groups (2 kept), top-2, routed_scaling_factor 2.5.
    time_step_min tiny so transformers' prefill-only clamp (dt >= time_step_min) never binds:
    we apply time_step_limit (0, inf) in prefill and decode, as the original code does."""
    return transformers.NemotronHConfig(**{
        "vocab_size": 160, "hidden_size": 48, "hybrid_override_pattern": pattern,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
        "intermediate_size": 40, "mamba_num_heads": 6, "mamba_head_dim": 4, "ssm_state_size": 8,
        "n_groups": 2, "conv_kernel": 4, "chunk_size": 8, "time_step_min": 1e-7,
        "n_routed_experts": E, "num_experts_per_tok": TOP_K, "moe_intermediate_size": 24,
        "moe_shared_expert_intermediate_size": 32, "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.5, "initializer_range": 0.1, **kw})


def build(path, pattern: str = "M*EM-E", seed: int = 0, **kw):
    """Save a random tiny model to ``path``; return the fp32 eager HF model. Parameters HF
    initialises to constants (A_log, D, dt_bias, every norm, the correction bias) get random
    values first, so a mixed-up load shows."""
    torch.manual_seed(seed)
    config = tiny_config(pattern, **kw)
    config._attn_implementation = "eager"
    hf = transformers.NemotronHForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("A_log", "D", "dt_bias")) or "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1, generator=g)
    hf.save_pretrained(str(path))
    return hf


def prompts(n: int, vocab: int = 160, seed: int = 0, lo: int = 3, hi: int = 30):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist()
            for k in torch.randint(lo, hi, (n,), generator=g)]


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """HF's greedy ``generate`` (its Mamba cache: chunked scan for the prompt, then recurrent
    steps), EOS not special."""
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                      max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def paged_greedy(model, ps: list[list[int]], chunk: int = 7, preempt: dict | None = None):
    """Greedy-decode every prompt through PagedDriver: prompt i starts at step i, prefills in
    chunks of ``chunk`` tokens, decodes first in each step. ``preempt`` {i: k}: after its k-th
    generated token, sequence i is released (blocks and state slot) and recomputed from token
    0 (prompt + generated so far) under a new id. Returns (tokens, logits rows [n - 1, V] of
    the final pass over prompt + generated) per prompt."""
    drv = PagedDriver(model, num_blocks=128, block_size=4, num_slots=len(ps) + 1)
    seqs = [list(p) for p in ps]                          # tokens to feed, grows with outputs
    fed, gen = [0] * len(ps), [[] for _ in ps]
    sid = [str(i) for i in range(len(ps))]
    rows: list[list[torch.Tensor]] = [[] for _ in ps]
    step, preempt = 0, dict(preempt or {})
    while any(len(g) < NEW_TOKENS for g in gen):
        active = [i for i in range(len(ps)) if i <= step and len(gen[i]) < NEW_TOKENS]
        decodes = [i for i in active if fed[i] == len(seqs[i]) - 1 and gen[i]]
        prefills = [i for i in active if i not in decodes]
        chunks = [(sid[i], seqs[i][fed[i]:fed[i] + (1 if i in decodes else chunk)])
                  for i in decodes + prefills]
        out = drv.step(chunks, num_decodes=len(decodes))
        for (s, toks), i in zip(chunks, decodes + prefills):
            rows[i].append(out[s])
            fed[i] += len(toks)
            if fed[i] == len(seqs[i]):                  # everything fed: sample the next token
                gen[i].append(int(out[s][-1].argmax()))
                seqs[i].append(gen[i][-1])
            if preempt.get(i) == len(gen[i]):
                del preempt[i]
                drv.release(sid[i])
                sid[i], fed[i], rows[i] = sid[i] + "'", 0, []
        step += 1
    return gen, [torch.cat(r)[:len(p) + NEW_TOKENS - 1] for r, p in zip(rows, ps)]


def check_against(hf, model, ps, **kw):
    gen, logits = paged_greedy(model, ps, **kw)
    for p, g, lg in zip(ps, gen, logits):
        assert g == hf_greedy(hf, p)
        torch.testing.assert_close(lg, hf_logits(hf, p + g[:-1]), **TOL)


CASES = {   # name -> (pattern, config overrides)
    "hybrid": ("M*EM-E", {}),
    "no-moe": ("M*M-", {}),
    # Latent MoE (routed experts on a 16-dim latent), one group, no renormalisation.
    "latent-moe": ("EM*E", {"moe_latent_size": 16, "n_group": 1, "topk_group": 1,
                            "norm_topk_prob": False, "routed_scaling_factor": 1.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers(case, tmp_path):
    """4 prompts of 3..30 tokens (prefill chunks of 7, Mamba chunks of 8), decodes batched in
    front of prefills, sequence 2 preempted after 5 tokens and recomputed: HF's tokens."""
    pattern, overrides = CASES[case]
    hf = build(tmp_path, pattern, **overrides)
    model = get_model(make_vllm_config(tmp_path))
    assert "".join(layer.kind for layer in model.backbone.layers) == pattern
    assert sum(isinstance(m, MambaMixer2) for m in model.modules()) == pattern.count("M")
    ps = prompts(4, seed=len(case))
    assert max(map(len, ps)) > 8
    check_against(hf, model, ps, preempt={2: 5})


def test_torch_paths(torch_paths, tmp_path):
    """Without the C kernels every layer takes its torch path (other devices, torch.compile)."""
    hf = build(tmp_path)
    check_against(hf, get_model(make_vllm_config(tmp_path)), prompts(2, seed=3))


def test_in_memory_names_load_and_mtp_is_skipped(tmp_path):
    """transformers' in-memory names (``model.`` for ``backbone.``, fused ``experts.up_proj``
    [E, I, H] / ``down_proj`` [E, H, I]) load to the same model; ``mtp.*`` is skipped, any
    other unknown tensor fails."""
    build(tmp_path / "src")
    tensors = load_file(os.path.join(tmp_path / "src", "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        m = re.match(r"^backbone\.(.+\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$", name)
        if m:
            fused.setdefault(f"model.{m[1]}.{m[3]}", []).append(tensors[name])
        else:
            fused[name.replace("backbone.", "model.", 1)] = tensors[name]
    fused = {n: torch.stack(t) if isinstance(t, list) else t for n, t in fused.items()}
    assert fused["model.layers.2.mixer.experts.up_proj"].shape == (E, 24, 48)
    fused["mtp.layers.0.eh_proj.weight"] = torch.zeros(4, 4)
    os.makedirs(tmp_path / "mem")
    shutil.copy(tmp_path / "src" / "config.json", tmp_path / "mem")
    save_file(fused, os.path.join(tmp_path / "mem", "model.safetensors"))
    ids = torch.arange(3, 30)

    def logits(d: str) -> torch.Tensor:               # one plain forward: no metadata
        model = get_model(make_vllm_config(tmp_path / d))
        with torch.no_grad():
            return model.compute_logits(model(ids, ids))
    torch.testing.assert_close(logits("mem"), logits("src"), rtol=0, atol=0)
    fused["model.layers.1.mixer.extra.weight"] = torch.zeros(2)
    save_file(fused, os.path.join(tmp_path / "mem", "model.safetensors"))
    with pytest.raises(ValueError, match="extra.weight"):
        get_model(make_vllm_config(tmp_path / "mem"))


def test_bf16_checkpoint(tmp_path):
    """A bf16 checkpoint: into an fp32 model exactly (A_log, D, dt_bias, the router and its bias
    stay f32 parameters), and into a bf16 model (bf16 compute, f32 SSM state), over a prefill
    chunk and decodes: our error against the fp32 reference stays within 1.5x of transformers'
    own bf16 error (max and mean)."""
    build(tmp_path / "src")
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "src"),
                                                             dtype=torch.float32)
    hf32.to(torch.bfloat16).save_pretrained(str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    ids = prompts(1, seed=7, lo=20, hi=21)[0]
    ref = hf_logits(hf, ids)

    def paged(dtype: str) -> torch.Tensor:
        model = get_model(make_vllm_config(tmp_path, dtype))
        drv = PagedDriver(model, dtype=getattr(torch, dtype))
        rows = [drv.step([("s", ids[:12])])["s"]]
        rows += [drv.step([("s", [t])], num_decodes=1)["s"] for t in ids[12:]]
        return torch.cat(rows)
    torch.testing.assert_close(paged("float32"), ref, **TOL)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.bfloat16, attn_implementation="eager").eval()
    hf_err = (hf_logits(hf16, ids).float() - ref).abs()
    err = (paged("bfloat16") - ref).abs()
    assert err.max() <= 1.5 * hf_err.max(), (err.max(), hf_err.max())
    assert err.mean() <= 1.5 * hf_err.mean(), (err.mean(), hf_err.mean())


# ---- through the engine -------------------------------------------------------------------
def engine_checkpoint(path, pattern: str = "M*EM-E"):
    """A tiny checkpoint with a tokenizer (prompts are token ids; EOS 0 is ignored)."""
    from tiny_models import VOCAB, make_tokenizer
    hf = build(path, pattern, vocab_size=VOCAB, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    make_tokenizer(path)
    return hf, prompts(6, VOCAB, seed=1, lo=3, hi=40)


def run_llm(path, ps, max_tokens: int = 12, **kw):
    """(token ids, top-2 logprobs per step) of every prompt, and the LLM."""
    from vllm import LLM, SamplingParams
    llm = LLM(str(path), **kw)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = [(list(o.outputs[0].token_ids),
             [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
            for o in llm.generate(ps, params)]
    return outs, llm


def test_llm_chunked_preempted_and_expert_cache(tmp_path):
    """vllm.LLM: chunked prefill (10-token budget) equals HF's greedy tokens; a KV cache too
    small for every request at once preempts and recomputes requests (their state restarts from
    zeros in a fresh slot) without changing a token; the expert cache at N in {1, top_k, E/2}
    gives the tokens and logprobs of no cache."""
    hf, ps = engine_checkpoint(tmp_path)
    ref, _ = run_llm(tmp_path, ps, max_num_batched_tokens=10)
    assert [t for t, _ in ref[:3]] == [hf_greedy(hf, p, 12) for p in ps[:3]]
    got, llm = run_llm(tmp_path, ps, block_size=4, num_gpu_blocks_override=14)
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    base, _ = run_llm(tmp_path, ps)
    for n in (1, TOP_K, E // 2):
        got, llm = run_llm(tmp_path, ps, moe_expert_cache_size=n)
        assert got == base, f"capacity {n}"
        assert llm.get_moe_cache_stats()["misses"] > 0


def test_abort_releases_state_slots(tmp_path):
    """Aborting a running and a waiting request gives the slot back (a waiting request takes
    it, from zero state whatever the slot holds); the survivors finish with the tokens they
    produce alone."""
    from vllm import SamplingParams
    _, ps = engine_checkpoint(tmp_path, "M*M-")
    alone, llm = run_llm(tmp_path, [ps[0], ps[2]], max_tokens=8, max_num_seqs=2)
    engine = llm.llm_engine
    slots = engine.scheduler.state_slots
    assert slots.num_slots == 2 and slots.num_free_slots == 2
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(ps[:4]):
        engine.add_request(str(i), p, params)
    engine.step()
    assert slots.num_used_slots == 2                  # two running, two waiting for a slot
    engine.abort_request(["1", "3"])
    slots.check_invariants()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
    assert finished == {"0": alone[0][0], "2": alone[1][0]}   # "2" reuses a freed slot
    assert slots.num_free_slots == 2
    slots.check_invariants()
