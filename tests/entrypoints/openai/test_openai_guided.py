"""Guided decoding through the real server with the openai client: OpenAI's response_format
(json_schema, json_object) on chat and vLLM's guided_* fields on completions, sampled at
temperature 1 from a random tiny model, always in the requested language."""
from __future__ import annotations

import json

import jsonschema
import pytest

from openai_server_utils import SERVED_NAME

pytest.importorskip("xgrammar", reason="guided decoding needs xgrammar (pip install -e '.[test]')")

SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Oslo", "Lima", "Pune"]},
                         "temp": {"type": "integer", "minimum": -40, "maximum": 50},
                         "rain": {"type": "boolean"}},
          "required": ["city", "temp", "rain"], "additionalProperties": False}


def test_chat_response_format_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    texts = []
    for i in range(20):
        resp = client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": f"weather {i}"}],
            response_format=fmt, temperature=1.0, max_tokens=60)
        text = resp.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        assert resp.choices[0].finish_reason == "stop"
        texts.append(text)
    assert len(set(texts)) > 1


def test_chat_streaming_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}], stream=True,
        response_format=fmt, temperature=1.0, max_tokens=60)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    # Any JSON object: a random model may not close its strings within max_tokens, so only a
    # finished ("stop") output must parse; every output is an object's beginning.
    for i in range(5):
        resp = client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": f"obj {i}"}],
            response_format={"type": "json_object"}, temperature=1.0, max_tokens=60)
        text, finish = resp.choices[0].message.content, resp.choices[0].finish_reason
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)


def test_completion_guided_fields(client):
    for body, check in (
            ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
            ({"guided_regex": r"\d{3}-[xy]"}, lambda t: len(t) == 5 and t[:3].isdigit()),
            ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)
             is None),
            ({"structured_outputs": {"choice": ["on", "off"]}}, lambda t: t in ("on", "off"))):
        resp = client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=60,
                                         temperature=1.0, n=3, extra_body=body)
        assert all(check(c.text) for c in resp.choices), (body, [c.text for c in resp.choices])
