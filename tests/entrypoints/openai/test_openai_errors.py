"""Error handling of the real server: each bad request gets OpenAI's error JSON with the right
status code and a message naming the problem, and the server stays healthy. Also the CLI:
--help lists every engine flag, a bad flag value exits non-zero with one line."""
from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from openai_server_utils import API_KEY, SERVED_NAME
from vllm.engine.arg_utils import EngineArgs

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(server, path, body, headers=AUTH, **kw):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def _check_error(resp, status, param=None, *needles):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert err["param"] == param, err
    for needle in needles:
        assert needle in err["message"], err
    assert "Traceback" not in resp.text
    return err


@pytest.mark.parametrize("body,param,needle", [
    ({"top_k": -5}, "top_k", "top_k=-5"),
    ({"temperature": -1.0}, "temperature", "temperature=-1.0"),
    ({"top_p": 0}, "top_p", "top_p=0"),
    ({"n": 0}, "n", "n=0"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens=0"),
    ({"logprobs": 50}, "logprobs", "logprobs=50"),
    ({"presence_penalty": 9}, "presence_penalty", "presence_penalty=9"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"n": "two"}, "n", "valid integer"),
    ({"stop": [""]}, "stop", "stop="),
    ({"max_tokens": 500}, "max_tokens", "max_model_len=128"),
    ({"model": "gpt-17"}, "model", "gpt-17"),
    ({"prompt": [5, 999999]}, "prompt", "999999"),
    ({"prompt": []}, "prompt", "empty"),
])
def test_completion_bad_parameters(server, body, param, needle):
    resp = _post(server, "/v1/completions", {"model": SERVED_NAME, "prompt": "hi", **body})
    _check_error(resp, 400, param, needle)


def test_missing_field_and_invalid_json(server):
    _check_error(_post(server, "/v1/completions", {"max_tokens": 3}), 400, "prompt", "prompt")
    resp = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={
        **AUTH, "content-type": "application/json"}, timeout=30)
    _check_error(resp, 400, None, "not valid JSON")


def test_prompt_longer_than_model(server, client):
    resp = _post(server, "/v1/completions", {"prompt": [7] * 200, "max_tokens": 2})
    _check_error(resp, 400, "prompt", "200 tokens", "max_model_len=128")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=SERVED_NAME, prompt="x" * 2000, max_tokens=2)
    assert "max_model_len=128" in str(e.value)
    # In a batch, the bad prompt is named and the good one is not left running.
    resp = _post(server, "/v1/completions", {"prompt": ["ok", "y" * 2000], "max_tokens": 2})
    _check_error(resp, 400, "prompt", "prompt[1]")


def test_chat_errors(server):
    _check_error(_post(server, "/v1/chat/completions", {"messages": []}), 400, "messages",
                 "empty")
    _check_error(_post(server, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}], "top_k": -3}),
                 400, "top_k", "top_k=-3")
    _check_error(_post(server, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}),
                 400, "model", "nope")
    _check_error(_post(server, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                 400, "messages", "image_url")
    _check_error(_post(server, "/v1/chat/completions",
                       {"messages": [{"content": "no role"}]}), 400, "messages.0.role")
    _check_error(_post(server, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                        "top_logprobs": 21}), 400, "top_logprobs", "top_logprobs=21")


def test_auth(server):
    body = {"prompt": "hi", "max_tokens": 2}
    _check_error(_post(server, "/v1/completions", body, headers={}), 401, None, "missing")
    _check_error(_post(server, "/v1/completions", body,
                       headers={"Authorization": "Bearer wrong"}), 401, None, "wrong")
    _check_error(httpx.get(server.url + "/v1/models"), 401, None)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=2)
    # Health and metrics stay open (probes and scrapers carry no key).
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_unknown_route_and_method(server):
    _check_error(httpx.get(server.url + "/v1/engines", headers=AUTH), 404, None, "/v1/engines")
    _check_error(httpx.get(server.url + "/nothing-here"), 404, None, "/nothing-here")
    _check_error(httpx.get(server.url + "/v1/completions", headers=AUTH), 405, None)


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=SERVED_NAME, prompt="hi", top_p=5.0)
    assert e.value.status_code == 400 and "top_p" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="other", messages=[{"role": "user",
                                                                 "content": "hi"}])


def test_healthy_after_errors(server, client):
    """Runs after the error tests: nothing leaked into the engine, requests still work."""
    assert httpx.get(server.url + "/health").status_code == 200
    resp = client.completions.create(model=SERVED_NAME, prompt="import os", max_tokens=3)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0
    assert server.metric("vllm:http_requests_total", route="/v1/completions", status="400") > 0
    assert "Traceback" not in server.log()


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_serve_help_lists_every_flag(capsys):
    from vllm.entrypoints.cli.main import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    flags = ["--host", "--port", "--api-key", "--served-model-name", "--uvicorn-log-level"]
    flags += ["--" + name.replace("_", "-") for name in EngineArgs.field_names()
              if name != "model"]
    for flag in flags:
        assert flag in out, flag
    assert "MODEL" in out


@pytest.mark.parametrize("args,needle", [
    (["--port", "70000"], "--port='70000'"),
    (["--max-num-seqs", "many"], "--max-num-seqs='many'"),
    (["--uvicorn-log-level", "loud"], "loud"),
])
def test_bad_flag_value_is_one_line(capsys, args, needle):
    from vllm.entrypoints.cli.main import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "some/model", *args])
    assert e.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], lines


def test_bad_flag_value_console_exit(model_path):
    out = _cli("serve", model_path, "--port", "abc")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "vllm serve: error: argument --port: --port='abc' is invalid: must be an integer in "
        "[0, 65535] (see 'vllm serve --help')"], out.stderr


def test_bad_engine_value_is_one_error_line(model_path):
    out = _cli("serve", model_path, "--max-num-seqs", "0", "--port", "1")
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: max_num_seqs=0 is invalid: must be an integer >= 1"], out.stderr
    assert "Traceback" not in out.stderr
