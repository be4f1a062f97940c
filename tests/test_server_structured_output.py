"""Structured outputs and tool calling through the real server and the openai client: response_format,
vLLM's structured_outputs field, tools with each tool_choice, streamed and not, and 400s for bad constraints.

The model is the tiny random one with a Qwen2.5-style chat template (tools in the system turn, Hermes
<tool_call> blocks): whatever it writes under a constraint follows the schema because the grammar made it.
"""

from __future__ import annotations

import json
import os
import shutil

import jsonschema
import openai
import pytest

from folio.entrypoints.openai.protocol import ChatCompletionRequest
from server_fixture import MODEL_NAME, running_server
from test_server_errors import assert_error

QWEN_STYLE_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}

# Tools

<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "tags", "n"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLING = dict(model=MODEL_NAME, temperature=1.0, max_tokens=120)


def _edit_json(path: str, **changes) -> None:
    with open(path) as f:
        content = json.load(f)
    with open(path, "w") as f:
        json.dump({**content, **changes}, f)


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    """The tiny model with room for tool definitions in the prompt, and the Qwen2.5-style template."""
    folder = str(tmp_path_factory.mktemp("qwen-style"))
    shutil.copytree(llama_dir, folder, dirs_exist_ok=True)
    _edit_json(os.path.join(folder, "config.json"), max_position_embeddings=2048)
    _edit_json(os.path.join(folder, "tokenizer_config.json"), chat_template=QWEN_STYLE_TEMPLATE)
    with running_server(folder) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def validate(schema: dict, text: str) -> None:
    jsonschema.Draft202012Validator(schema).validate(json.loads(text))


def streamed(chunks) -> tuple[str, dict[int, dict], str]:
    """A stream's content, its tool calls by index (joined from the deltas) and its finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": "",
                                                      "pieces": 0})
                call["arguments"] += delta.function.arguments or ""
                call["pieces"] += 1
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("seed", [1, 2])
def test_response_format_json_schema(client, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(messages=MESSAGES, seed=seed, response_format=fmt, **SAMPLING)
    assert out.choices[0].finish_reason == "stop"
    validate(SCHEMA, out.choices[0].message.content)
    content, calls, finish = streamed(client.chat.completions.create(messages=MESSAGES, seed=seed,
                                                                     response_format=fmt, stream=True, **SAMPLING))
    assert (content, calls, finish) == (out.choices[0].message.content, {}, "stop")


def test_response_format_json_object(client):
    out = client.chat.completions.create(messages=MESSAGES, seed=4, response_format={"type": "json_object"},
                                         logit_bias={str(t): 4 for t in (2,)}, **{**SAMPLING, "max_tokens": 200})
    assert out.choices[0].message.content.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_structured_outputs_field_on_completions_and_chat(client):
    out = client.completions.create(model=MODEL_NAME, prompt="Pick one:", max_tokens=10, n=3, seed=5,
                                    temperature=1.0, extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert {c.text for c in out.choices} <= {"red", "blue"} and {c.finish_reason for c in out.choices} == {"stop"}
    chat = client.chat.completions.create(messages=MESSAGES, seed=5, extra_body={
        "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, **SAMPLING)
    content = chat.choices[0].message.content
    assert len(content) == 6 and content[:3].isdigit() and content[3] == "-"


def test_vllms_earlier_guided_fields_are_structured_outputs(client, server):
    """guided_json / guided_regex / guided_choice (with any guided_decoding_backend) constrain as structured_outputs
    does; with structured_outputs too, or with a whitespace pattern, a 400."""
    out = client.completions.create(model=MODEL_NAME, prompt="Pick one:", max_tokens=10, n=3, seed=5,
                                    temperature=1.0, extra_body={"guided_choice": ["red", "blue"],
                                                                 "guided_decoding_backend": "xgrammar"})
    assert {c.text for c in out.choices} <= {"red", "blue"} and {c.finish_reason for c in out.choices} == {"stop"}
    chat = client.chat.completions.create(messages=MESSAGES, seed=1, extra_body={"guided_json": SCHEMA}, **SAMPLING)
    validate(SCHEMA, chat.choices[0].message.content)
    chat = client.chat.completions.create(messages=MESSAGES, seed=5, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"},
                                          **SAMPLING)
    content = chat.choices[0].message.content
    assert len(content) == 6 and content[:3].isdigit() and content[3] == "-"
    with server.http() as http:
        both = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "guided_regex": "a",
                                                  "structured_outputs": {"regex": "b"}})
        assert_error(both, 400, "guided_regex and structured_outputs each constrain the output")
        two = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "guided_regex": "a",
                                                 "guided_choice": ["b"]})
        assert_error(two, 400, "guided_regex and guided_choice each constrain the output")
        with_format = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                              "guided_regex": "a",
                                                              "response_format": {"type": "json_object"}})
        assert_error(with_format, 400, "guided_regex and response_format both constrain", "guided_regex")
        spaced = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                         "guided_json": SCHEMA, "guided_whitespace_pattern": " "})
        assert_error(spaced, 400, "guided_whitespace_pattern is not supported", "guided_whitespace_pattern")
        # a bad constraint is named as the client sent it
        bad_regex = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "guided_regex": "(a"})
        assert_error(bad_regex, 400, "guided_regex is not a valid regular expression", "guided_regex")
        bad_json = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                           "guided_json": {"type": "nope"}})
        assert_error(bad_json, 400, "guided_json is not a valid JSON schema", "guided_json")
        empty = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "guided_choice": []})
        assert_error(empty, 400, "guided_choice must be a list of non-empty strings", "guided_choice")
        named = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi",
                                                   "structured_outputs": {"regex": "(a"}})
        assert_error(named, 400, "structured_outputs.regex is not a valid", "structured_outputs")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_calls_with_valid_arguments(client, stream):
    kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=7,
                  **SAMPLING)
    if stream:
        content, calls, finish = streamed(client.chat.completions.create(stream=True, **kwargs))
        assert calls[0]["id"].startswith("call_") and calls[0]["pieces"] > 2  # arguments arrive incrementally
        calls = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        out = client.chat.completions.create(**kwargs)
        message, finish = out.choices[0].message, out.choices[0].finish_reason
        content, calls = message.content, [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert message.tool_calls[0].id.startswith("call_") and message.tool_calls[0].type == "function"
    assert not content and finish == "tool_calls" and len(calls) == 1
    name, arguments = calls[0]
    validate(WEATHER if name == "get_weather" else TOOLS[1]["function"]["parameters"], arguments)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_message_format_with_tools_applies_to_the_message(client, seed):
    """As OpenAI's: with "auto" the output is a message in the format or calls; with "required" calls, the format
    waiting for a later turn's message."""
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    auto = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, response_format=fmt, seed=seed,
                                          parallel_tool_calls=False, **SAMPLING)
    message = auto.choices[0].message
    if message.tool_calls:
        assert not message.content and auto.choices[0].finish_reason == "tool_calls"
        (call,) = message.tool_calls
        validate(WEATHER if call.function.name == "get_weather" else TOOLS[1]["function"]["parameters"],
                 call.function.arguments)
    else:
        validate(SCHEMA, message.content)
    required = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, response_format=fmt, seed=seed, **SAMPLING)
    assert required.choices[0].message.tool_calls and required.choices[0].finish_reason == "tool_calls"


def test_named_tool_choice_and_none(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice=named, seed=8, **SAMPLING)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and out.choices[0].finish_reason == "stop"  # as OpenAI reports it
    validate(WEATHER, call.function.arguments)
    plain = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="none", seed=8,
                                           **{**SAMPLING, "max_tokens": 8})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_calls_the_model_writes(client, stream):
    """The model is made to write a call (a regex of the client's replaces auto's grammar; calls are still read)."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    regex = "Checking\\.\n" + call.replace("{", "\\{").replace("}", "\\}")
    kwargs = dict(messages=MESSAGES, tools=TOOLS, extra_body={"structured_outputs": {"regex": regex}}, **SAMPLING)
    if stream:
        content, calls, finish = streamed(client.chat.completions.create(stream=True, **kwargs))
        calls = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        out = client.chat.completions.create(**kwargs)
        content, finish = out.choices[0].message.content, out.choices[0].finish_reason
        calls = [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
    assert (content, calls, finish) == ("Checking.\n", [("get_time", '{"tz": "CET"}')], "tool_calls")


def test_a_conversation_with_tool_calls_and_results(client, server):
    """An assistant turn with tool_calls (null content) and the tool's result go through the chat template."""
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    out = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice="none", max_tokens=3,
                                         model=MODEL_NAME, temperature=0)
    tokenizer = server.llm.engine.get_tokenizer()
    request = ChatCompletionRequest.model_validate({"messages": messages, "tools": TOOLS})
    prompt = tokenizer.apply_chat_template([m.to_template_dict() for m in request.messages], tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in prompt
    assert "<tool_response>\n21 degrees\n</tool_response>" in prompt and '"name": "get_time"' in prompt
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


@pytest.mark.parametrize("change, match, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema is not a valid JSON schema: Invalid type: foo", "response_format"),
    ({"response_format": {"type": "json_schema"}}, "json_schema is required", "response_format"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex is not a valid regular expression",
     "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one", "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "object"}}, "response_format": {"type": "json_object"}},
     "give one of them", "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]},
     "tools[0].function.parameters is not a valid JSON schema", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "none"}, "tools[0].function.parameters is not a valid JSON schema", "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"json_object": True}},
     "cannot be combined with structured_outputs", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools",
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice requires tools", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "pattern", "tools"),
])
def test_bad_constraints_are_400s(server, change, match, param):
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, **change})
    assert_error(response, 400, match, param)


def test_bad_constraint_on_completions_is_a_400(server):
    with server.http() as http:
        response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi",
                                                      "structured_outputs": {"grammar": "start: nope"}})
    assert_error(response, 400, "structured_outputs.grammar is not a valid grammar", "structured_outputs")


def test_constrained_requests_are_counted_and_freed(server, client):
    client.completions.create(model=MODEL_NAME, prompt="Pick:", max_tokens=10, extra_body={
        "structured_outputs": {"choice": ["left", "right"]}})
    server.wait_idle()
    with server.http() as http:
        metrics = http.get("/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("folio:structured_output")}
    assert values["folio:structured_output_compiles_total"] >= 1
    assert values["folio:structured_output_bitmask_rows_total"] >= 2 and values[
        "folio:structured_output_bitmask_seconds_total"] > 0
