"""Every bad request gets a 4xx with OpenAI's error shape, never a 500, and never disturbs the engine."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from folio.entrypoints.openai import protocol
from server_fixture import MODEL_NAME, running_server

MAX_MODEL_LEN = 128
LIMIT = 1 << 16  # this server's body size limit


@pytest.fixture(scope="module")
def server(llama_dir):
    with running_server(llama_dir, max_model_len=MAX_MODEL_LEN, max_body_bytes=LIMIT) as s:
        yield s


def assert_error(response, status: int, match: str = "", param: object = ...) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["code"] == status
    assert match.lower() in error["message"].lower(), error["message"]
    if param is not ...:
        assert error["param"] == param, error
    return error


COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("change,match,param", [
    ({"stream": 0}, "boolean", "stream"),
    ({"echo": "yes"}, "boolean", "echo"),
    ({"n": "2"}, "integer", "n"),
    ({"max_tokens": 1.5}, "integer", "max_tokens"),
    ({"temperature": "hot"}, "number", "temperature"),
    ({"temperature": -1}, "temperature must be >= 0", "temperature"),
    ({"top_p": 0}, "top_p", "top_p"),
    ({"top_k": -5}, "top_k", "top_k"),
    ({"presence_penalty": 5}, "presence_penalty", "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
    ({"n": 0}, "n must be", "n"),
    ({"n": 17}, "n must be <= 16", "n"),
    ({"logprobs": 21}, "logprobs must be <= 20", "logprobs"),
    ({"max_tokens": -1}, "max_tokens", "max_tokens"),
    ({"max_tokens": 0}, "echo", None),
    ({"max_tokens": MAX_MODEL_LEN}, "maximum context length", "max_tokens"),
    ({"min_tokens": 10}, "min_tokens", "min_tokens"),
    ({"prompt": ""}, "empty", "prompt"),
    ({"prompt": []}, "empty", "prompt"),
    ({"prompt": [[]]}, "empty", "prompt"),
    ({"prompt": 5}, "prompt", "prompt"),
    ({"prompt": ["a", 1]}, "prompt", "prompt"),
    ({"prompt": [1, 99999]}, "vocabulary", "prompt"),
    ({"prompt": list(range(MAX_MODEL_LEN))}, "maximum context length", "prompt"),
    ({"stop": [1]}, "stop", "stop"),
    ({"stop": [""]}, "stop", "stop"),
    ({"stop_token_ids": [99999]}, "vocabulary", "stop_token_ids"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"5": 1000}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "vocabulary", "logit_bias"),
    ({"seed": 1 << 70}, "seed", "seed"),
    ({"seed": "1"}, "seed", "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options", None),
    ({"priority": 1.5}, "priority", "priority"),
    ({"suffix": "return x"}, "suffix is not supported by this model", "suffix"),
    ({"suffix": 3}, "string", "suffix"),
])
def test_bad_completion_requests(http, change, match, param):
    assert_error(http.post("/v1/completions", json={**COMPLETION, **change}), 400, match, param)


@pytest.mark.parametrize("change,match,param", [
    ({"messages": []}, "messages", "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role", "messages"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "tool_call_id", "messages"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, "tool_call_id", "messages"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "tool_calls belong", "messages"),
    ({"messages": [{"role": "user"}]}, "content is required", "messages"),
    ({"messages": [{"role": "assistant", "content": None}]}, "content is required", "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "content", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text content is supported, got a content part of type 'image_url'", "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]},
     "arguments", "messages"),
    ({"response_format": {"type": "bogus"}}, "response_format.type", "response_format"),
    ({"tool_choice": "required"}, "tools", "tool_choice"),
    ({"tools": [{"type": "function"}]}, "function", "tools"),
    ({"messages": "hi"}, "list", "messages"),
    ({"logprobs": 1}, "boolean", "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs", None),
    ({"logprobs": True, "top_logprobs": 25}, "logprobs must be <= 20", "logprobs"),
    ({"max_completion_tokens": MAX_MODEL_LEN}, "maximum context length", "max_tokens"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "chat_template_kwargs"),
    ({"temperature": -0.5}, "temperature", "temperature"),
    ({"stream": 1}, "boolean", "stream"),
])
def test_bad_chat_requests(http, change, match, param):
    assert_error(http.post("/v1/chat/completions", json={**CHAT, **change}), 400, match, param)


@pytest.mark.parametrize("change,match", [
    ({"functions": [{"name": "f", "parameters": {}}]}, "legacy function calling"),
    ({"function_call": "auto"}, "use tool_choice"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "text only"),
    ({"modalities": ["text", "audio"]}, "text only"),
    ({"prediction": {"type": "content", "content": "x"}}, "predicted outputs"),
    ({"web_search_options": {}}, "built-in tools"),
    ({"reasoning_effort": "low"}, "no reasoning control"),
    ({"verbosity": "low"}, "verbosity"),
    ({"store": True}, "not stored"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"echo": True}, "completions has it"),
    ({"documents": [{"text": "x"}]}, "chat_template_kwargs"),
    ({"add_special_tokens": True}, "chat template writes"),
    ({"use_beam_search": True}, "completions has it"),
    ({"chat_template": "{{ messages }}"}, "model's template"),
])
def test_openai_fields_this_server_cannot_honour_are_400s_naming_them(http, change, match):
    assert_error(http.post("/v1/chat/completions", json={**CHAT, **change}), 400, match, next(iter(change)))


def test_every_unsupported_field_is_a_field_of_its_request():
    """A misspelled name in a table would let every value through."""
    from folio.entrypoints.openai.protocol_responses import ResponsesRequest

    for model in (protocol.ChatCompletionRequest, protocol.CompletionRequest, ResponsesRequest):
        for field in model.unsupported:
            first, *rest = field.name.split(".")
            assert first in model.model_fields, (model.__name__, field.name)
            if rest:
                annotation = model.model_fields[first].annotation.__args__[0]  # Optional[X]
                assert rest[0] in annotation.model_fields, (model.__name__, field.name)


def test_every_field_declared_only_to_be_refused_is_in_a_table():
    """The twin of the test above: a field declared as Any (kept only so that its table can name it) that no
    table names would be accepted and do nothing. Billing and caching hints are the ones meant to do nothing."""
    from typing import Any, Optional

    from folio.entrypoints.openai.protocol_responses import ResponsesRequest

    hints = set(protocol.BillingAndCacheHints.model_fields)
    for model in (protocol.ChatCompletionRequest, protocol.CompletionRequest, ResponsesRequest):
        tabled = {field.name.split(".")[0] for field in model.unsupported}
        declared = {name for name, field in model.model_fields.items() if field.annotation == Optional[Any]}
        assert declared - hints <= tabled, (model.__name__, sorted(declared - hints - tabled))


def test_fields_that_ask_for_nothing_missing_are_accepted_and_unknown_ones_logged(server, http, caplog, monkeypatch):
    """Hints at billing, retention and caching change nothing here; values that ask for what the server does
    (text, no storing, medium verbosity) are fine; a field of no API is ignored, and the log names it once."""
    monkeypatch.setattr(protocol, "_warned_unknown", set())  # (other tests' fields fill the log's budget)
    asked = {"modalities": ["text"], "store": False, "verbosity": "medium", "metadata": {"k": "v"},
             "service_tier": "flex", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
             "prompt_cache_options": {"ttl": "1h"}, "safety_identifier": "u1", "reasoning_effort": None,
             "functions": [], "function_call": "none", "echo": False, "add_special_tokens": False,
             "spaces_between_special_tokens": False, "return_token_ids": False, "some_future_field": 1}
    with caplog.at_level("WARNING"):
        for _ in range(2):
            response = http.post("/v1/chat/completions", json={**CHAT, **asked})
            assert response.status_code == 200, response.text
    named = [r.getMessage() for r in caplog.records if "some_future_field" in r.getMessage()]
    assert len(named) == 1 and "ChatCompletionRequest" in named[0]
    assert not any("service_tier" in r.getMessage() for r in caplog.records)
    server.wait_idle()


@pytest.mark.parametrize("body", [b'{"prompt": "hi",', b"not json", b"[1, 2]", b'"hello"', b"",
                                  b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": Infinity}'])
def test_malformed_bodies(http, body):
    assert_error(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)


def test_missing_fields(http):
    assert_error(http.post("/v1/completions", json={"model": MODEL_NAME}), 400, "prompt", "prompt")
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL_NAME}), 400, "messages", "messages")


def test_unknown_model_is_404(http):
    assert_error(http.post("/v1/completions", json={**COMPLETION, "model": "gpt-4"}), 404, "gpt-4", "model")
    assert_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}), 404, "gpt-4", "model")
    assert_error(http.post("/tokenize", json={"model": "gpt-4", "prompt": "x"}), 404, "gpt-4", "model")


def test_unknown_routes_and_methods(http):
    assert_error(http.get("/v1/nope"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_tokenizer_endpoints_reject_bad_input(http):
    assert_error(http.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}), 400)
    assert_error(http.post("/tokenize", json={"prompt": "a", "tools": []}), 400, "tools go with messages")
    assert_error(http.post("/tokenize", json={}), 400)
    assert_error(http.post("/detokenize", json={"tokens": [1, -1]}), 400, "vocabulary", "tokens")
    assert_error(http.post("/detokenize", json={"tokens": ["a"]}), 400, "", "tokens")


def test_body_too_large_is_413(http):
    big = {**COMPLETION, "prompt": "x" * (LIMIT + 10)}
    assert_error(http.post("/v1/completions", json=big), 413, "limit")

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'
    assert_error(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)


_values = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.integers(-3, 40),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=4),
                    st.lists(st.integers(-3, 600), max_size=4), st.lists(st.text(max_size=3), max_size=3),
                    st.dictionaries(st.text(max_size=3), st.integers(-200, 200), max_size=2))
_fields = ["prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
           "frequency_penalty", "logit_bias", "logprobs", "echo", "top_k", "min_p", "repetition_penalty",
           "min_tokens", "stop_token_ids", "ignore_eos", "stream", "priority", "messages", "top_logprobs",
           "max_completion_tokens", "skip_special_tokens", "include_stop_str_in_output", "suffix", "tools",
           "tool_choice", "response_format"]


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(changes=st.dictionaries(st.sampled_from(_fields), _values, min_size=1, max_size=3), chat=st.booleans())
def test_fuzzed_requests_never_500(http, changes, chat):
    body = {**(CHAT if chat else COMPLETION), **changes}
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 16:
        body["max_tokens"] = 16  # keep the run short; the limits themselves are tested above
    response = http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert_error(response, 400)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_fails_that_request_only(server, http, stream):
    engine = server.llm.engine
    original = engine.step

    def failing_step():
        engine.step = original  # once
        raise RuntimeError("boom")

    engine.step = failing_step
    response = http.post("/v1/completions", json={**COMPLETION, "stream": stream})
    if stream:  # the status line was sent before the failure: the error comes as an event, then [DONE]
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500
    else:
        assert_error(response, 500, "boom")
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_engine_unharmed_by_all_of_the_above(server, http):
    server.wait_idle()
    ok = http.post("/v1/completions", json={**COMPLETION, "stream": False})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
    assert http.get("/health").status_code == 200
    server.wait_idle()
    assert json.loads(ok.text)["usage"]["completion_tokens"] >= 1
