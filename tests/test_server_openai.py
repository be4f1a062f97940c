"""The server through the official openai client: completions and chat, streamed and not, n, logprobs, stop,
seeds, echo, usage; plus /v1/models, /tokenize, /detokenize, /health, /version."""

from __future__ import annotations

import asyncio
import math
import re

import pytest

from conftest import hf_logprobs
from folio.tokenizer import Tokenizer
from server_fixture import MODEL_NAME, running_server

PROMPT = "Once upon a time there was"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def server(llama_dir):
    with running_server(llama_dir) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return Tokenizer.from_dir(llama_dir)


def test_completion_usage_matches_tokenizer(client, tokenizer):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL_NAME
    assert out.created > 0 and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and isinstance(choice.text, str)
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_streamed_completion_equals_full_one(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert len(chunks) > 2 and all(c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_prompt_lists_and_token_ids(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    kwargs = dict(model=MODEL_NAME, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    by_text = client.completions.create(prompt=PROMPT, **kwargs)
    hello = tokenizer.encode("hello")
    out = client.completions.create(prompt=[ids, hello, ids], n=2, **kwargs)
    assert [c.index for c in out.choices] == list(range(6))
    assert out.choices[0].text == out.choices[1].text == out.choices[4].text == by_text.choices[0].text
    assert out.usage.prompt_tokens == 2 * len(ids) + len(hello)
    assert out.usage.completion_tokens == 6 * 5
    texts = client.completions.create(prompt=[PROMPT, "hello"], **kwargs)
    assert [c.text for c in texts.choices] == [out.choices[0].text, out.choices[2].text]
    single = client.completions.create(prompt=ids, **kwargs)
    assert single.choices[0].text == by_text.choices[0].text


def test_n_samples_and_seed_reproducibility(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **kwargs)
    b = client.completions.create(seed=1234, **kwargs)
    c = client.completions.create(seed=4321, **kwargs)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != c.choices[0].text
    many = client.completions.create(seed=7, n=3, **kwargs)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert len({ch.text for ch in many.choices}) == 3  # seeded samples differ from each other...
    again = client.completions.create(seed=7, n=3, **kwargs)
    assert [ch.text for ch in again.choices] == [ch.text for ch in many.choices]  # ...and repeat exactly
    assert many.usage.completion_tokens == 48


def _plain_window(text: str, size: int = 3) -> str:
    """A stop string cut from the middle of a greedy output: the first run of letters, past the start."""
    match = re.search(r"[A-Za-z ]{%d}" % size, text[2:])
    assert match, f"no plain-text window in {text!r}"
    return match.group(0)


def test_stop_string_ends_and_never_leaks(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    free = client.completions.create(**kwargs).choices[0].text
    stop = _plain_window(free)
    expected = free[:free.index(stop)]
    out = client.completions.create(stop=[stop], **kwargs)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    chunks = [c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kwargs)]
    assert "".join(chunks) == expected and not any(stop in chunk for chunk in chunks)
    kept = client.completions.create(stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
                                     **{k: v for k, v in kwargs.items() if k != "extra_body"})
    assert kept.choices[0].text == expected + stop


def test_completion_logprobs_legacy_shape(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == out.usage.completion_tokens
    assert lp.text_offset[0] == 0
    for i, (token, logprob, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        assert logprob <= 0 and 1 <= len(top) <= 3
        if not any("\ufffd" in t for t in [token, *top]):  # partial-UTF-8 tokens share the text '\ufffd'
            assert len(top) == 2 and top[token] == pytest.approx(logprob)
            assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
        if i:
            assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])


def test_echo_scores_the_prompt(client, tokenizer, llama_dir):
    """lm-eval's loglikelihood request: echo, max_tokens 0, logprobs; values equal Transformers' log-softmax."""
    ids = tokenizer.encode(PROMPT)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                    temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    assert "".join(lp.tokens) == PROMPT
    reference = hf_logprobs(llama_dir, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(reference[i - 1, ids[i]].item(), abs=1e-4)
        greedy = max(lp.top_logprobs[i], key=lp.top_logprobs[i].get)
        assert lp.top_logprobs[i][greedy] == pytest.approx(reference[i - 1].max().item(), abs=1e-4)

    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert by_ids.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs)
    more = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, echo=True, temperature=0,
                                     logprobs=1)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert more.choices[0].text == PROMPT + plain.choices[0].text
    assert len(more.choices[0].logprobs.tokens) == len(ids) + more.usage.completion_tokens
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, echo=True, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == more.choices[0].text


def test_extra_parameters_accepted(client, tokenizer):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    plain = client.completions.create(**kwargs)
    extra = client.completions.create(user="someone", extra_body={
        "priority": 3, "cache_salt": "tenant-a", "top_k": 5, "min_p": 0.0, "repetition_penalty": 1.0,
        "min_tokens": 2, "skip_special_tokens": True, "stop_token_ids": [], "include_stop_str_in_output": False},
        presence_penalty=0.0, frequency_penalty=0.0, **kwargs)
    assert extra.choices[0].text == plain.choices[0].text
    biased = client.completions.create(logit_bias={"5": 100}, **{**kwargs, "max_tokens": 3},
                                       extra_body={"ignore_eos": True})
    assert biased.choices[0].text == tokenizer.decode([5, 5, 5]) and biased.usage.completion_tokens == 3


def test_chat_completion_and_stream(client, tokenizer):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kwargs)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    message = full.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_text_parts_and_max_completion_tokens(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_completion_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    joined = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hello\nworld"}],
                                            max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == joined.choices[0].message.content


def test_chat_logprobs_and_n(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0.8, n=2,
                                         seed=3, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 10
    for choice in out.choices:
        content = choice.logprobs.content
        assert len(content) == 5
        for entry in content:
            assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
            assert len(entry.top_logprobs) == 3
            tops = [t.logprob for t in entry.top_logprobs]
            assert tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-6


def test_async_client_streams(server):
    async def run() -> list[str]:
        client = server.async_openai()
        async def one(i: int) -> str:
            stream = await client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": f"number {i}"}], max_tokens=8,
                temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        results = await asyncio.gather(*(one(i) for i in range(4)))
        await client.close()
        return results

    results = asyncio.run(run())
    client = server.openai()
    for i, text in enumerate(results):
        alone = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": f"number {i}"}],
                                               max_tokens=8, temperature=0)
        assert text == alone.choices[0].message.content


def test_models_tokenize_detokenize_health_version(server, client, tokenizer):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME] and models.data[0].object == "model"
    http = server.http()
    ids = tokenizer.encode(PROMPT)
    tok = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert tok == {"count": len(ids), "max_model_len": server.llm.engine.max_model_len, "tokens": ids}
    chat_tok = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat_tok["tokens"] == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    assert http.get("/health").status_code == 200
    import folio
    assert http.get("/version").json() == {"version": folio.__version__}


def test_all_finished_and_freed(server):
    server.wait_idle()
    assert math.isclose(server.llm.scheduler_stats.kv_cache_usage, 0.0)


def test_openapi_describes_the_response_fields(server):
    """Response models that leave out their null extras still document every field (a serializer's return type
    would replace them with a bare object)."""
    with server.http() as http:
        schemas = http.get("/openapi.json").json()["components"]["schemas"]
    message = next(schema for name, schema in schemas.items() if name.startswith("AssistantMessage"))
    usage = next(schema for name, schema in schemas.items() if name.startswith("UsageInfo"))
    assert {"content", "tool_calls", "reasoning", "reasoning_content"} <= set(message["properties"])
    assert {"prompt_tokens", "completion_tokens", "completion_tokens_details"} <= set(usage["properties"])
