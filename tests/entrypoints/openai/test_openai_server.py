"""A real `vllm serve` process driven by the official openai client: results must equal the
offline LLM (same model and engine arguments) for completions, chat, streaming, n > 1, stop
strings and logprobs; 32 concurrent clients; a client that hangs up mid-stream."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from openai_server_utils import API_KEY, SERVED_NAME
from vllm import SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "The quick brown fox",
           "for i in range(10):", "    return n", "print(i, i * i)", "self.items = []"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _offline(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw))[0]


def test_models_health_version(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]
    assert models["data"][0]["max_model_len"] == 128


def test_completion_matches_offline(client, offline_llm):
    for prompt in PROMPTS[:3]:
        resp = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=8,
                                         temperature=0)
        ref = _offline(offline_llm, prompt, max_tokens=8, temperature=0)
        choice = resp.choices[0]
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == ref.outputs[0].finish_reason
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_batch_of_prompts_token_ids_and_echo(client, offline_llm):
    token_prompt = offline_llm.get_tokenizer().encode(PROMPTS[3])
    prompts = [PROMPTS[0], PROMPTS[1]]
    resp = client.completions.create(model=SERVED_NAME, prompt=prompts, max_tokens=6,
                                     temperature=0, echo=True)
    refs = offline_llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    assert [c.index for c in resp.choices] == [0, 1]
    for c, p, ref in zip(resp.choices, prompts, refs):
        assert c.text == p + ref.outputs[0].text
    resp = client.completions.create(model=SERVED_NAME, prompt=[token_prompt, token_prompt[:2]],
                                     max_tokens=5, temperature=0)
    refs = offline_llm.generate([token_prompt, token_prompt[:2]],
                                SamplingParams(max_tokens=5, temperature=0))
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in refs]


def test_streaming_completion_equals_offline(client, offline_llm):
    ref = _offline(offline_llm, PROMPTS[4], max_tokens=10, temperature=0)
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[4], max_tokens=10,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts.append(c.text)
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert "".join(texts) == ref.outputs[0].text
    assert finishes == [ref.outputs[0].finish_reason]
    assert usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert usage.prompt_tokens == len(ref.prompt_token_ids)


def test_sse_wire_format_ends_with_done(server):
    body = {"model": SERVED_NAME, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][len("data: "):])
    assert first["object"] == "text_completion" and first["id"].startswith("cmpl-")


def test_n_greater_than_one_seeded(client, offline_llm):
    kw = dict(max_tokens=6, temperature=1.0, seed=123)
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[5], n=3, **kw)
    ref = _offline(offline_llm, PROMPTS[5], n=3, **kw)
    got = sorted(resp.choices, key=lambda c: c.index)
    assert [c.index for c in got] == [0, 1, 2]
    assert [c.text for c in got] == [o.text for o in sorted(ref.outputs, key=lambda o: o.index)]
    # Streaming n > 1: every choice reassembles to the same text, one finish each.
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[5], n=3, stream=True,
                                       **kw)
    texts, finishes = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = finishes.get(c.index, 0) + 1
    assert [texts[i] for i in range(3)] == [c.text for c in got]
    assert finishes == {0: 1, 1: 1, 2: 1}


def test_stop_string(client, offline_llm):
    free = _offline(offline_llm, PROMPTS[6], max_tokens=16, temperature=0).outputs[0].text
    stop = next((free[i:i + 2] for i in range(3, len(free) - 1) if free[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"greedy output {free!r} has no usable stop string")
    ref = _offline(offline_llm, PROMPTS[6], max_tokens=16, temperature=0, stop=[stop])
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[6], max_tokens=16,
                                     temperature=0, stop=[stop])
    assert resp.choices[0].text == ref.outputs[0].text == free[:free.index(stop)]
    assert resp.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[6], max_tokens=16,
                                       temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref.outputs[0].text


def test_completion_logprobs(client, offline_llm):
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[7], max_tokens=5,
                                     temperature=0, logprobs=2)
    ref = _offline(offline_llm, PROMPTS[7], max_tokens=5, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    out = ref.outputs[0]
    want = [entries[t].logprob for t, entries in zip(out.token_ids, out.logprobs)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(out.token_ids)
    for tok_lp, top, entries in zip(lp.token_logprobs, lp.top_logprobs, out.logprobs):
        # OpenAI's format keys alternatives by token text (distinct tokens may share one).
        assert set(top) == {e.decoded_token for e in entries.values()}
        assert 1 <= len(top) <= 3  # the sampled token plus the top 2
        # Greedy: no alternative is more likely than the sampled token.
        assert max(top.values()) <= tok_lp + 1e-6


def test_echo_with_logprobs_reports_the_prompt_tokens(client, offline_llm):
    """lm-evaluation-harness' loglikelihood request: echo + logprobs (+ max_tokens 0 or 1)."""
    prompt = PROMPTS[3]
    ref = _offline(offline_llm, prompt, max_tokens=2, temperature=0, logprobs=1,
                   prompt_logprobs=1)
    ids = ref.prompt_token_ids
    want_prompt = [None] + [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ids)
                            if i > 0]
    out = ref.outputs[0]
    want_out = [e[t].logprob for t, e in zip(out.token_ids, out.logprobs)]
    for max_tokens, tail in ((0, []), (2, want_out)):
        resp = client.completions.create(model=SERVED_NAME, prompt=prompt, echo=True,
                                         logprobs=1, max_tokens=max_tokens, temperature=0)
        ch = resp.choices[0]
        assert ch.text == prompt + (out.text if max_tokens else "")
        lp = ch.logprobs
        assert len(lp.tokens) == len(ids) + len(tail)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(want_prompt[1:] + tail, abs=1e-4)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert "".join(lp.tokens[:len(ids)]) == prompt
        assert resp.usage.completion_tokens == len(tail)
    streamed = list(client.completions.create(model=SERVED_NAME, prompt=prompt, echo=True,
                                              logprobs=1, max_tokens=2, temperature=0,
                                              stream=True))
    token_lps = [x for c in streamed for ch in c.choices if ch.logprobs
                 for x in ch.logprobs.token_logprobs]
    assert token_lps[0] is None
    assert token_lps[1:] == pytest.approx(want_prompt[1:] + want_out, abs=1e-4)
    assert "".join(ch.text for c in streamed for ch in c.choices) == prompt + out.text


def test_prompt_logprobs_field(server):
    import httpx
    resp = httpx.post(server.url + "/v1/completions", timeout=60, headers={
        "Authorization": f"Bearer {API_KEY}"}, json={
        "model": SERVED_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 1, "prompt_logprobs": 2})
    assert resp.status_code == 200, resp.text
    plp = resp.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 4
    assert all(str(t) in plp[i] and 1 <= len(plp[i]) <= 3 for i, t in enumerate([5, 6, 7, 8])
               if i > 0)


def test_chat_matches_offline(client, offline_llm):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "def fibonacci(n):"}]
    resp = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=8,
                                          temperature=0)
    ref = offline_llm.chat(messages, SamplingParams(max_tokens=8, temperature=0))[0]
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and
            c.choices[0].finish_reason] == [ref.outputs[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_chat_template_kwargs_reach_the_renderer(server, offline_llm):
    """chat_template_kwargs travel to the template (this model's ignores an unknown variable;
    tests/engine/test_harmony_chat_template.py checks them rendered); a name the rendering call
    sets is a 400 naming the field, on /v1/chat/completions and /tokenize."""
    messages = [{"role": "user", "content": "import os"}]
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=60,  # noqa: E731
                                         headers={"Authorization": f"Bearer {API_KEY}"})
    want = offline_llm.llm_engine.render_chat(messages)["prompt_token_ids"]
    got = post("/tokenize", {"messages": messages,
                             "chat_template_kwargs": {"reasoning_effort": "low"}}).json()
    assert got["tokens"] == want
    for path, extra in (("/v1/chat/completions", {"model": SERVED_NAME, "max_tokens": 1}),
                        ("/tokenize", {})):
        bad = post(path, {"messages": messages, "chat_template_kwargs": {"tokenize": True},
                          **extra})
        assert bad.status_code == 400, path
        assert bad.json()["error"]["param"] == "chat_template_kwargs", bad.json()


def test_chat_logprobs_and_n(client, offline_llm):
    messages = [{"role": "user", "content": [{"type": "text", "text": "import os"}]}]
    resp = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3, n=2)
    ref = offline_llm.chat([{"role": "user", "content": "import os"}],
                           SamplingParams(max_tokens=4, temperature=0, logprobs=3, n=2))[0]
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert choice.message.content == ref.outputs[0].text
        content = choice.logprobs.content
        assert len(content) == len(ref.outputs[0].token_ids)
        for item in content:
            assert len(item.top_logprobs) == 3
            assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-6)


def test_32_concurrent_clients(server, offline_llm):
    """32 clients x 4 requests (half of them streaming): every answer complete and its own."""
    jobs = [(c, j, PROMPTS[(c + j) % len(PROMPTS)], 3 + (c * 4 + j) % 4)
            for c in range(32) for j in range(4)]
    combos = sorted({(p, m) for _, _, p, m in jobs})
    refs = {}
    for m in {m for _, m in combos}:
        ps = [p for p, mm in combos if mm == m]
        for p, out in zip(ps, offline_llm.generate(ps, SamplingParams(max_tokens=m,
                                                                      temperature=0))):
            refs[(p, m)] = out.outputs[0].text

    async def one_client(aclient, c):
        got = []
        for j in range(4):
            _, _, prompt, m = jobs[c * 4 + j]
            if j % 2 == 0:
                r = await aclient.completions.create(model=SERVED_NAME, prompt=prompt,
                                                     max_tokens=m, temperature=0)
                got.append((c, j, r.choices[0].text, r.choices[0].finish_reason))
            else:
                parts, finish = [], None
                async for chunk in await aclient.completions.create(
                        model=SERVED_NAME, prompt=prompt, max_tokens=m, temperature=0,
                        stream=True):
                    for ch in chunk.choices:
                        parts.append(ch.text)
                        finish = ch.finish_reason or finish
                got.append((c, j, "".join(parts), finish))
        return got

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY,
                                      max_retries=0, timeout=300) as aclient:
            results = await asyncio.wait_for(
                asyncio.gather(*(one_client(aclient, c) for c in range(32))), timeout=600)
        return [r for client_results in results for r in client_results]

    results = asyncio.run(main())
    assert sorted((c, j) for c, j, _, _ in results) == [(c, j) for c in range(32)
                                                         for j in range(4)]
    for c, j, text, finish in results:
        _, _, prompt, m = jobs[c * 4 + j]
        assert text == refs[(prompt, m)], (c, j)
        assert finish in ("stop", "length")
    assert server.metric("vllm:num_requests_running") == 0


def test_client_disconnect_mid_stream_frees_blocks(server, client):
    aborted_before = server.metric("vllm:request_aborted_total")
    body = {"model": SERVED_NAME, "prompt": "class Stack:", "max_tokens": 110,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as hc:
        with hc.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += bool(line.startswith("data: {"))
                if seen >= 3:
                    break  # hang up: leaving the block closes the connection
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (server.metric("vllm:num_requests_running") == 0
                and server.metric("vllm:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.2)
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:num_requests_waiting") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0
    assert server.metric("vllm:num_free_kv_blocks") == server.metric("vllm:num_kv_blocks")
    assert server.metric("vllm:request_aborted_total") == aborted_before + 1
    # The server goes on serving.
    resp = client.completions.create(model=SERVED_NAME, prompt="import os", max_tokens=3)
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_client_disconnect_while_waiting_for_a_full_response(server):
    """A non-streaming client that hangs up while its request runs: the request is aborted.
    The client closes its socket once /metrics shows the request running (a timeout would
    race the server's speed)."""
    aborted_before = server.metric("vllm:request_aborted_total")
    body = json.dumps({"model": SERVED_NAME, "prompt": "class Stack:", "max_tokens": 115,
                       "ignore_eos": True, "n": 64}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            f"{API_KEY}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            "\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 30
        while server.metric("vllm:num_requests_running") == 0:
            assert time.monotonic() < deadline, "the request never ran"
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):       # no response yet: it is still running
            sock.recv(1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.metric("vllm:request_aborted_total") == \
            aborted_before:
        time.sleep(0.2)
    assert server.metric("vllm:request_aborted_total") == aborted_before + 1
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0


def test_metrics_counts_tokens_and_expert_cache(server, client):
    before = server.metric("vllm:generation_tokens_total")
    ok_before = server.metric("vllm:http_requests_total", route="/v1/completions", status="200")
    resp = client.completions.create(model=SERVED_NAME, prompt="for i in", max_tokens=4,
                                     temperature=0)
    assert (server.metric("vllm:generation_tokens_total") - before
            == resp.usage.completion_tokens)
    assert server.metric("vllm:http_requests_total", route="/v1/completions",
                         status="200") == ok_before + 1
    # The tiny model has 2 MoE layers and the server runs with 3 expert slots per layer.
    for field in ("hits", "misses", "evictions", "bytes_copied"):
        for layer in ("0", "1"):
            server.metric(f"vllm:moe_expert_cache_{field}_total", layer=layer)  # KeyError if absent
        with pytest.raises(KeyError):
            server.metric(f"vllm:moe_expert_cache_{field}_total", layer="2")
    lookups = (server.metric("vllm:moe_expert_cache_hits_total", layer="0")
               + server.metric("vllm:moe_expert_cache_misses_total", layer="0"))
    assert lookups > 0
    assert server.metric("vllm:moe_expert_cache_bytes_copied_total") > 0


def test_tokenize_and_detokenize(server, offline_llm):
    tok = offline_llm.llm_engine.tokenizer
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=60)  # noqa: E731
    r = post("/tokenize", {"prompt": PROMPTS[0], "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPTS[0]) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 128
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat = post("/tokenize", {"messages": messages}).json()
    want = offline_llm.llm_engine.render_chat(messages)["prompt_token_ids"]
    assert chat["tokens"] == want and chat["token_strs"] is None
    assert post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": PROMPTS[0]}
    bad = post("/detokenize", {"tokens": [1, 10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = post("/tokenize", {"prompt": "a", "messages": messages})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    refused = post("/tokenize", {"messages": messages, "chat_template": "{{ 1 }}"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"


def test_chat_prompt_logprobs(client, offline_llm):
    messages = [{"role": "user", "content": PROMPTS[2]}]
    resp = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    plp = resp.model_extra["prompt_logprobs"]
    ids = offline_llm.llm_engine.render_chat(messages)["prompt_token_ids"]
    assert len(plp) == len(ids) and plp[0] is None
    assert all(set(plp[i]) == {str(t)} for i, t in enumerate(ids) if i > 0)
