import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from vllm.core.request import Request, RequestStatus
from vllm.engine.output_processor import (IncrementalDetokenizer, OutputProcessor,
                                          make_request_output)
from vllm.outputs import Logprob
from vllm.sampling_params import SamplingParams

TEXT = ["hello world, the quick brown fox jumps over the lazy dog",
        "héllo wörld: naïve café déjà vu — ünïcödé",
        "你好世界，今天天气很好。日本語のテキストも少し",
        "emoji 🙂🚀 and symbols ∑∫≈ mixed with ascii text END"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(TEXT, trainer)
    return t


class SlowOnly:
    """Exposes only ``decode`` so the detokenizer takes its prefix-offset fallback."""

    def __init__(self, t: Tokenizer):
        self.t = t

    def decode(self, ids, skip_special_tokens=True):
        return self.t.decode(ids, skip_special_tokens=skip_special_tokens)


def make_req(tok, prompt="hello ", eos=0, **sp) -> Request:
    return Request("r", prompt, tok.encode(prompt).ids, SamplingParams(**sp), eos_token_id=eos)


def feed(proc, req, ids):
    """Append tokens one per step like the scheduler, processing each; stop at a finish."""
    results = []
    for t in ids:
        req.output_token_ids.append(t)
        results.append(proc.process(req))
        if results[-1].finished:
            break
    return results


@pytest.mark.parametrize("slow", [False, True])
def test_detokenizer_equals_full_decode_with_multibyte_text(tok, slow):
    rng = random.Random(0)
    tk = SlowOnly(tok) if slow else tok
    for text in TEXT:
        ids = tok.encode(text).ids
        cut = rng.randint(1, len(ids) - 1)
        # Cut the prompt at a token boundary where the prompt decodes cleanly.
        while "\ufffd" in tok.decode(ids[:cut]):
            cut -= 1
        prompt, output = ids[:cut], ids[cut:]
        d = IncrementalDetokenizer(tk, prompt, skip_special_tokens=True)
        pieces = [d.add_tokens([t]) for t in output]
        assert "".join(pieces) == d.output_text == tok.decode(output)
        assert tok.decode(prompt) + d.output_text == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces)


def test_fixture_splits_multibyte_characters_across_tokens(tok):
    # Guards the test above: single tokens must decode to partial UTF-8 (U+FFFD) somewhere.
    partial = [i for text in TEXT[2:] for i in tok.encode(text).ids if "\ufffd" in tok.decode([i])]
    assert len(partial) >= 4
    assert len(tok.encode("🚀").ids) > 1


def test_skip_special_tokens(tok):
    ids = tok.encode("hello world").ids + [0] + tok.encode(" fox").ids
    for skip in (True, False):
        d = IncrementalDetokenizer(tok, tok.encode("the ").ids, skip_special_tokens=skip)
        d.add_tokens(ids)
        assert d.output_text == tok.decode(ids, skip_special_tokens=skip)


def test_hf_tokenizer_uses_its_fast_backend(tok):
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = tok.encode("naïve café 🙂").ids
    d = IncrementalDetokenizer(hf, [], skip_special_tokens=True)
    assert d._backend is not None
    d.add_tokens(ids)
    assert d.output_text == hf.decode(ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    out_text = "the quick brown fox jumps over"
    ids = tok.encode(out_text).ids
    stop = "n fox j"  # spans several tokens
    req = make_req(tok, stop=[stop, "never"], include_stop_str_in_output=include, max_tokens=50)
    proc = OutputProcessor(tok)
    results = feed(proc, req, ids)
    last = results[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == stop
    assert last.finish_status is RequestStatus.FINISHED_STOPPED
    end = out_text.index(stop)
    assert last.text == (out_text[:end + len(stop)] if include else out_text[:end])
    # It stops at the first token whose text completes the stop string.
    n = len(results)
    assert stop in tok.decode(ids[:n]) and stop not in tok.decode(ids[:n - 1])
    assert req.output_token_ids == ids[:n]
    # Streaming deltas add up to the final text and never reveal text past the stop.
    assert "".join(r.delta_text for r in results) == last.text
    assert proc.num_tracked == 0


def test_earliest_stop_string_wins(tok):
    ids = tok.encode("lazy dog").ids
    req = make_req(tok, stop=["dog", "lazy"], max_tokens=50)
    last = feed(OutputProcessor(tok), req, ids)[-1]
    assert last.stop_reason == "lazy" and last.text == ""


def test_stop_token_id_kept_in_tokens_not_text(tok):
    ids = tok.encode("quick brown").ids
    stop_id = ids[1]
    req = make_req(tok, stop_token_ids=[stop_id], max_tokens=50)
    last = feed(OutputProcessor(tok), req, ids)[-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop_id
    assert req.output_token_ids == ids[:2]
    assert last.text == tok.decode(ids[:1])
    out = make_request_output(req, last)
    assert out.finished and out.outputs[0].token_ids == ids[:2]


def test_eos_stops_unless_ignored(tok):
    ids = tok.encode("hello").ids + [0] + tok.encode(" world").ids
    req = make_req(tok, max_tokens=50)
    last = feed(OutputProcessor(tok), req, ids)[-1]
    assert last.finish_reason == "stop" and last.stop_reason is None
    assert req.output_token_ids[-1] == 0 and last.text == "hello"
    req = make_req(tok, max_tokens=50, ignore_eos=True)
    results = feed(OutputProcessor(tok), req, ids)
    assert not results[-1].finished and results[-1].text == "hello world"


def test_min_tokens_defers_eos_stop_tokens_and_stop_strings(tok):
    req = make_req(tok, max_tokens=50, min_tokens=3, stop=["ab"], stop_token_ids=[5])
    proc = OutputProcessor(tok)
    assert not feed(proc, req, [0])[-1].finished  # EOS as 1st token: below min_tokens
    assert not feed(proc, req, [5])[-1].finished  # stop token as 2nd token
    res = feed(proc, req, [0])[-1]  # 3rd token reaches min_tokens: EOS now stops
    assert res.finished and res.finish_reason == "stop"


def test_max_tokens_and_max_model_len_give_length(tok):
    ids = tok.encode("the quick brown fox").ids
    req = make_req(tok, max_tokens=3)
    results = feed(OutputProcessor(tok), req, ids)
    assert len(results) == 3 and results[-1].finish_reason == "length"
    assert results[-1].finish_status is RequestStatus.FINISHED_LENGTH
    req = make_req(tok, max_tokens=None)
    n_prompt = req.num_prompt_tokens
    results = feed(OutputProcessor(tok, max_model_len=n_prompt + 2), req, ids)
    assert len(results) == 2 and results[-1].finish_reason == "length"


def test_stop_beats_length_on_the_same_token(tok):
    req = make_req(tok, max_tokens=2)
    last = feed(OutputProcessor(tok), req, tok.encode("hi").ids[:1] + [0])[-1]
    assert last.finish_reason == "stop"


def test_aborted_and_failed_requests(tok):
    proc = OutputProcessor(tok)
    req = make_req(tok, max_tokens=50)
    feed(proc, req, tok.encode("hello").ids)
    req.status = RequestStatus.FINISHED_ABORTED  # as Scheduler.abort_requests leaves it
    res = proc.process(req)
    assert res.finished and res.finish_reason == "abort" and res.finish_status is None
    assert res.text == "hello" and proc.num_tracked == 0
    bad = make_req(tok)
    bad.status, bad.error = RequestStatus.FINISHED_ERROR, "too long"
    out = make_request_output(bad, proc.process(bad))
    assert out.finished and out.error == "too long" and out.outputs == []


def test_make_request_output_with_logprobs_and_deltas(tok):
    ids = tok.encode("hello world").ids
    req = make_req(tok, max_tokens=len(ids), logprobs=1)
    proc = OutputProcessor(tok)
    streamed_text, streamed_ids = "", []
    for k, t in enumerate(ids):
        req.output_token_ids.append(t)
        req.output_logprobs.append({t: Logprob(-0.5, rank=1)})
        req.cumulative_logprob = -0.5 * (k + 1)
        res = proc.process(req)
        delta = make_request_output(req, res, delta=True)
        streamed_text += delta.outputs[0].text
        streamed_ids += delta.outputs[0].token_ids
    full = make_request_output(req, res)
    c = full.outputs[0]
    assert full.finished and c.finish_reason == "length"
    assert c.text == streamed_text == "hello world" and c.token_ids == streamed_ids == ids
    assert c.cumulative_logprob == pytest.approx(-0.5 * len(ids))
    assert len(c.logprobs) == len(ids)
    assert c.logprobs[0][ids[0]].decoded_token == tok.decode([ids[0]])
    assert full.prompt == "hello " and full.prompt_token_ids == req.prompt_token_ids


def test_engine_loop_with_scheduler_and_sampler(tok):
    """The loop LLMEngine runs: schedule -> (fake runner + real sampler) -> update -> process."""
    import torch

    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.core.sched_output import RunnerOutput
    from vllm.core.scheduler import Scheduler
    from vllm.worker.sampler import Sampler, SamplingMetadata

    target = tok.encode(" jumps over the lazy dog").ids  # the fake model always predicts these
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6),
                      CacheConfig(block_size=2, num_gpu_blocks=12), max_model_len=64)
    proc, sampler, gens = OutputProcessor(tok, max_model_len=64), Sampler(), {}
    reqs = [make_req(tok, "the quick brown fox", max_tokens=20, stop=["lazy"]),
            make_req(tok, "hello", max_tokens=3, temperature=0.8, seed=3)]
    reqs[1].request_id = "r2"
    for r in reqs:
        sched.add_request(r)
    finals = {}
    for _ in range(60):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        md = SamplingMetadata.build(out.sequences, gens, "cpu", eos_token_id=0)
        logits = torch.full((len(md.req_ids), tok.get_vocab_size()), -20.0)
        for row, rid in enumerate(md.req_ids):
            n_out = sched.requests[rid].num_output_tokens
            logits[row, target[n_out % len(target)]] = 20.0
        sampled = dict(zip(md.req_ids, sampler(logits, md)))
        for rid in out.finished_req_ids:
            gens.pop(rid, None)
        for req in sched.update_from_output(out, RunnerOutput(sampled)):
            res = proc.process(req)
            if res.finish_status is not None:
                sched.finish_request(req.request_id, res.finish_status, res.stop_reason)
            if res.finished:
                finals[req.request_id] = make_request_output(req, res)
    assert not sched.has_unfinished_requests() and sched.kv_usage == 0.0
    a, b = finals["r"].outputs[0], finals["r2"].outputs[0]
    assert (a.text, a.finish_reason, a.stop_reason) == (" jumps over the ", "stop", "lazy")
    assert (b.finish_reason, b.token_ids, b.text) == ("length", target[:3], tok.decode(target[:3]))
