"""Magistral's reasoning through the server (`--reasoning-parser mistral`) on the Magistral-style tiny model, whose
`[THINK]` and `[/THINK]` are special tokens: chat's reasoning and content (streamed as plain), the reasoning tokens
counted, a JSON format with and without thinking, and the Responses API's reasoning item.

A bias on `[THINK]` makes the random model open the block where a JSON format leaves it the choice at the first
token (in free text the tag's own logit is far too low for a bias to make it likely there and not everywhere after);
a bias on `[/THINK]` closes it within some tokens; a bias against `[THINK]` leaves the answer all content. The tiny
model's other special tokens are biased away: being random, it would write them anywhere, and the text of these
requests keeps special tokens (a real Magistral writes none in its answer); the end-of-sequence token that ends an
output stays out of it (the JSON content parses)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from reasoning_fixture import build_magistral_model, token_id
from server_fixture import MODEL_NAME, running_server
from test_reasoning_mistral import split_whole

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "What time is it?"}]
SEEDS = range(8)
TAGS = ("[THINK]", "[/THINK]")
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_magistral_model(str(tmp_path_factory.mktemp("magistral-server")))


@pytest.fixture(scope="module")
def client(model_dir):
    with running_server(model_dir, reasoning_parser="mistral") as server:
        yield server.openai()


OPENS, NEVER = (8.0, 4.0), (-100.0, 0.0)  # biases on [THINK] and [/THINK]


def _sampling(model_dir: str, seed: int, bias: tuple[float, float]) -> dict:
    others = {str(token_id(model_dir, t)): -100 for t in ("[INST]", "[/INST]", "<|im_start|>", "<|endoftext|>")}
    tags = {str(token_id(model_dir, tag)): value for tag, value in zip(TAGS, bias)}
    return dict(model=MODEL_NAME, temperature=1.0, extra_body={"seed": seed, "logit_bias": {**others, **tags}})


def _reasoning(message) -> str | None:
    return (message.model_extra or {}).get("reasoning")


def test_reasoning_then_a_json_answer_streamed_as_plain(client, model_dir):
    """An output that opens with [THINK] is reasoning up to [/THINK] (the reasoning tokens, its tags included),
    and the JSON format holds after it; one that does not opens the JSON at once. Streamed as plain."""
    kinds = []
    for seed in SEEDS:
        kwargs = dict(messages=MESSAGES, max_tokens=60, response_format=JSON_FORMAT,
                      **_sampling(model_dir, seed, OPENS))
        whole = client.chat.completions.create(logprobs=True, **kwargs)
        choice, usage = whole.choices[0], whole.usage
        tokens = [lp.token for lp in choice.logprobs.content]
        opened, closed = tokens[0] == "[THINK]", "[/THINK]" in tokens
        end = tokens.index("[/THINK]") + 1 if closed else len(tokens)
        assert usage.completion_tokens_details.reasoning_tokens == (end if opened else 0)
        if opened:
            assert _reasoning(choice.message) == (split_whole("".join(tokens[:end]))[0] or None)
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            kinds.append("thought" if _reasoning(choice.message) else "answered")
        reasoning = content = ""
        for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
            if chunk.usage is not None:
                assert chunk.usage.completion_tokens_details == usage.completion_tokens_details
            for delta in (c.delta for c in chunk.choices):
                reasoning += getattr(delta, "reasoning", None) or ""
                content += delta.content or ""
        assert (reasoning or None, content or None) == (_reasoning(choice.message), choice.message.content or None)
    assert kinds.count("thought") >= 2


def test_without_thinking_the_answer_is_content_from_the_first_token(client, model_dir):
    for seed in range(3):
        for response_format in (JSON_FORMAT, None):
            response = client.chat.completions.create(messages=MESSAGES, max_tokens=12, response_format=response_format,
                                                      **_sampling(model_dir, seed, NEVER))
            message = response.choices[0].message
            assert message.content and _reasoning(message) is None
            assert response.usage.completion_tokens_details.reasoning_tokens == 0
            if response_format is not None:
                jsonschema.validate(json.loads(message.content), SCHEMA)


def test_responses_give_a_reasoning_item_first(client, model_dir):
    kinds = {}
    for seed in SEEDS:
        for bias in (OPENS, NEVER):
            response = client.responses.create(input="What time is it?", max_output_tokens=60,
                                               text={"format": {"type": "json_schema", "name": "n", "schema": SCHEMA}},
                                               **_sampling(model_dir, seed, bias))
            kinds.setdefault(bias, set()).add(tuple(item.type for item in response.output))
            details = response.usage.output_tokens_details
            if response.output[0].type == "reasoning":
                assert response.output[0].content[0].text
                assert 0 < details.reasoning_tokens < response.usage.output_tokens
            if response.status == "completed":
                jsonschema.validate(json.loads(response.output_text), SCHEMA)
            if bias == NEVER:
                assert details.reasoning_tokens == 0
    assert kinds == {OPENS: {("reasoning", "message"), ("message",)}, NEVER: {("message",)}}
