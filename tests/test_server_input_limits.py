"""Bad bytes and big requests: every one a 400 in OpenAI's shape, checked before the expensive work; a 500 keeps
the connection; tokenizing happens off the event loop."""

from __future__ import annotations

import socket
import threading

import pytest

from folio.entrypoints.openai.server_options import ServerOptions
from server_fixture import MODEL_NAME, running_server
from test_server_errors import assert_error

MAX_MODEL_LEN = 128
OPTIONS = ServerOptions(max_prompts_per_request=4, max_stop_strings=3, max_stop_string_chars=8, max_logit_bias=2,
                        max_tools=1)
SURROGATE = "a\\ud800b"  # as it travels in JSON: an escape of half a UTF-16 pair


@pytest.fixture(scope="module")
def server(llama_dir):
    with running_server(llama_dir, max_model_len=MAX_MODEL_LEN, options=OPTIONS) as s:
        yield s


def post_json_text(http, path: str, text: str):
    """POST a JSON body written by hand: json.dumps cannot write a lone surrogate's escape by itself."""
    return http.post(path, content=text.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", f'{{"prompt": "{SURROGATE}"}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["ok", "{SURROGATE}"]}}', "prompt"),
    ("/v1/completions", f'{{"prompt": "ok", "stop": ["{SURROGATE}"]}}', "stop"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}', "messages"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "hi"}}], "tools": [{{"type": "function", '
                             f'"function": {{"name": "f", "description": "{SURROGATE}"}}}}]}}', "tools"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "hi"}}], '
                             f'"chat_template_kwargs": {{"{SURROGATE}": 1}}}}', "chat_template_kwargs"),
    ("/tokenize", f'{{"prompt": "{SURROGATE}"}}', "prompt"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}', "messages"),
    ("/v1/responses", f'{{"input": "{SURROGATE}"}}', "input"),
    ("/v1/embeddings", f'{{"input": ["{SURROGATE}"]}}', "input"),
    ("/v1/completions", f'{{"prompt": "ok", "structured_outputs": {{"regex": "{SURROGATE}"}}}}',
     "structured_outputs"),
])
def test_lone_surrogates_are_400s(http, path, body, param):
    error = assert_error(post_json_text(http, path, body), 400, "surrogate")
    assert error["message"].startswith(param)


def test_paired_surrogates_are_text(http):
    response = post_json_text(http, "/tokenize", '{"prompt": "\\ud83d\\ude00"}')  # one emoji, as JSON escapes it
    assert response.status_code == 200 and response.json()["count"] >= 1


def test_beam_search_with_an_out_of_vocabulary_token_is_a_400(http):
    body = {"model": MODEL_NAME, "prompt": [1, 99999], "use_beam_search": True, "n": 2, "max_tokens": 2}
    assert_error(http.post("/v1/completions", json=body), 400, "vocabulary", "prompt")


@pytest.mark.parametrize("path,change,match,param", [
    ("/v1/completions", {"prompt": ["a"] * 5}, "at most 4", "prompt"),
    ("/v1/embeddings", {"input": ["a"] * 5}, "at most 4", "input"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d"]}, "at most 3", "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 9}, "at most 8", "stop"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 1, "2": 1, "3": 1}}, "at most 2", "logit_bias"),
    ("/v1/completions", {"prompt": list(range(1, MAX_MODEL_LEN + 1))}, "maximum context length", "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(2)]},
     "at most 1", "tools"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                   "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(2)]},
     "at most 1", "tools"),
])
def test_limits_are_400s(http, path, change, match, param):
    assert_error(http.post(path, json={"model": MODEL_NAME, **change}), 400, match, param)


@pytest.mark.parametrize("path,field,make", [
    ("/v1/completions", "prompt", lambda text: {"prompt": text}),
    ("/v1/embeddings", "input", lambda text: {"input": text}),
    ("/tokenize", "prompt", lambda text: {"prompt": text}),
    ("/v1/chat/completions", "messages", lambda text: {"messages": [{"role": "user", "content": text}]}),
    ("/v1/responses", "input", lambda text: {"input": text}),
])
def test_a_prompt_too_long_in_characters_is_refused_untokenized(server, http, monkeypatch, path, field, make):
    """More characters than max_model_len of the longest token could make: refused before it is tokenized."""
    tokenizer = server.llm.engine.get_tokenizer()
    longest = max(len(t) for t in tokenizer.backend.get_vocab(with_added_tokens=True))
    encoded = []
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: encoded.append(a) or [1])
    error = assert_error(http.post(path, json=make("x" * (MAX_MODEL_LEN * longest + 1))), 400, "characters long")
    assert error["param"] == field and not encoded


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}),
    ("/v1/embeddings", {"input": "hello"}),
    ("/v1/responses", {"input": "hello", "max_output_tokens": 1}),
    ("/tokenize", {"prompt": "hello"}),
])
def test_tokenizing_happens_off_the_event_loop(server, http, monkeypatch, path, body):
    tokenizer = server.llm.engine.get_tokenizer()
    encode = tokenizer.encode
    threads = []

    def recording_encode(*args, **kwargs):
        threads.append(threading.current_thread())
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording_encode)
    assert http.post(path, json=body).status_code == 200
    assert threads and server.thread not in threads  # the server thread runs the event loop


def _raw_requests(base_url: str, requests: list[bytes]) -> list[bytes]:
    """Send requests one after the other on one connection; each response's head and body as received."""
    host, port = base_url.removeprefix("http://").split(":")
    responses = []
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for request in requests:
            sock.sendall(request)
            data = b""
            while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
                chunk = sock.recv(65536)
                assert chunk, f"the server closed the connection after {len(responses)} responses"
                data += chunk
            responses.append(data)
    return responses


def _content_length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    return int(head.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])


def test_a_500_keeps_the_connection_open(server, monkeypatch):
    def broken_decode(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(server.llm.engine.get_tokenizer(), "decode", broken_decode)
    body = b'{"tokens": [1, 2]}'
    detokenize = (b"POST /detokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    first, second = _raw_requests(server.base_url, [detokenize, health])
    assert first.startswith(b"HTTP/1.1 500") and b"InternalServerError" in first and b"injected" in first
    assert second.startswith(b"HTTP/1.1 200")


def test_405_names_the_allowed_methods(http):
    response = http.get("/v1/completions")
    assert_error(response, 405)
    assert response.headers["allow"] == "POST"
