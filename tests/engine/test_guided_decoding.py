"""Guided decoding (xgrammar token masks in the sampler): outputs sampled at temperature 1 from a
random tiny model are in the requested language (JSON validating against its schema, a regex,
a choice, a grammar), batched with unguided requests that are not affected."""
from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest

from vllm import LLM, SamplingParams
from vllm.sampling_params import GuidedDecodingParams

pytest.importorskip("xgrammar", reason="guided decoding needs xgrammar (pip install -e '.[test]')")

SCHEMA = {"type": "object",
          "properties": {"name": {"enum": ["ann", "bob", "cy"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(tiny_model_factory("Qwen3MoeForCausalLM"), max_num_seqs=32)


def _guided(max_tokens=80, **spec):
    return SamplingParams(temperature=1.0, max_tokens=max_tokens,
                          guided_decoding=GuidedDecodingParams(**spec))


def test_json_schema_outputs_validate(llm):
    outs = llm.generate([f"item {i}:" for i in range(20)], _guided(json=SCHEMA))
    texts = [o.outputs[0].text for o in outs]
    for o, text in zip(outs, texts):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert o.outputs[0].finish_reason == "stop", text
    assert len(set(texts)) > 1                     # sampled, not one forced string


def test_json_object_regex_choice_and_grammar(llm):
    for o in llm.generate(["a", "b", "c"], _guided(json_object=True)):
        # A random model may not close a free-form string within max_tokens: a finished
        # output must parse, every output begins an object.
        assert o.outputs[0].text.startswith("{")
        if o.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(o.outputs[0].text), dict)
    for o in llm.generate(["a", "b", "c", "d"], _guided(regex=r"[a-c]{3}-\d\d")):
        assert re.fullmatch(r"[a-c]{3}-\d\d", o.outputs[0].text), o.outputs[0].text
    choices = ["yes", "no", "maybe so"]
    for o in llm.generate(["q"] * 6, _guided(choice=choices)):
        assert o.outputs[0].text in choices
    grammar = 'root ::= "(" digit+ ")"\ndigit ::= [0-9]'
    for o in llm.generate(["a", "b"], _guided(max_tokens=30, grammar=grammar)):
        text = o.outputs[0].text
        assert re.fullmatch(r"\(\d+\)", text) or (o.outputs[0].finish_reason == "length"
                                                  and re.fullmatch(r"\(\d*", text)), text


def test_unguided_requests_in_the_same_batch_are_unchanged(llm):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [o.outputs[0].text for o in llm.generate(["def f():", "import os"], greedy)]
    mixed = llm.generate(["def f():", "x", "import os", "y"],
                         [greedy, _guided(json=SCHEMA), greedy, _guided(choice=["a", "b"])])
    assert [mixed[0].outputs[0].text, mixed[2].outputs[0].text] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMA)
    assert mixed[3].outputs[0].text in ("a", "b")


def test_n_children_each_follow_the_grammar(llm):
    out = llm.generate(["z"], SamplingParams(n=4, temperature=1.0, max_tokens=20,
                                             guided_decoding=GuidedDecodingParams(
                                                 regex=r"(cat|dog){2}")))[0]
    assert len(out.outputs) == 4
    assert all(re.fullmatch(r"(cat|dog){2}", c.text) for c in out.outputs)


def test_bad_specs_are_value_errors(llm):
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="choice"):
        GuidedDecodingParams(choice=[])
    with pytest.raises(ValueError, match="guided_decoding regex is invalid"):
        llm.generate(["a"], _guided(regex="(unclosed"))
    assert llm.generate(["a"], SamplingParams(max_tokens=2))[0].outputs[0].text is not None


def test_missing_xgrammar_is_named(llm, monkeypatch):
    from vllm.engine.structured_output import StructuredOutputManager
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    manager = StructuredOutputManager(None, 10, [])
    with pytest.raises(ValueError, match="needs the package 'xgrammar'.*pip install xgrammar"):
        manager.check(GuidedDecodingParams(regex="a"))
