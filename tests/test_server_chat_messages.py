"""What agent frameworks send: every Chat Completions message shape and tools, rendered as Transformers renders
them; fill-in-the-middle; a role chunk that waits for the first token; the model card and x-request-id."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from tokenizers import Tokenizer as BackendTokenizer

from folio.entrypoints.openai.fill_in_the_middle import FIM_TOKENS
from folio.tokenizer import Tokenizer
from server_fixture import MODEL_NAME, running_server

# A template that renders tools, names, tool calls and tool results, and does not know the developer role.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}\n"
    "{{ m.content }}{% for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>"
    "{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "developer", "content": "Answer with the tools."},
    {"role": "user", "name": "ada",
     "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
# The same conversation as vLLM hands it to the template: developer as system (this template does not know it),
# text parts joined, null content empty, arguments parsed.
RENDERED = [
    {"role": "system", "content": "Answer with the tools."},
    {"role": "user", "name": "ada", "content": "Weather\nin Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{**CALL, "function": {"name": "get_weather",
                                                                              "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def coder_dir(llama_dir, tmp_path_factory) -> str:
    """The tiny model with a tool-aware chat template and fill-in-the-middle tokens."""
    folder = str(tmp_path_factory.mktemp("coder") / "model")
    shutil.copytree(llama_dir, folder)
    config_path = os.path.join(folder, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "chat_template": TOOL_TEMPLATE}, f)
    backend = BackendTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    backend.add_special_tokens(list(FIM_TOKENS[0]))
    backend.save(os.path.join(folder, "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def server(coder_dir):
    with running_server(coder_dir, max_num_batched_tokens=64) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_every_message_shape_renders_as_transformers(server, client, coder_dir):
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(coder_dir).apply_chat_template(
        RENDERED, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    with server.http() as http:
        tokenized = http.post("/tokenize", json={"messages": CONVERSATION, "tools": TOOLS}).json()
    assert tokenized["tokens"] == list(expected)
    text = Tokenizer.from_dir(coder_dir).decode(tokenized["tokens"], skip_special_tokens=False)
    assert '"arguments": {"city": "Paris"}' in text and "developer" not in text and text.count("system") == 2

    kwargs = dict(model=MODEL_NAME, messages=CONVERSATION, tools=TOOLS, max_tokens=4, temperature=0)
    full = client.chat.completions.create(**kwargs)
    assert full.usage.prompt_tokens == len(expected) and full.choices[0].message.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs))
    assert streamed == full.choices[0].message.content


def test_continue_final_message_continues_the_assistants_prefill(server, client, coder_dir):
    """vLLM's continue_final_message: the prompt ends inside the last (assistant) message, as Transformers renders
    it; with add_generation_prompt left true, a 400 naming the field."""
    from transformers import AutoTokenizer

    prefill = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "It is"}]
    expected = AutoTokenizer.from_pretrained(coder_dir).apply_chat_template(
        prefill, add_generation_prompt=False, continue_final_message=True, tokenize=True, return_dict=False)
    out = client.chat.completions.create(model=MODEL_NAME, messages=prefill, max_tokens=2, temperature=0, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})
    assert out.usage.prompt_tokens == len(expected)
    with server.http() as http:
        tokenized = http.post("/tokenize", json={"messages": prefill, "add_generation_prompt": False,
                                                 "continue_final_message": True}).json()
        assert tokenized["tokens"] == list(expected)
        refused = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": prefill,
                                                          "continue_final_message": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


def test_developer_role_kept_when_the_template_knows_it(coder_dir, tmp_path):
    folder = shutil.copytree(coder_dir, tmp_path / "dev")
    with open(folder / "tokenizer_config.json") as f:
        config = json.load(f)
    config["chat_template"] = ("{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}{{ m.content }}"
                               "{% endfor %}")
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump(config, f)
    assert Tokenizer.from_dir(str(folder)).apply_chat_template([{"role": "developer", "content": "x"}]) == "D:x"


def test_first_chunk_arrives_after_the_prefill(server, client):
    """The role chunk waits for the first token: a client timing its first chunk measures the prefill."""
    engine = server.llm.engine
    original = engine.step
    first_token_steps: list[float] = []

    def slow_step():
        time.sleep(0.02)  # a prefill of several chunks (64 tokens a step) then takes a clearly measurable time
        outputs = original()
        if any(c.token_ids for o in outputs for c in o.outputs):
            first_token_steps.append(time.monotonic())
        return outputs

    engine.step = slow_step
    try:
        stream = client.chat.completions.create(model=MODEL_NAME, max_tokens=2, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": "hello world " * 100}])
        chunks = iter(stream)
        first = next(chunks)
        first_at = time.monotonic()
        rest = list(chunks)
    finally:
        engine.step = original
    assert first.choices[0].delta.role == "assistant" and rest[0].choices[0].delta.content is not None
    assert first_token_steps and first_at >= first_token_steps[0]


def test_suffix_fills_in_the_middle(client, coder_dir):
    kwargs = dict(model=MODEL_NAME, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    prefix, suffix = "def add(a, b):\n", "\nprint(add(1, 2))"
    filled = client.completions.create(prompt=[prefix, "x = "], suffix=suffix, **kwargs)
    raw = "".join([FIM_TOKENS[0][0], prefix, FIM_TOKENS[0][1], suffix, FIM_TOKENS[0][2]])
    by_hand = client.completions.create(prompt=raw, **kwargs)
    assert filled.choices[0].text == by_hand.choices[0].text
    assert filled.usage.prompt_tokens - by_hand.usage.prompt_tokens == len(
        Tokenizer.from_dir(coder_dir).encode(raw.replace(prefix, "x = ")))
    echoed = client.completions.create(prompt=prefix, suffix=suffix, echo=True, **kwargs)
    assert echoed.choices[0].text == prefix + by_hand.choices[0].text
    with pytest.raises(Exception, match="suffix needs the prompt as text"):
        client.completions.create(prompt=[1, 2, 3], suffix=suffix, **kwargs)


def test_model_card_and_request_id(server, client, coder_dir):
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.model_extra["root"] == coder_dir
    assert client.models.list().data[0].model_extra["root"] == coder_dir
    with server.http() as http:
        missing = http.get("/v1/models/gpt-4")
        assert missing.status_code == 404 and "gpt-4" in missing.json()["error"]["message"]
        echoed = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"x-request-id": "abc"})
        assert echoed.status_code == 200 and echoed.headers["x-request-id"] == "abc"
        assert len(http.get("/health").headers["x-request-id"]) == 32 and missing.headers["x-request-id"]
