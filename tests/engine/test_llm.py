"""End-to-end LLM tests on tiny random models: parity with transformers, batching invariance,
preemption and chunked prefill, sampling, n > 1, stop strings, logprobs and error handling."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from vllm import LLM, SamplingParams

MOE_ARCHS = ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"]
DENSE_ARCHS = ["Qwen3ForCausalLM", "LlamaForCausalLM"]


def _prompts(n: int, seed: int = 0, vocab: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (n_,), generator=g).tolist() for n_ in lens]


def _hf_greedy(path: str, prompt: list[int], max_new: int) -> list[int]:
    """Greedy decoding with transformers' forward (no EOS handling, like ignore_eos=True)."""
    model = _hf_model(path)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


_HF_CACHE: dict = {}


def _hf_model(path: str):
    if path not in _HF_CACHE:
        _HF_CACHE[path] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32).eval()
    return _HF_CACHE[path]


def _greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("arch", MOE_ARCHS + DENSE_ARCHS)
def test_greedy_matches_transformers(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    prompts = _prompts(5, seed=1)
    llm = LLM(path, max_num_seqs=8)
    outs = llm.generate(prompts, _greedy(10))
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == _hf_greedy(path, prompt, 10)
        assert out.outputs[0].finish_reason == "length"


def test_prompt_forms_give_the_same_tokens(tiny_model_factory):
    """A string, a TextPrompt, a TokensPrompt and a bare id list of the same prompt."""
    from vllm import TextPrompt, TokensPrompt
    llm = LLM(tiny_model_factory("Qwen3MoeForCausalLM"))
    text = "def fibonacci(n):"
    ids = llm.get_tokenizer()(text)["input_ids"]
    outs = llm.generate([text, TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids), ids],
                        _greedy(6))
    assert [o.prompt_token_ids for o in outs] == [ids] * 4
    assert [o.prompt for o in outs[:2]] == [text, text]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_greedy_matches_transformers_on_torch_paths(tiny_model_factory, arch, torch_paths):
    path = tiny_model_factory(arch)
    prompts = _prompts(4, seed=3)
    llm = LLM(path, device="cpu", max_num_seqs=8)
    runner = llm.llm_engine.runner
    assert runner.moe_layers[0].quant_method.backend_name == "grouped_mm"   # not the C kernel
    assert not any(n.endswith("packed_weight") for n, _ in runner.model.named_buffers())
    for prompt, out in zip(prompts, llm.generate(prompts, _greedy(10))):
        assert out.outputs[0].token_ids == _hf_greedy(path, prompt, 10)


def test_batched_equals_one_by_one_and_constrained_runs(tiny_model_factory):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompts = _prompts(12, seed=2)
    params = _greedy(16)
    batched = [o.outputs[0].token_ids for o in LLM(path).generate(prompts, params)]
    single_llm = LLM(path, max_num_seqs=1)
    single = [single_llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert batched == single
    # Tiny token budget: every prompt is prefilled in chunks, mixed with other requests' decodes.
    chunked = LLM(path, max_num_batched_tokens=7)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == batched
    # Too few KV blocks for all requests at once: the newest ones get preempted and recomputed.
    preempt = LLM(path, block_size=4, num_gpu_blocks_override=24)
    outs = preempt.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == batched
    assert preempt.llm_engine.scheduler.num_preemptions_total > 0


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model_factory):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    llm = LLM(path)
    prompts = _prompts(6, seed=3)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompts[0]], p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, seed=None, max_tokens=12)
    mixed = llm.generate(prompts, [p] + [others] * 5)[0].outputs[0].token_ids
    assert alone == mixed
    other_seed = llm.generate([prompts[0]], p.clone(seed=8))[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_greater_than_one(tiny_model_factory):
    llm = LLM(tiny_model_factory("Qwen3MoeForCausalLM"))
    out = llm.generate(["def fibonacci(n):"], SamplingParams(n=3, temperature=1.0, seed=1,
                                                             max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_string_truncates_text(tiny_model_factory):
    llm = LLM(tiny_model_factory("Qwen3MoeForCausalLM"))
    prompt = "def fibonacci(n):"
    full = llm.generate([prompt], _greedy(24))[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:5]
    first = full.index(stop)
    out = llm.generate([prompt], _greedy(24, stop=[stop]))[0].outputs[0]
    assert out.text == full[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_logprobs_match_transformers(tiny_model_factory):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    prompt = _prompts(1, seed=4)[0]
    out = LLM(path).generate([prompt], _greedy(6, logprobs=3))[0].outputs[0]
    hf = _hf_model(path)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
    ref = logits.log_softmax(-1)[len(prompt) - 1:-1]
    assert len(out.logprobs) == 6
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert math.isclose(lp[tok].logprob, ref[i, tok].item(), abs_tol=1e-4)
        top = ref[i].topk(3).indices.tolist()
        assert set(top) <= set(lp)


def test_chat_uses_template(tiny_model_factory):
    llm = LLM(tiny_model_factory("Qwen3MoeForCausalLM"))
    out = llm.chat([{"role": "user", "content": "hello"}], _greedy(4))[0]
    assert out.prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert len(out.outputs[0].token_ids) == 4


def test_bad_inputs_get_clear_errors(tiny_model_factory, tmp_path):
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    with pytest.raises(TypeError, match="bogus_arg"):
        LLM(path, bogus_arg=1)
    with pytest.raises(ValueError, match="no such directory"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    llm = LLM(path, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32"):
        llm.generate([[5] * 40], _greedy(4))
    with pytest.raises(ValueError, match="token id 100000"):
        llm.generate([[5, 100000]], _greedy(4))
    # The engine still works after rejecting bad requests, and output stops at max_model_len.
    out = llm.generate([[5] * 28], _greedy(10))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_generation_config_eos_ids_stop_generation(tiny_model_factory, tmp_path):
    """A token listed as EOS in generation_config.json (besides the tokenizer's) ends a request."""
    import json
    import shutil
    src = tiny_model_factory("Qwen3MoeForCausalLM")
    path = tmp_path / "model"
    shutil.copytree(src, path)
    prompt = _prompts(1, seed=6)[0]
    free = LLM(str(path)).generate([prompt], _greedy(12))[0].outputs[0].token_ids
    stop_tok = free[4]
    first = free.index(stop_tok)
    with open(path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [0, stop_tok]}, f)
    llm = LLM(str(path))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.token_ids == free[:first + 1] and out.finish_reason == "stop"
    # ignore_eos keeps going past it, as with the tokenizer's EOS.
    assert llm.generate([prompt], _greedy(12))[0].outputs[0].token_ids == free


def test_output_kind_final_only_reports_each_request_once(tiny_model_factory):
    """FINAL_ONLY (what LLM.generate uses) reports a request only when it finishes, with the same
    outputs CUMULATIVE ends with; DELTA is rejected by name."""
    from vllm.sampling_params import RequestOutputKind
    llm = LLM(tiny_model_factory())
    engine = llm.llm_engine
    prompts = [[5, 6, 7], [8, 9]]
    results = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        for i, p in enumerate(prompts):
            engine.add_request(f"{kind.name}-{i}", {"prompt_token_ids": p},
                               SamplingParams(max_tokens=3 + 2 * i, n=2, seed=1,
                                              ignore_eos=True, output_kind=kind))
        reported = []
        while engine.has_unfinished_requests():
            reported += engine.step()
        results[kind] = reported
    cumulative, final = results[RequestOutputKind.CUMULATIVE], results[RequestOutputKind.FINAL_ONLY]
    assert any(not o.finished for o in cumulative)
    assert [o.finished for o in final] == [True, True]
    last = {o.request_id.split("-")[1]: o for o in cumulative if o.finished}
    for o in final:
        want = last[o.request_id.split("-")[1]]
        assert [(c.index, c.token_ids, c.text) for c in o.outputs] == \
            [(c.index, c.token_ids, c.text) for c in want.outputs]
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=RequestOutputKind.DELTA)


def test_shutdown_at_interpreter_exit_reports_cleanly(tiny_model_factory):
    """An LLM still alive when the script ends shuts down before module teardown: the expert
    cache's summary is logged and nothing is printed as an ignored exception (a ``__del__``
    at exit ran after module globals were cleared and raised TypeError)."""
    import subprocess
    import sys
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    script = ("from vllm import LLM, SamplingParams\n"
              f"llm = LLM(model={path!r}, moe_expert_cache_size=2, dtype='float32')\n"
              "llm.generate(['hello'], SamplingParams(max_tokens=3))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Exception ignored" not in proc.stderr, proc.stderr[-2000:]
    assert "at shutdown: expert cache" in proc.stderr + proc.stdout
