"""One real `vllm serve` process (tiny model, loopback only) shared by this directory's tests,
plus the offline LLM with the same engine arguments for reference results."""
from __future__ import annotations

import pytest

from openai_server_utils import API_KEY, ENGINE_ARGS, SERVED_NAME, RemoteServer


@pytest.fixture(scope="package")
def model_path(tiny_model_factory):
    return tiny_model_factory("Qwen3MoeForCausalLM")


@pytest.fixture(scope="package")
def server(model_path, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    srv = RemoteServer(model_path, ["--api-key", API_KEY, "--served-model-name", SERVED_NAME,
                                    "--uvicorn-log-level", "warning"], log)
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def offline_llm(model_path):
    from vllm import LLM
    llm = LLM(model_path, **ENGINE_ARGS)
    yield llm
    llm.llm_engine.shutdown()  # while logging still works (not at interpreter exit)


@pytest.fixture
def client(server):
    import openai
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                       timeout=120) as c:
        yield c
