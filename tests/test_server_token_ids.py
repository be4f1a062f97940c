"""vLLM's return_token_ids, return_tokens_as_token_ids, prompt_logprobs and continuous_usage_stats on completions
and chat: the prompt's and each choice's token ids in the response (streamed: the prompt's in the first chunk, each
chunk's own), logprobs naming tokens by id, the prompt's logprobs, and the usage so far in every chunk; absent
fields where not asked for; the Responses API refuses the first three."""

from __future__ import annotations

import pytest

from server_fixture import MODEL_NAME
from test_server_errors import assert_error

PROMPT = [5, 6, 7, 8]
MESSAGES = [{"role": "user", "content": "Count with me"}]


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def _extra(**body) -> dict:
    return {"extra_body": {"ignore_eos": True, "seed": 7, **body}}


def test_completions_give_the_prompt_and_the_choice_s_ids(client, server):
    tokenizer = server.llm.engine.get_tokenizer()
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=9, temperature=1.0, n=2, **_extra(return_token_ids=True))
    plain = client.completions.create(**kwargs)
    for choice in plain.choices:
        assert choice.model_extra["prompt_token_ids"] == PROMPT and len(choice.model_extra["token_ids"]) == 9
        assert tokenizer.decode(choice.model_extra["token_ids"]) == choice.text
    streamed: dict[int, dict] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            entry = streamed.setdefault(choice.index, {"prompt": choice.model_extra.get("prompt_token_ids"), "ids": []})
            entry["ids"] += choice.model_extra.get("token_ids") or []
    assert [(e["prompt"], e["ids"]) for _, e in sorted(streamed.items())] == \
        [(PROMPT, c.model_extra["token_ids"]) for c in plain.choices]
    bare = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert "token_ids" not in bare.choices[0].model_extra and "prompt_token_ids" not in bare.choices[0].model_extra


def test_chat_gives_the_rendered_prompt_s_ids_and_the_choice_s(client, server):
    with server.http() as http:
        prompt = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES}).json()["tokens"]
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=1.0, **_extra(return_token_ids=True))
    plain = client.chat.completions.create(**kwargs)
    assert plain.model_extra["prompt_token_ids"] == prompt
    ids = plain.choices[0].model_extra["token_ids"]
    assert len(ids) == plain.usage.completion_tokens == 8
    first, *rest = list(client.chat.completions.create(stream=True, **kwargs))
    assert first.model_extra["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in chunk.model_extra for chunk in rest)
    assert [t for chunk in rest for c in chunk.choices for t in c.model_extra.get("token_ids") or []] == ids
    bare = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    assert "prompt_token_ids" not in bare.model_extra and "token_ids" not in bare.choices[0].model_extra


def test_logprobs_name_tokens_by_id(client):
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, logprobs=2,
                                           **_extra(return_tokens_as_token_ids=True, return_token_ids=True))
    choice = completion.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.model_extra["token_ids"]]
    assert all(key.startswith("token_id:") for top in choice.logprobs.top_logprobs for key in top)
    assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, logprobs=True,
                                          top_logprobs=2, **_extra(return_tokens_as_token_ids=True,
                                                                   return_token_ids=True))
    content = chat.choices[0].logprobs.content
    assert [lp.token for lp in content] == [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]
    assert all(top.token.startswith("token_id:") for lp in content for top in lp.top_logprobs)


def test_prompt_logprobs_are_echo_s_and_come_first_when_streamed(client, server):
    echo = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, echo=True, logprobs=2)
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, extra_body={"prompt_logprobs": 2})
    positions = client.completions.create(**kwargs).choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == len(PROMPT) and positions[0] is None
    for i, position in enumerate(positions[1:], 1):
        assert position[str(PROMPT[i])]["logprob"] == pytest.approx(echo.choices[0].logprobs.token_logprobs[i])
        assert 2 <= len(position) <= 3 and sorted(lp["rank"] for lp in position.values())[:2] == [1, 2]
    first = next(iter(client.completions.create(stream=True, **kwargs)))
    assert first.choices[0].model_extra["prompt_logprobs"] == positions
    with server.http() as http:
        prompt = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES}).json()["tokens"]
    chat = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0})
    plain = client.chat.completions.create(**chat).model_extra["prompt_logprobs"]
    assert len(plain) == len(prompt) and all(str(t) in p for t, p in zip(prompt[1:], plain[1:]))
    assert next(iter(client.chat.completions.create(stream=True, **chat))).model_extra["prompt_logprobs"] == plain
    assert "prompt_logprobs" not in client.chat.completions.create(**{**chat, "extra_body": {}}).model_extra


@pytest.mark.parametrize("field", ["return_token_ids", "return_tokens_as_token_ids", "prompt_logprobs"])
def test_the_responses_api_refuses_them(server, field):
    value = 1 if field == "prompt_logprobs" else True
    with server.http() as http:
        assert_error(http.post("/v1/responses", json={"model": MODEL_NAME, "input": "hi", field: value}), 400, field)


@pytest.mark.parametrize("body, match", [
    ({"echo": True, "logprobs": 1, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"use_beam_search": True, "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_prompt_logprobs_refused(server, body, match):
    with server.http() as http:
        assert_error(http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, **body}), 400, match)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, stream=True, **_extra())
    chunks = list(client.completions.create(stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            **kwargs))
    counted = [chunk.usage.completion_tokens for chunk in chunks if chunk.choices]
    assert counted == sorted(counted) and counted[-1] == 6 and all(c.usage.prompt_tokens == 4 for c in chunks)
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    plain = list(client.completions.create(stream_options={"include_usage": True}, **kwargs))
    assert all(chunk.usage is None for chunk in plain if chunk.choices)


def test_prompt_fields_stream_even_when_the_first_piece_has_no_text(client, server):
    """A first token that decodes to nothing yet (here: the only one allowed, a byte of a character or none at
    all) still sends the choice's prompt fields."""
    tokenizer = server.llm.engine.get_tokenizer()
    empty = next(t for t in range(3, 500) if tokenizer.decode([t]) == "")  # (a special token, or a partial byte)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, stream=True,
                                            extra_body={"prompt_logprobs": 0, "allowed_token_ids": [empty],
                                                        "return_token_ids": True}))
    first = chunks[0].choices[0].model_extra
    assert first["prompt_token_ids"] == PROMPT and len(first["prompt_logprobs"]) == len(PROMPT)


def test_echo_of_zero_tokens_returns_no_token_ids(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True,
                                    extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == [] and out.usage.completion_tokens == 0
