"""SamplingParams(prompt_logprobs=k): each prompt token's logprob given the tokens before it and
the top k at that position, against transformers' log_softmax of its own logits (float32), with
and without the expert cache, with chunked prefill splitting the prompt, with n > 1, and
independent of what else is in the batch."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from vllm import LLM, SamplingParams

PROMPTS = [[5, 17, 200, 33, 9, 120, 64, 2, 250, 18, 77, 91, 13, 140, 6, 44, 230, 71, 3, 100],
           [40, 41, 42], [7]]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("Qwen3MoeForCausalLM")


@pytest.fixture(scope="module")
def hf_logprobs(model_path):
    """prompt (tuple) -> [len, V] float32 log_softmax of transformers' logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return {tuple(p): model(torch.tensor([p])).logits[0].float().log_softmax(-1)
                for p in PROMPTS}


def _check(out, prompt, ref, k):
    """out.prompt_logprobs against ref [len, V]: entry i from row i - 1."""
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        row, tok = ref[i - 1], prompt[i]
        entry = plp[i]
        assert math.isclose(entry[tok].logprob, row[tok].item(), abs_tol=2e-5), (i, tok)
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {tok, *top}, (i, sorted(entry), top)
        for t in top:
            assert math.isclose(entry[t].logprob, row[t].item(), abs_tol=2e-5)
        assert entry[tok].decoded_token is not None


@pytest.mark.parametrize("cache", [None, 2])
@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_transformers(model_path, hf_logprobs, cache, k):
    llm = LLM(model_path, moe_expert_cache_size=cache, dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0,
                                                prompt_logprobs=k))
    for prompt, out in zip(PROMPTS, outs):
        _check(out, prompt, hf_logprobs[tuple(prompt)], k)
        assert len(out.outputs[0].token_ids) == 2


def test_chunked_prefill_splits_the_prompt(model_path, hf_logprobs):
    """max_num_batched_tokens=8: the 20-token prompt is computed in three chunks."""
    llm = LLM(model_path, dtype="float32", max_num_batched_tokens=8, max_num_seqs=2,
              enable_chunked_prefill=True)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    _check(out, PROMPTS[0], hf_logprobs[tuple(PROMPTS[0])], 2)


def test_rows_in_small_chunks(model_path, hf_logprobs, monkeypatch):
    """The logits of a step's prompt positions are made PROMPT_LOGPROB_ROWS at a time (memory):
    with 3, the 22 positions of one step come in 8 pieces, in order."""
    from vllm.worker import model_runner
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 3)
    llm = LLM(model_path, dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=2))
    for prompt, out in zip(PROMPTS, outs):
        _check(out, prompt, hf_logprobs[tuple(prompt)], 2)


def test_batch_invariant_and_n_greater_than_one(model_path):
    llm = LLM(model_path, dtype="float32")
    sp = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1, logprobs=2)
    alone_out = llm.generate([PROMPTS[0]], sp)[0]
    crowd_out = llm.generate([[9, 8, 7, 6]] * 5 + [PROMPTS[0]] + [[1, 2]] * 3, sp)[5]
    alone, crowd = alone_out.prompt_logprobs, crowd_out.prompt_logprobs
    assert [e and {t: lp.logprob for t, lp in e.items()} for e in alone] == \
        [e and {t: lp.logprob for t, lp in e.items()} for e in crowd]
    # Sampled tokens' logprobs too: bit for bit whatever else is in the batch.
    assert [{t: lp.logprob for t, lp in e.items()} for e in alone_out.outputs[0].logprobs] == \
        [{t: lp.logprob for t, lp in e.items()} for e in crowd_out.outputs[0].logprobs]
    fan = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=1.0, n=3, seed=1,
                                                    prompt_logprobs=1))[0]
    assert len(fan.outputs) == 3
    assert [e and {t: lp.logprob for t, lp in e.items()} for e in fan.prompt_logprobs] == \
        [e and {t: lp.logprob for t, lp in e.items()} for e in alone]


def test_without_the_option_there_are_none(model_path):
    out = LLM(model_path).generate([PROMPTS[1]], SamplingParams(max_tokens=1))[0]
    assert out.prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs=21 is invalid"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.parametrize("cache", [None, 8])
def test_default_model_prompt_logprobs_match_transformers(cache):
    import os

    import vllm
    if not os.path.isdir(vllm.DEFAULT_MODEL):
        pytest.skip("default model not shipped")
    text = "import os\n\ndef list_files(path):\n    return sorted(os.listdir(path))\n"
    llm = LLM(dtype="float32", moe_expert_cache_size=cache, device="cpu")
    out = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(vllm.DEFAULT_MODEL,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([out.prompt_token_ids])).logits[0].float().log_softmax(-1)
    _check(out, out.prompt_token_ids, ref, 2)
