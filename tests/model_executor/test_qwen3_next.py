"""Qwen3-Next and Qwen3.5-MoE (text) vs transformers on tiny random checkpoints (fp32): 32
greedy tokens equal HF's greedy ``generate`` through our paged driver and through the engine,
with prompts longer than one prefill chunk (and than one delta-rule chunk of 64), a batch of
mixed lengths and a request preempted and recomputed; the expert cache changes no token or
logprob; aborted requests give their state slot back, and a request reusing it is unaffected."""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm import LLM, SamplingParams
from vllm.model_executor.layers.recurrent_state import state_bytes_per_slot
from vllm.model_executor.model_loader import get_model

from tiny_checkpoints import PagedDriver, build_checkpoint, hf_logits, make_vllm_config
from tiny_models import VOCAB, make_tokenizer

ARCHS = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")
NEW_TOKENS = 32
LENS = (70, 5, 17, 9)
"""70: more than one engine prefill chunk (16 tokens here) and one delta-rule chunk (64)."""
TOL = dict(atol=1e-4, rtol=1e-4)
HF_ERR_FACTOR = 2
"""Where HF's own fp32 error exceeds TOL, ours may be up to this many times HF's."""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """arch -> (path, HF model, prompts, HF's greedy tokens per prompt), built once."""
    cache = {}

    def get(arch):
        if arch not in cache:
            path = tmp_path_factory.mktemp(arch)
            hf = build_checkpoint(arch, path, vocab_size=VOCAB, eos_token_id=0,
                                  bos_token_id=0, pad_token_id=0)
            make_tokenizer(path)
            g = torch.Generator().manual_seed(len(arch))
            ps = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENS]
            cache[arch] = (str(path), hf, ps, [hf_greedy(hf, p) for p in ps])
        return cache[arch]
    return get


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """HF's greedy ``generate`` (its cache: chunked form for the prompt, then the recurrent
    form), EOS not special."""
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                      max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def paged_greedy(model, ps, chunk=16, preempt=(1, 8)):
    """Greedy-decode through PagedDriver: prompt i joins at step i, prompts in chunks of
    ``chunk``, decodes first. ``preempt=(i, n)``: once request i has n tokens it is dropped
    (blocks and slot back) and recomputed from token 0 (prompt + outputs as a prefill).
    Returns (tokens, logits rows per request: only the rows since its last (re)start)."""
    drv = PagedDriver(model, num_blocks=128, block_size=4, num_slots=len(ps))
    fed, gen = [0] * len(ps), [[] for _ in ps]
    rows: list[list[torch.Tensor]] = [[] for _ in ps]
    step = 0
    while any(len(g) < NEW_TOKENS for g in gen):
        if preempt and len(gen[preempt[0]]) == preempt[1]:
            drv.release(str(preempt[0]))
            fed[preempt[0]], rows[preempt[0]], preempt = 0, [], None
        decodes, prefills = [], []
        for i, p in enumerate(ps):
            known = p + gen[i]
            if i > step or len(gen[i]) == NEW_TOKENS:
                continue
            (decodes if gen[i] and fed[i] == len(known) - 1 else prefills).append(
                (str(i), known[fed[i]:fed[i] + chunk]))
        out = drv.step(decodes + prefills, num_decodes=len(decodes))
        for sid, toks in decodes + prefills:
            i = int(sid)
            rows[i].append(out[sid])
            fed[i] += len(toks)
            if fed[i] == len(ps[i]) + len(gen[i]):
                gen[i].append(int(out[sid][-1].argmax()))
        step += 1
    return gen, [torch.cat(r) for r in rows]


class _Fp64Torch(types.ModuleType):
    """``torch`` as seen by a transformers modeling module, its fp32 dtypes read as fp64."""
    float32 = float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def _fp64_inside(module_name: str):
    """transformers' Qwen3-Next / Qwen3.5 code computes in fp32 whatever the model dtype (the
    delta rule, the RMSNorms, the gated norm, rotary, softmaxes: ``.to(torch.float32)``,
    ``.float()``), so ``hf.double()`` is no fp64 reference: on request 0 it is 1.8e-4 off the
    true fp64 logits, more than HF fp32 is. Here those casts keep fp64."""
    mod, tensor_float = sys.modules[module_name], torch.Tensor.float

    def keep_fp64(t, *args, **kwargs):
        return t if t.dtype == torch.float64 else tensor_float(t, *args, **kwargs)

    saved = mod.torch
    mod.torch, torch.Tensor.float = _Fp64Torch("torch"), keep_fp64
    try:
        yield
    finally:
        mod.torch, torch.Tensor.float = saved, tensor_float


@torch.no_grad()
def hf_logits_fp64(hf, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] logits of HF's model computed in fp64 throughout."""
    hf64 = copy.deepcopy(hf)
    hf64.config._experts_implementation = "eager"      # its grouped-mm experts take no fp64
    hf64 = hf64.double()
    with _fp64_inside(type(hf).__module__):
        return hf64(torch.tensor([token_ids])).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_paged_greedy_equals_transformers(ckpt, arch):
    """Logits against fp64, not HF fp32: HF's 64-token delta-rule chunk sums the log decays
    (-7 to -17 a token on average here) to -430 or lower in fp32, whose rounding (3e-5 and up)
    the decay ratios exp(g_i - g_j) inherit near the chunk's end; our 16-token engine chunks
    sum fewer. So (on a Xeon) at row 63 of request 0 HF fp32 is 1.6e-4 off fp64, ours
    6.5e-5: the two differ by more than TOL although ours is the closer. Ours must be within
    TOL of fp64, or no worse than HF_ERR_FACTOR times HF's own error."""
    path, hf, ps, ref = ckpt(arch)
    gen, rows = paged_greedy(get_model(make_vllm_config(path)), ps)
    assert gen == ref
    for i in (0, 2, 3):                                   # 1 was preempted: tokens only
        ids = ps[i] + gen[i][:-1]
        exact = hf_logits_fp64(hf, ids)
        hf_err = (hf_logits(hf, ids).double() - exact).abs().max().item()
        torch.testing.assert_close(rows[i].double(), exact, rtol=TOL["rtol"],
                                   atol=max(TOL["atol"], HF_ERR_FACTOR * hf_err))


def test_torch_paths(ckpt, torch_paths):
    """Without the C kernels every layer takes its torch path (as on other devices)."""
    path, hf, ps, ref = ckpt(ARCHS[0])
    gen, _ = paged_greedy(get_model(make_vllm_config(path)), ps[:2], preempt=None)
    assert gen == ref[:2]


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_chunked_prefill_batch_and_preemption(ckpt, arch):
    """vllm.LLM with 16-token prefill chunks and too few KV blocks for the whole batch (the
    newest requests get preempted and recomputed): HF's tokens; every slot back at the end;
    decode steps run eagerly (no CPU graphs for recurrent layers)."""
    path, _, ps, ref = ckpt(arch)
    llm = LLM(path, max_num_batched_tokens=16, block_size=4, num_gpu_blocks_override=32,
              max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    assert _tokens(outs) == ref
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.vllm_config.cache_config.num_state_slots == 4
    assert engine.scheduler.state_slots.num_free_slots == 4
    assert engine.runner.decode_graphs is None


def test_expert_cache_changes_no_token(ckpt):
    """moe_expert_cache_size N in {1, top_k, E/2}: the tokens and logprobs of N=0 (bitwise)."""
    path, _, ps, ref = ckpt(ARCHS[0])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run(n):
        llm = LLM(path, moe_expert_cache_size=n, max_num_batched_tokens=16)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
        return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items())
                                          for d in o.outputs[0].logprobs]) for o in outs], llm

    base, _ = run(0)
    assert [list(t) for t, _ in base] == [r[:12] for r in ref]
    E, K = 8, 2
    for n in (1, K, E // 2):
        got, llm = run(n)
        assert got == base, f"capacity {n}"
        assert llm.get_moe_cache_stats()["misses"] > 0


def test_abort_frees_slots_and_a_reused_slot_starts_clean(ckpt):
    """Aborted requests give their slot back (a leak fails the count); a request admitted into
    a slot an aborted one left mid-generation still gets HF's tokens. The KV budget is what is
    left after the state pool."""
    path, _, ps, ref = ckpt(ARCHS[1])
    llm = LLM(path, max_num_seqs=2, max_num_batched_tokens=16, block_size=4,
              kv_cache_memory_bytes=1 << 20)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    state = 2 * state_bytes_per_slot(runner.state_layers)
    assert runner.num_blocks == min(((1 << 20) - state) // runner.kv_bytes_per_block(),
                                    2 * -(-engine.vllm_config.model_config.max_model_len // 4))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": ps[i]}, params)
    sched = engine.scheduler
    for _ in range(8):
        engine.step()
        assert sched.state_slots.num_used_slots == sched.num_running <= 2
    assert sched.num_running == 2
    engine.abort_request(["r0", "r1"])
    assert sched.state_slots.num_used_slots == 0 and sched.num_waiting == 1
    engine.add_request("again", {"prompt_token_ids": ps[3]}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        assert sched.state_slots.num_used_slots == sched.num_running
    assert done == {"r2": ref[2], "again": ref[3]}
    assert sched.state_slots.num_free_slots == 2


def test_checkpoint_prefixes_mtp_and_visual_skipped(ckpt, tmp_path):
    """Names under ``model.language_model.`` load as ``model.``; ``mtp.*`` and ``model.visual.*``
    are skipped; any other unknown tensor still fails."""
    path, hf, ps, _ = ckpt(ARCHS[1])
    tensors = load_file(os.path.join(path, "model.safetensors"))
    renamed = {("model.language_model." + k[6:] if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    renamed["mtp.fc.weight"] = torch.zeros(4, 4)
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
    for f in ("config.json",):
        os.symlink(os.path.join(path, f), tmp_path / f)
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = get_model(make_vllm_config(tmp_path))
    with torch.no_grad():
        ours = model.compute_logits(model(torch.tensor(ps[2]), torch.arange(len(ps[2]))))
    torch.testing.assert_close(ours, hf_logits(hf, ps[2]), **TOL)
    renamed["model.language_model.layers.0.linear_attn.extra"] = torch.zeros(2)
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="linear_attn.extra"):
        get_model(make_vllm_config(tmp_path))


def test_state_pool_capped_at_half_the_budget(ckpt):
    """max_num_seqs slots would take more than half the memory budget: fewer slots (admission
    waits for one), the rest of the budget for KV blocks; tokens unchanged."""
    path, _, ps, ref = ckpt(ARCHS[0])
    budget = 100_000
    llm = LLM(path, max_num_seqs=16, block_size=4, kv_cache_memory_bytes=budget)
    runner, cc = llm.llm_engine.runner, llm.llm_engine.vllm_config.cache_config
    per_slot = state_bytes_per_slot(runner.state_layers)
    assert 16 * per_slot > budget // 2
    assert cc.num_state_slots == budget // 2 // per_slot and 1 <= cc.num_state_slots < 16
    assert runner.num_blocks == (budget - cc.num_state_slots * per_slot) // \
        runner.kv_bytes_per_block()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert _tokens(llm.generate([{"prompt_token_ids": p} for p in ps], params)) == ref
