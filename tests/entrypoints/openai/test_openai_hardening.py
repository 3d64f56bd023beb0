"""Hostile and careless requests against a real `vllm serve`: each is refused with a 400 naming
the problem (or handled), the other clients keep being served while it is in flight (a
concurrent small request finishes within a bound relative to its own unloaded latency, measured
here), and the server is healthy afterwards. Also CORS, HTTP/1.1 pipelining, and shutdown."""
from __future__ import annotations

import json
import signal
import socket
import statistics
import threading
import time

import httpx
import pytest

from openai_server_utils import API_KEY, SERVED_NAME, RemoteServer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# ~2.5 s of rendering on this project's machines (36M sandboxed multiplications).
NESTED_LOOPS = ("{% for a in range(6000) %}{% for b in range(6000) %}{% set x = a * b %}"
                "{% endfor %}{% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}")


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120, **kw)


def _small(server) -> float:
    """Seconds for one small completion (4 tokens), which must succeed."""
    t = time.perf_counter()
    r = _post(server, "/v1/completions", {"model": SERVED_NAME, "prompt": "import os",
                                          "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return time.perf_counter() - t


def _served_meanwhile(server, bad_request) -> httpx.Response:
    """Run ``bad_request()`` in a thread and, while it is in flight, a small request: its time
    stays within 30x its unloaded time (+0.5 s of scheduling slack; a stalled server takes
    seconds). Returns the bad response."""
    unloaded = statistics.median(_small(server) for _ in range(3))
    result: dict = {}
    started = threading.Event()

    def run():
        started.set()
        result["resp"] = bad_request()
    t = threading.Thread(target=run)
    t.start()
    started.wait()
    time.sleep(0.2)                                   # let it reach the server
    loaded = _small(server)
    t.join(120)
    assert not t.is_alive(), "the bad request never finished"
    assert loaded <= 30 * unloaded + 0.5, (loaded, unloaded)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    return result["resp"]


def _error(resp, param, *needles):
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    for needle in needles:
        assert needle in err["message"], err
    return err


def test_request_chat_template_refused_by_default(server):
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}],
            "chat_template": NESTED_LOOPS, "max_tokens": 2}
    resp = _served_meanwhile(server, lambda: _post(server, "/v1/chat/completions", body))
    _error(resp, "chat_template", "--trust-request-chat-template")


def test_huge_prompt_refused_before_tokenizing(server):
    """A 21 MB prompt: a 400 naming the limit, others served meanwhile, and the server keeps no
    memory of it (before: 31 s of stall and RSS +3 GB that stayed +1.7 GB)."""
    prompt = "hello world " * 1_750_000                              # 21 MB
    rss_before = _rss_bytes(server.proc.pid)
    resp = _served_meanwhile(server, lambda: _post(server, "/v1/completions", {
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": 2}))
    assert _rss_bytes(server.proc.pid) - rss_before < 100 * 2**20
    _error(resp, "prompt", f"{len(prompt)} characters", "max_model_len=128")
    chat = _post(server, "/v1/chat/completions", {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}]})
    _error(chat, "messages", "messages[0].content", "max_model_len=128")


def test_lone_surrogate_is_a_400(server):
    raw = b'{"model": "%s", "prompt": "ab\\ud800cd", "max_tokens": 2}' % SERVED_NAME.encode()
    resp = httpx.post(server.url + "/v1/completions", content=raw, timeout=60,
                      headers={**AUTH, "content-type": "application/json"})
    _error(resp, "prompt", "lone surrogate", "U+D800", "character 2")
    raw = (b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}'
           % SERVED_NAME.encode())
    resp = httpx.post(server.url + "/v1/chat/completions", content=raw, timeout=60,
                      headers={**AUTH, "content-type": "application/json"})
    _error(resp, "messages", "lone surrogate", "U+DFFF")
    assert _small(server) > 0


@pytest.mark.parametrize("body,param", [({"n": 129}, "n"), ({"n": 1000, "best_of": 1000}, "n"),
                                        ({"best_of": 1000}, "best_of")])
def test_n_is_bounded(server, body, param):
    resp = _post(server, "/v1/completions", {"model": SERVED_NAME, "prompt": "hi",
                                             "max_tokens": 1, **body})
    _error(resp, param, f"{param}=")
    if param == "n":
        assert "--max-n" in resp.json()["error"]["message"]


@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/completions", "guided_whitespace_pattern", " *"),
])
def test_unimplemented_fields_are_refused_not_ignored(server, path, field, value):
    body = {"model": SERVED_NAME, "max_tokens": 2, field: value}
    body.update({"prompt": "hi"} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "hi"}]})
    _error(_post(server, path, body), field, field, "not supported")


def test_harmless_values_of_those_fields_are_accepted(server):
    resp = _post(server, "/v1/chat/completions", {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "response_format": {"type": "text"}, "tools": [], "tool_choice": "none"})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("body,param,needle", [
    ({"response_format": {"type": "xml"}}, "response_format", "'xml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one"),
    ({"guided_regex": "(unclosed"}, "guided_decoding", "regex is invalid"),
])
def test_bad_output_constraints_are_400s(server, body, param, needle):
    resp = _post(server, "/v1/completions", {"model": SERVED_NAME, "prompt": "hi",
                                             "max_tokens": 2, **body})
    _error(resp, param, needle)


def test_cors_preflight_and_headers(server):
    pre = httpx.options(server.url + "/v1/completions", timeout=30, headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200, pre.text          # answered before the API-key check
    assert pre.headers["access-control-allow-origin"] in ("*", "http://example.com")
    assert "POST" in pre.headers["access-control-allow-methods"]
    resp = httpx.get(server.url + "/v1/models", headers={**AUTH, "Origin": "http://a.b"},
                     timeout=30)
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "*"


def test_pipelined_requests_all_answered(server):
    """Three HTTP/1.1 requests written back to back on one connection: three responses."""
    req = (f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}"
           "\r\n\r\n").encode()
    last = req.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(req + req + last)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200") == 3, data[:2000]
    assert data.count(b'"object":"list"') == 3


@pytest.fixture(scope="module")
def trusting_server(model_path, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("trusting") / "server.log")
    srv = RemoteServer(model_path, ["--api-key", API_KEY, "--served-model-name", SERVED_NAME,
                                    "--trust-request-chat-template", "--chat-template-timeout",
                                    "1", "--max-n", "4", "--uvicorn-log-level", "warning"], log)
    yield srv
    srv.stop()


def _chat(srv, template, content="def f():"):
    return _post(srv, "/v1/chat/completions", {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": content}],
        "chat_template": template, "max_tokens": 2})


def test_trusted_request_template_renders(trusting_server):
    srv = trusting_server
    ok = _chat(srv, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert ok.status_code == 200, ok.text
    ref = _post(srv, "/v1/completions", {"model": SERVED_NAME, "prompt": "def f():",
                                          "max_tokens": 1})
    assert ok.json()["usage"]["prompt_tokens"] == ref.json()["usage"]["prompt_tokens"]
    _error(_chat(srv, "{{ nope() }}"), "messages", "could not be rendered", "UndefinedError")
    _error(_post(srv, "/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "n": 5}),
           "n", "at most 4")


def test_slow_request_template_is_stopped_at_the_time_limit(trusting_server):
    """The template renders in a child process: other clients are served meanwhile, the
    render is killed after --chat-template-timeout (1 s), and the next template renders."""
    srv = trusting_server
    slow = "{% for z in range(100000) %}" + NESTED_LOOPS + "{% endfor %}"     # hours
    resp = _served_meanwhile(srv, lambda: _chat(srv, slow))
    _error(resp, "chat_template", "took longer than 1 s")
    assert _chat(srv, "{{ messages[0]['content'] }}").status_code == 200


def test_huge_rendered_template_is_refused(trusting_server):
    huge = "{% for a in range(100000) %}{{ 'xxxxxxxxxx' * 100 }}{% endfor %}"   # 100 MB
    _error(_chat(trusting_server, huge), "messages", "100000000 characters")


def test_sigterm_ends_requests_in_flight_after_the_grace_and_exits_0(model_path, tmp_path):
    """SIGTERM while a request streams, with --shutdown-timeout 0 (no grace, so the test does
    not race the request's own end): the stream gets a 503 error event ("shutting down") and
    [DONE], the engine stops and the process exits 0, with no traceback in its log."""
    srv = RemoteServer(model_path, ["--api-key", API_KEY, "--served-model-name", SERVED_NAME,
                                    "--shutdown-timeout", "0"], str(tmp_path / "server.log"))
    body = json.dumps({"model": SERVED_NAME, "prompt": "class Stack:", "max_tokens": 115,
                       "ignore_eos": True, "n": 64, "stream": True})
    try:
        with httpx.Client(timeout=60) as hc:
            with hc.stream("POST", srv.url + "/v1/completions", content=body,
                           headers={**AUTH, "content-type": "application/json"}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                first = next(lines)                          # the request is running
                srv.proc.send_signal(signal.SIGTERM)
                events = [e for e in (first, *lines) if e]     # SSE: blank lines separate
        rc = srv.proc.wait(120)
    finally:
        srv.stop()
    log = srv.log()
    assert rc == 0, log
    assert first.startswith("data: {")
    errors = [json.loads(e[6:])["error"] for e in events if e.startswith('data: {"error"')]
    assert len(errors) == 1 and errors[0]["code"] == 503, events[-3:]
    assert "shutting down" in errors[0]["message"]
    assert events[-1] == "data: [DONE]"
    assert "Traceback" not in log, log


SOAK_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "    for i in range(",
                "# utils\n", "return x +"]


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def _soak_one(hc, kind: str, prompt: str) -> object:
    """One request of ``kind``; returns what must equal the unloaded answer (or the status)."""
    url = "/v1/completions" if kind != "chat" else "/v1/chat/completions"
    body = {"model": SERVED_NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        r = await hc.post(url, json=body)
        return r.json()["choices"][0]["message"]["content"]
    body["prompt"] = prompt
    if kind == "bad":
        raw = json.dumps({**body, "prompt": prompt + "\ud800"})    # ASCII: \ud800 escaped
        r = await hc.post(url, content=raw, headers={"content-type": "application/json"})
        return r.status_code
    if kind == "plain":
        return (await hc.post(url, json=body)).json()["choices"][0]["text"]
    async with hc.stream("POST", url, json={**body, "stream": True}) as r:
        parts = []
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                parts.append(json.loads(line[6:])["choices"][0]["text"])
                if kind == "hangup":
                    return "hung up"          # leaving closes the connection mid-stream
        return "".join(parts)


def test_soak_32_clients_x_50_mixed_requests(server):
    """32 clients x 50 requests cycling plain, streaming, chat, bad-input and hang-up requests:
    every answer equals the same request's answer on an idle server (none lost, duplicated or
    mixed), and the server's RSS ends within 10% of its level after a warm-up round."""
    import asyncio
    kinds = ["plain", "stream", "chat", "bad", "hangup"]

    async def run(jobs):
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300) as hc:
            sem = asyncio.Semaphore(32)

            async def client(c):
                out = []
                for j in range(len(jobs) // 32):
                    kind, prompt = jobs[c * (len(jobs) // 32) + j]
                    async with sem:
                        out.append(((kind, prompt), await _soak_one(hc, kind, prompt)))
                return out
            return [r for rs in await asyncio.gather(*(client(c) for c in range(32))) for r in rs]

    combos = [(k, p) for k in kinds for p in SOAK_PROMPTS]
    want = {}
    for combo in combos:                                      # idle server, one at a time
        want[combo] = asyncio.run(_idle(server, *combo))
    assert want[("bad", SOAK_PROMPTS[0])] == 400 and want[("hangup", SOAK_PROMPTS[0])] == "hung up"
    asyncio.run(run([combos[i % len(combos)] for i in range(32 * 4)]))         # warm-up round
    rss_warm = _rss_bytes(server.proc.pid)
    jobs = [combos[(i * 7) % len(combos)] for i in range(32 * 50)]
    results = asyncio.run(run(jobs))
    assert len(results) == 32 * 50
    wrong = [(combo, got, want[combo]) for combo, got in results if got != want[combo]]
    assert not wrong, wrong[:5]
    deadline = time.monotonic() + 60
    while server.metric("vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0
    assert _rss_bytes(server.proc.pid) <= 1.10 * rss_warm
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


async def _idle(server, kind, prompt):
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as hc:
        return await _soak_one(hc, kind, prompt)
