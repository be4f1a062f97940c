"""A reasoning model through the server with `--reasoning-parser qwen3`, and the openai client: chat's `reasoning`
(and `reasoning_content`) beside the content, streamed as it is plain; the reasoning tokens counted; thinking
switched off in the template; include_reasoning; a JSON format and tool calls that start after the reasoning;
reasoning sent back in the history; and the Responses API's reasoning items, plain, streamed and sent back.

The model is the tiny random one of reasoning_fixture: a bias on `</think>` makes it end its (random) reasoning
within a few tokens; what follows is constrained where the request asks, which shows the grammar waited.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Literal

import jsonschema
import pytest

from reasoning_fixture import build_reasoning_model, end_tag_id
from server_fixture import MODEL_NAME, running_server
from test_server_errors import assert_error

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What time is it?"}]
SEEDS = range(4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_reasoning_model(str(tmp_path_factory.mktemp("reasoning-server")))


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir, reasoning_parser="qwen3") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def sampling(model_dir) -> dict:
    """Random sampling with the closing tag made likely: the reasoning ends within a few tokens."""
    return dict(model=MODEL_NAME, temperature=1.0, extra_body={"logit_bias": {str(end_tag_id(model_dir)): 4.0}})


def _with(sampling: dict, seed: int, **extra_body) -> dict:
    return {**sampling, "extra_body": {**sampling["extra_body"], "seed": seed, **extra_body}}


def first_seed(make: Callable[[int], Any], wanted: Callable[[Any], bool]) -> tuple[int, Any]:
    """The first of SEEDS whose make(seed) is as the test needs (a random model's outputs differ from one CPU to
    another), and that result."""
    for seed in SEEDS:
        result = make(seed)
        if wanted(result):
            return seed, result
    pytest.fail("no seed gave the output the test needs")


def test_reasoning_and_a_json_answer(client, sampling):
    """The JSON format holds after the reasoning, which it leaves free; the tokens up to the closing tag (its own
    included) are the reasoning tokens."""
    answered = 0
    for seed in SEEDS:
        response = client.chat.completions.create(
            messages=MESSAGES, max_tokens=60, logprobs=True, **_with(sampling, seed),
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
        message, usage = response.choices[0].message, response.usage
        tokens = [lp.token for lp in response.choices[0].logprobs.content]
        if "</think>" not in tokens:
            assert message.content is None and usage.completion_tokens_details.reasoning_tokens == len(tokens)
            continue
        if response.choices[0].finish_reason != "stop":
            continue  # (the answer was cut off)
        answered += 1
        jsonschema.validate(json.loads(message.content), SCHEMA)
        assert message.reasoning == message.reasoning_content == ("".join(tokens[:tokens.index("</think>")]).strip()
                                                                  or None)
        assert usage.completion_tokens_details.reasoning_tokens == tokens.index("</think>") + 1
    assert answered >= 2


def test_a_stream_gives_what_the_response_gives(client, sampling):
    reasoned = 0
    for seed in SEEDS:
        kwargs = dict(messages=MESSAGES, max_tokens=30, **_with(sampling, seed))
        whole = client.chat.completions.create(**kwargs)
        reasoning = content = ""
        for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
            if chunk.usage is not None:
                assert chunk.usage.completion_tokens_details == whole.usage.completion_tokens_details
            for choice in chunk.choices:
                delta = choice.delta
                assert getattr(delta, "reasoning", None) == getattr(delta, "reasoning_content", None)
                reasoning += getattr(delta, "reasoning", None) or ""
                content += delta.content or ""
        message = whole.choices[0].message
        assert (reasoning or None, content or None) == (message.reasoning, message.content)
        reasoned += message.reasoning is not None
    assert reasoned


def test_thinking_switched_off_in_the_template(client, sampling):
    response = client.chat.completions.create(messages=MESSAGES, max_tokens=12, **_with(
        sampling, 0, logit_bias={}, chat_template_kwargs={"enable_thinking": False}))
    message = response.choices[0].message
    assert message.content and "reasoning" not in message.model_extra
    assert response.usage.completion_tokens_details.reasoning_tokens == 0


def test_reasoning_effort_is_the_templates_switch(client, sampling):
    """This template reads enable_thinking: effort "none" is thinking off (the same prompt as the switch), any other
    effort thinking on (the same prompt as none given); the Responses API's reasoning.effort alike, echoed."""
    def chat(**extra_body):
        return client.chat.completions.create(messages=MESSAGES, max_tokens=12, **_with(sampling, 0, logit_bias={},
                                                                                          **extra_body))
    switched_off = chat(chat_template_kwargs={"enable_thinking": False})
    off = chat(reasoning_effort="none")
    assert (off.usage, off.choices[0].message.content) == (switched_off.usage, switched_off.choices[0].message.content)
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    on, default = chat(reasoning_effort="high"), chat()
    assert on.usage.prompt_tokens == default.usage.prompt_tokens < off.usage.prompt_tokens  # the empty block
    assert on.usage.completion_tokens_details.reasoning_tokens > 0
    kwargs = dict(input="What time is it?", max_output_tokens=12, **_with(sampling, 0, logit_bias={}))
    response = client.responses.create(reasoning={"effort": "none"}, **kwargs)
    assert [item.type for item in response.output] == ["message"] and response.reasoning.effort == "none"
    assert response.usage.input_tokens > client.responses.create(**kwargs).usage.input_tokens


@pytest.mark.parametrize("path, body, match", [
    ("/v1/chat/completions", {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
     "chat_template_kwargs sets it to True"),
    ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort must be one of"),
    ("/v1/responses", {"reasoning": {"effort": "none", "summary": "auto"}}, "no summary is written"),
])
def test_reasoning_effort_refused(server, path, body, match):
    start = {"messages": MESSAGES} if path.endswith("completions") else {"input": "Hi"}
    with server.http() as http:
        assert_error(http.post(path, json={"model": MODEL_NAME, **start, **body}), 400, match)


def test_include_reasoning_false(client, sampling):
    """The reasoning is left out, and its tokens' logprobs with it; the answer and the usage stay."""
    kwargs = dict(messages=MESSAGES, max_tokens=30, logprobs=True)
    seed, shown = first_seed(lambda seed: client.chat.completions.create(**kwargs, **_with(sampling, seed)),
                             lambda response: response.choices[0].message.reasoning is not None)
    hidden = client.chat.completions.create(**kwargs, **_with(sampling, seed, include_reasoning=False))
    assert hidden.choices[0].message.content == shown.choices[0].message.content
    assert "reasoning" not in hidden.choices[0].message.model_extra
    assert hidden.usage.completion_tokens_details == shown.usage.completion_tokens_details
    thought = shown.usage.completion_tokens_details.reasoning_tokens
    assert [lp.token for lp in hidden.choices[0].logprobs.content] == \
        [lp.token for lp in shown.choices[0].logprobs.content][thought:]


def test_a_returned_message_goes_back_as_it_came(client, sampling):
    """The message as the client got it (reasoning under both names) is the next request's history."""
    _, first = first_seed(lambda seed: client.chat.completions.create(messages=MESSAGES, max_tokens=30,
                                                                      **_with(sampling, seed)),
                          lambda response: response.choices[0].message.reasoning is not None)
    again = client.chat.completions.create(messages=[*MESSAGES, first.choices[0].message,
                                                     {"role": "user", "content": "Thanks"}], max_tokens=2,
                                           **_with(sampling, 0))
    assert again.choices[0].finish_reason == "length"


def test_tool_calls_come_after_the_reasoning(client, sampling):
    called = 0
    for seed in SEEDS:
        response = client.chat.completions.create(messages=MESSAGES, max_tokens=120, tools=TOOLS,
                                                  tool_choice="required", parallel_tool_calls=False,
                                                  **_with(sampling, seed))
        choice = response.choices[0]
        if choice.message.tool_calls:
            called += 1
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_time" and json.loads(call.function.arguments)["tz"] in ("UTC", "CET")
            assert choice.finish_reason == "tool_calls" and "<tool_call>" not in (choice.message.reasoning or "")
    assert called >= 2


def test_reasoning_sent_back_renders_in_the_template(server):
    def prompt(assistant: dict) -> str:
        with server.http() as http:
            body = {"model": MODEL_NAME, "messages": [*MESSAGES, {"role": "assistant", "content": "Noon.", **assistant},
                                                      {"role": "user", "content": "Thanks"}]}
            tokens = http.post("/tokenize", json=body).json()["tokens"]
            return http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens}).json()["prompt"]

    assert "<think>\nthe clock\n</think>\n\nNoon." in prompt({"reasoning_content": "the clock"})
    assert prompt({"reasoning": "the clock"}) == prompt({"reasoning_content": "the clock"})
    with server.http() as http:
        bad = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [
            {"role": "user", "content": "hi", "reasoning_content": "no"}]})
        assert_error(bad, 400, "reasoning belongs to assistant messages")


def test_responses_give_a_reasoning_item_first(client, sampling):
    seen = 0
    for seed in SEEDS:
        kwargs = dict(input="What time is it?", max_output_tokens=30, **_with(sampling, seed))
        plain = client.responses.create(**kwargs)
        with client.responses.stream(**kwargs) as stream:
            events = list(stream)
        final = events[-1].response  # completed, or incomplete where the tokens ran out
        assert events[-1].type == f"response.{plain.status}"
        kinds = [item.type for item in plain.output]
        assert [item.type for item in final.output] == kinds and kinds in (["reasoning", "message"], ["message"])
        if kinds[0] != "reasoning":
            continue
        seen += 1
        reasoning = plain.output[0]
        assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.content[0].text
        assert final.output[0].content[0].text == reasoning.content[0].text and final.output_text == plain.output_text
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        done = [e for e in events if e.type == "response.reasoning_text.done"]
        assert "".join(deltas) == done[0].text == reasoning.content[0].text
        added = [e for e in events if e.type == "response.content_part.added"]
        assert added[0].part.type == "reasoning_text" and added[0].output_index == 0
        details = plain.usage.output_tokens_details
        assert 0 < details.reasoning_tokens <= plain.usage.output_tokens
        assert final.usage.output_tokens_details == details
    assert seen >= 2


def test_responses_take_their_reasoning_back(client, sampling):
    """The next turn renders the reasoning whether the client sends the output back (as agent frameworks do) or
    names the stored response: the prompts are the same."""
    _, first = first_seed(lambda seed: client.responses.create(input="What time is it?", max_output_tokens=30,
                                                               **_with(sampling, seed)),
                          lambda response: response.output[0].type == "reasoning")
    follow_up = {"role": "user", "content": "And now?"}
    kwargs = dict(max_output_tokens=4, **_with(sampling, 1))
    sent_back = client.responses.create(
        input=[{"role": "user", "content": "What time is it?"}, *[item.model_dump(exclude_none=True)
                                                                  for item in first.output], follow_up], **kwargs)
    chained = client.responses.create(input=[follow_up], previous_response_id=first.id, **kwargs)
    assert sent_back.usage.input_tokens == chained.usage.input_tokens
    without = client.responses.create(input=[{"role": "user", "content": "What time is it?"},
                                             *[item.model_dump(exclude_none=True) for item in first.output[1:]],
                                             follow_up], **kwargs)
    assert without.usage.input_tokens < sent_back.usage.input_tokens


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_the_agents_sdk_reads_and_sends_back_the_reasoning(server, sampling, api):
    """The OpenAI Agents SDK makes a reasoning item of either API's reasoning, and sends it back on the next run
    (as a reasoning input item, or a message's reasoning_content): the server takes it."""
    agents = pytest.importorskip("agents")

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_time(tz: Literal["UTC", "CET"]) -> str:
        """The time in a timezone."""
        return "12:00"

    async def go(seed: int) -> list:
        async with server.async_openai() as client:
            model = agents.OpenAIResponsesModel(MODEL_NAME, client) if api == "responses" else \
                agents.OpenAIChatCompletionsModel(MODEL_NAME, client)
            settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=250,
                                            temperature=1.0, extra_body=_with(sampling, seed)["extra_body"])
            agent = agents.Agent(name="clock", instructions="Tell the time.", model=model, model_settings=settings,
                                 tools=[get_time], tool_use_behavior="stop_on_first_tool")
            first = await agents.Runner.run(agent, "What time is it in Paris?", max_turns=2)
            again = await agents.Runner.run(agent, first.to_input_list() + [{"role": "user", "content": "And now?"}],
                                            max_turns=2)
            return [first.new_items, again.new_items]

    for seed in SEEDS:  # a random model may run out of tokens before its call ends: the SDK raises on that
        try:
            runs = asyncio.run(go(seed))
        except agents.exceptions.ModelBehaviorError:
            continue
        kinds = [[item.type for item in items] for items in runs]
        if "reasoning_item" not in kinds[0]:
            continue  # (the model closed its block at once: an empty reasoning makes no item)
        assert all(run[-2:] == ["tool_call_item", "tool_call_output_item"] for run in kinds)
        assert "reasoning_item" in kinds[1]
        return
    pytest.fail("no seed ended its calls within max_tokens")


def test_a_turn_cut_off_in_its_reasoning(client, sampling):
    """A response that ran out of tokens while reasoning still has a message (empty), and goes back as input."""
    kwargs = dict(max_output_tokens=3, **_with(sampling, 0, logit_bias={}))
    cut = client.responses.create(input="What time is it?", **kwargs)
    assert cut.status == "incomplete" and [item.type for item in cut.output] == ["reasoning", "message"]
    assert [item.status for item in cut.output] == ["incomplete", "incomplete"]  # the reasoning was cut off
    assert cut.output[1].content[0].text == "" and cut.usage.output_tokens_details.reasoning_tokens == 3
    again = client.responses.create(input=[{"role": "user", "content": "What time is it?"},
                                           *[item.model_dump(exclude_none=True) for item in cut.output]], **kwargs)
    assert again.status == "incomplete"


def test_bench_serve_times_reasoning_as_output(server, tmp_path):
    """`folio bench serve` on chat counts a reasoning model's reasoning chunks: the first token is the first
    reasoning token, not the first of the answer (these random outputs are all reasoning)."""
    from test_bench import _run, _write_conversations

    conversations, result = str(tmp_path / "chat.jsonl"), str(tmp_path / "serve.json")
    _write_conversations(conversations)
    report = _run(["bench", "serve", "--base-url", server.base_url, "--model", MODEL_NAME, "--endpoint", "chat",
                   "--dataset", conversations, "--num-prompts", "3", "--result-file", result], result)
    assert report["completed"] == 3 and report["output_tokens"] == 9
    assert all(r["ttft_s"] is not None for r in report["requests"])


R1_STYLE_TEMPLATE = ("{% for message in messages %}{% if message.role == 'user' %}<|im_start|>User: {{ message.content }}"
                     "{% else %}<|im_start|>Assistant: {{ message.content }}<|im_end|>{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>Assistant: <think>\n{% endif %}")


def test_a_template_that_opens_the_block(model_dir, sampling, tmp_path):
    """DeepSeek-R1's templates write the opening tag into the prompt: the model's first token is reasoning."""
    import shutil

    folder = str(tmp_path / "r1-style")
    shutil.copytree(model_dir, folder)
    with open(f"{folder}/tokenizer_config.json") as f:
        config = json.load(f)
    with open(f"{folder}/tokenizer_config.json", "w") as f:
        json.dump({**config, "chat_template": R1_STYLE_TEMPLATE}, f)
    with running_server(folder, reasoning_parser="deepseek_r1") as server:
        client = server.openai()
        _, response = first_seed(lambda seed: client.chat.completions.create(
            messages=MESSAGES, max_tokens=30, logprobs=True, **_with(sampling, seed)),
            lambda response: response.choices[0].message.content and not any(
                lp.token == "<think>" for lp in response.choices[0].logprobs.content))
        tokens = [lp.token for lp in response.choices[0].logprobs.content]
        thought = tokens.index("</think>")  # the reasoning is all the model wrote before it (nothing opened it)
        assert response.choices[0].message.reasoning == ("".join(tokens[:thought]).strip() or None)
        assert response.usage.completion_tokens_details.reasoning_tokens == thought + 1


def _items(*items: dict) -> list:
    from folio.entrypoints.openai.protocol_responses import ResponsesRequest

    return ResponsesRequest.model_validate({"input": list(items)}).input


def test_reasoning_input_items_go_to_the_assistant_turn_after_them():
    from folio.entrypoints.openai.serving_responses import chat_messages

    user = {"role": "user", "content": "hi"}
    call = {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"}
    summary_only = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}]}
    full = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "long"}]}
    messages = chat_messages(_items(user, summary_only, full, {"role": "assistant", "content": "Noon."}, user,
                                    full, call))
    assert [(m.role, m.reasoning_content) for m in messages] == [
        ("user", None), ("assistant", "short\n\nlong"), ("user", None), ("assistant", "long")]
    assert messages[3].tool_calls[0].id == "c1"
    for unfollowed in ([user, full, user], [user, full]):
        with pytest.raises(ValueError, match="must be followed by the assistant message or function call"):
            chat_messages(_items(*unfollowed))


def test_responses_refuse_what_they_cannot_take_back(server):
    with server.http() as http:
        unfollowed = http.post("/v1/responses", json={"model": MODEL_NAME, "input": [
            {"role": "user", "content": "hi"}, {"type": "reasoning", "summary": []}, {"role": "user", "content": "?"}]})
        assert_error(unfollowed, 400, "input[1]: a reasoning item must be followed", "input")
        encrypted = http.post("/v1/responses", json={"model": MODEL_NAME, "input": [
            {"role": "user", "content": "hi"}, {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}]})
        assert_error(encrypted, 400, "encrypted reasoning is not supported")
