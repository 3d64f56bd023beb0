"""A harmony-style chat template (written here; it uses what GPT-OSS's shipped template uses:
recursive macros, ``namespace`` attribute assignment, ``strftime_now``, ``raise_exception``, the
``tojson`` filter, ``is defined`` defaults for ``reasoning_effort`` / ``model_identity``,
``builtin_tools``, ``tools``, ``messages[1:]``, ``loop.last``) rendered by the offline API, the
server's tokenizer worker and its request-template sandbox, with ``chat_template_kwargs``."""
from __future__ import annotations

import asyncio
import json
import shutil
from datetime import datetime

import pytest
import transformers

from vllm import LLM, SamplingParams
from vllm.config import ModelConfig
from vllm.engine.prompt_processor import PromptProcessor
from vllm.entrypoints.openai.template_sandbox import TemplateSandbox
from vllm.entrypoints.openai.tokenizer_pool import TokenizerPool

HARMONY = """
{%- macro type_of(spec) -%}
  {%- if spec.type == "array" -%}{{ type_of(spec['items']) ~ "[]" }}
  {%- elif spec.type is defined and spec.type is string -%}{{ spec.type }}
  {%- else -%}any{%- endif -%}
{%- endmacro -%}
{%- macro system_message() -%}
  {%- if model_identity is not defined %}{% set model_identity = "You are tiny." %}{% endif -%}
  {{- model_identity + "\\nCurrent date: " + strftime_now("%Y-%m-%d") -}}
  {%- if reasoning_effort is not defined %}{% set reasoning_effort = "medium" %}{% endif -%}
  {{- "\\nReasoning: " + reasoning_effort -}}
  {%- set found = namespace(python=false, browser=false) -%}
  {%- for tool in builtin_tools or [] -%}
    {%- if tool == "python" %}{% set found.python = true %}{% endif -%}
    {%- if tool == "browser" %}{% set found.browser = true %}{% endif -%}
  {%- endfor -%}
  {%- if found.python %}{{ "\\n## python" }}{% endif -%}
  {%- if found.browser %}{{ "\\n## browser" }}{% endif -%}
{%- endmacro -%}
<|start|>system<|message|>{{ system_message() }}<|end|>
{%- if messages[0].role in ("developer", "system") -%}
  {%- set loop_messages = messages[1:] -%}
  <|start|>developer<|message|># Instructions\n\n{{ messages[0].content }}
  {%- for tool in tools or [] -%}
    {%- set f = tool.function -%}
    {{ "\\ntype " + f.name + " = (_: {" }}
    {%- for name, spec in f.parameters.properties.items() -%}
      {{ name + ": " + type_of(spec) }}{% if not loop.last %}, {% endif -%}
    {%- endfor -%}{{ "}) => any;" }}
  {%- endfor -%}<|end|>
{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- for m in loop_messages -%}
  {%- if m.role == "assistant" -%}
    {%- if "<|channel|>" in m.content -%}
      {{ raise_exception("pass analysis text in the 'thinking' field, not in content") }}
    {%- endif -%}
    {%- if m.tool_calls is defined -%}
      {{- "<|start|>assistant to=functions." ~ m.tool_calls[0].function.name
          ~ "<|channel|>commentary json<|message|>"
          ~ (m.tool_calls[0].function.arguments | tojson) ~ "<|call|>" -}}
    {%- elif loop.last and not add_generation_prompt and "thinking" in m -%}
      {{- "<|start|>assistant<|channel|>analysis<|message|>" ~ m.thinking ~ "<|end|>"
          ~ "<|start|>assistant<|channel|>final<|message|>" ~ m.content ~ "<|return|>" -}}
    {%- else -%}
      <|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
    {%- endif -%}
  {%- else -%}
    <|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""

ARGS = {"city": "Zürich", "days": [1, 2]}
MESSAGES = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": ARGS}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "thinking": "easy", "content": "Sunny."},
            {"role": "user", "content": "Thanks"}]
TOOLS = [{"type": "function", "function": {"name": "get", "description": "forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "days": {"type": "array", "items": {"type": "integer"}}}}}}]
KWARGS = {"reasoning_effort": "low", "model_identity": "You are GPT-tiny.",
          "builtin_tools": ["python"], "tools": TOOLS}


def expected(date, identity="You are tiny.", effort="medium", tools_line="", builtin=""):
    """The rendering, written out in Python."""
    return ("<|start|>system<|message|>" + identity + "\nCurrent date: " + date + "\nReasoning: "
            + effort + builtin + "<|end|><|start|>developer<|message|># Instructions\n\nBe brief."
            + tools_line + "<|end|><|start|>user<|message|>Weather?<|end|>"
            "<|start|>assistant to=functions.get<|channel|>commentary json<|message|>"
            + json.dumps(ARGS, ensure_ascii=False) + "<|call|><|start|>tool<|message|>sunny<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>"
            "<|start|>user<|message|>Thanks<|end|><|start|>assistant")


def expected_with_kwargs(date):
    return expected(date, "You are GPT-tiny.", "low",
                    "\ntype get = (_: {city: string, days: integer[]}) => any;", "\n## python")


def render_around(fn):
    """fn() -> text, and the dates before and after (rendering may straddle midnight)."""
    before = datetime.now().strftime("%Y-%m-%d")
    text = fn()
    return text, {before, datetime.now().strftime("%Y-%m-%d")}


@pytest.fixture(scope="module")
def harmony_model(tiny_model_factory, tmp_path_factory):
    """A tiny model whose tokenizer ships the harmony-style template."""
    path = tmp_path_factory.mktemp("harmony")
    # Byte-level pieces of a tiny BPE: the rendered conversation takes ~430 tokens.
    shutil.copytree(tiny_model_factory("LlamaForCausalLM", max_position_embeddings=1024), path,
                    dirs_exist_ok=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = HARMONY
    tok.save_pretrained(str(path))
    return str(path)


def test_plain_chat_renders_as_shipped_and_generates(harmony_model):
    llm = LLM(harmony_model)
    out, dates = render_around(lambda: llm.chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0])
    assert out.prompt in {expected(d) for d in dates}
    assert len(out.outputs[0].token_ids) == 3


def test_template_kwargs_reach_the_template(harmony_model):
    llm = LLM(harmony_model)
    prompt, dates = render_around(lambda: llm.llm_engine.render_chat(
        MESSAGES, chat_template_kwargs=KWARGS)["prompt"])
    assert prompt in {expected_with_kwargs(d) for d in dates}
    # The last assistant turn keeps its analysis when no generation prompt follows.
    text = llm.llm_engine.render_chat(MESSAGES[:5], add_generation_prompt=False)["prompt"]
    assert text.endswith("<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>"
                         "final<|message|>Sunny.<|return|>")


def test_raise_exception_and_reserved_kwargs(harmony_model):
    llm = LLM(harmony_model)
    bad = MESSAGES[:4] + [{"role": "assistant", "content": "<|channel|>analysis<|message|>x"}]
    with pytest.raises(Exception, match="pass analysis text in the 'thinking' field"):
        llm.chat(bad)
    with pytest.raises(ValueError, match=r"chat_template_kwargs: \['add_generation_prompt', "
                                         r"'tokenize'\] are set by the rendering call"):
        llm.chat(MESSAGES, chat_template_kwargs={"tokenize": True, "add_generation_prompt": 0})
    with pytest.raises(ValueError, match="chat_template_kwargs must be a dict"):
        llm.chat(MESSAGES, chat_template_kwargs=["low"])


def test_server_worker_and_sandbox_pass_kwargs(harmony_model):
    """The server's two render paths: the model's template in its tokenizer worker, and a
    request's template (the same text here) in the sandbox process."""
    processor = PromptProcessor(ModelConfig(harmony_model))
    sandbox = TemplateSandbox(harmony_model, processor.max_chars, timeout_s=60)
    pool = TokenizerPool(processor, sandbox)
    try:
        for template in (None, HARMONY):
            out, dates = render_around(lambda: asyncio.run(
                pool.render_chat(MESSAGES, template, True, KWARGS)))
            assert out["prompt"] in {expected_with_kwargs(d) for d in dates}
            assert out["prompt_token_ids"] == processor.encode_rendered(out["prompt"])
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            asyncio.run(pool.render_chat(MESSAGES, HARMONY, True, {"tokenize": False}))
    finally:
        sandbox.close()
