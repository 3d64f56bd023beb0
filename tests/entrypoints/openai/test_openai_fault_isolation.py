"""An exception inside the engine while a request runs: that request gets a 500 in OpenAI's
error shape (or an error event in its stream) with no traceback, the failure is logged, and
the same app keeps answering. In-process (the fault is injected into the engine's runner)."""
from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM
from vllm.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="module")
def app_and_engine(model_path):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=model_path, max_model_len=128))
    yield build_app(engine, ["tiny"]), engine
    engine.shutdown()


def _arm_fault(engine: AsyncLLM) -> list:
    """The next engine step that runs a model forward raises once."""
    runner = engine.engine.runner
    launch = runner.launch
    fired: list = []

    def faulty(sched, token_masks=None, previous=None):
        if not fired and sched.sequences:
            fired.append(True)
            runner.launch = launch
            raise RuntimeError("secret internal detail")
        return launch(sched, token_masks, previous)
    runner.launch = faulty
    return fired


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.text = ""

    def emit(self, record):
        self.text += self.format(record) + "\n"


def test_engine_fault_is_a_500_and_the_server_recovers(app_and_engine):
    app, engine = app_and_engine
    body = {"prompt": "def fibonacci(n):", "max_tokens": 4, "temperature": 0}
    records = _Records()
    logging.getLogger("vllm").addHandler(records)  # the vllm logger does not propagate
    try:
        with TestClient(app) as client:
            ok = client.post("/v1/completions", json=body)
            assert ok.status_code == 200
            fired = _arm_fault(engine)
            bad = client.post("/v1/completions", json=body)
            assert fired == [True]
            assert bad.status_code == 500
            err = bad.json()["error"]
            assert err["type"] == "InternalServerError" and err["code"] == 500
            assert "secret internal detail" not in bad.text and "Traceback" not in bad.text
            assert "secret internal detail" in records.text  # but it is logged
            again = client.post("/v1/completions", json=body)
            assert again.status_code == 200
            assert again.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]
            assert client.get("/health").status_code == 200
    finally:
        logging.getLogger("vllm").removeHandler(records)


def test_engine_fault_mid_stream_is_an_error_event(app_and_engine):
    app, engine = app_and_engine
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with TestClient(app) as client:
        fired = _arm_fault(engine)
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.iter_lines() if line]
        assert fired == [True]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 500 and "secret" not in error["message"]
        after = client.post("/v1/chat/completions", json={**body, "stream": False})
        assert after.status_code == 200
        assert after.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_dead_engine_is_503(model_path):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=model_path, max_model_len=128))
    app = build_app(engine, ["tiny"])
    engine.shutdown()
    with TestClient(app) as client:
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
