"""vLLM's token-level sampling extras, offline and through the server: allowed_token_ids (only these tokens),
bad_words (never completed in the output, however the model reaches them) and truncate_prompt_tokens (the prompt's
last k tokens, before its length is checked)."""

from __future__ import annotations

import pytest

from folio import LLM, SamplingParams, StructuredOutputsParams
from folio.engine.input_processor import bad_words_token_ids
from server_fixture import MODEL_NAME
from test_server_errors import assert_error

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22)


def _tokens(llm: LLM, prompt=PROMPT, **params) -> list[int]:
    return llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, **params),
                        use_tqdm=False)[0].outputs[0].token_ids


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_allowed_token_ids_are_all_that_comes(llm):
    free = _tokens(llm, temperature=0)
    allowed = sorted(set(free[3:6]) | {11, 12})  # some of what greedy chose, and two others
    for params in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        tokens = _tokens(llm, allowed_token_ids=allowed, **params)
        assert set(tokens) <= set(allowed) and len(tokens) == 24
    assert set(_tokens(llm, temperature=0, allowed_token_ids=[11])) == {11}


def test_bad_words_never_complete(llm):
    tokenizer = llm.get_tokenizer()
    for params in (dict(temperature=0), dict(temperature=1.0, seed=5)):
        free = _tokens(llm, **params)
        pieces = (tokenizer.decode(free[i:i + 2]).strip() for i in range(len(free) - 1))  # of the output's own
        word, banned = next((w, b) for w in pieces if w for b in [bad_words_token_ids(tokenizer, [w])]
                            if any(_contains(free, s) for s in b))  # one the output wrote as its tokens spell it
        tokens = _tokens(llm, bad_words=[word], **params)
        assert not any(_contains(tokens, w) for w in banned) and len(tokens) == 24


def test_bad_words_are_their_tokens_with_and_without_a_space(llm):
    tokenizer = llm.get_tokenizer()
    sequences = bad_words_token_ids(tokenizer, ["hello"])
    assert sequences[0] == tokenizer.encode("hello", add_special_tokens=False)
    assert all(s != [*tokenizer.encode(" ", add_special_tokens=False), *sequences[0]] for s in sequences)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    long = {"prompt_token_ids": list(range(3, 40))}
    out = llm.generate(long, SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=5),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == list(range(35, 40))
    assert out.outputs[0].token_ids == _tokens(llm, {"prompt_token_ids": list(range(35, 40))}, temperature=0)[:8]
    too_long = {"prompt_token_ids": [7] * (llm.llm_engine.max_model_len + 10)}
    fits = llm.generate(too_long, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert len(fits.prompt_token_ids) == llm.llm_engine.max_model_len - 1


@pytest.mark.parametrize("params, field", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[10 ** 9]), "allowed_token_ids"),
    (dict(bad_words=["  "]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=10 ** 6), "truncate_prompt_tokens .* max_model_len"),
])
def test_bad_values_name_the_field(llm, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(PROMPT, SamplingParams(**params), use_tqdm=False)


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


def test_through_the_server(server, llama_dir):
    client = server.openai()
    tokenizer = server.llm.engine.get_tokenizer()
    allowed = [11, 12, 13]
    out = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=10, temperature=1.0, logprobs=0,
                                    extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "seed": 1})
    assert set(out.choices[0].logprobs.tokens) <= {tokenizer.decode([t]) for t in allowed}
    echoed = client.completions.create(model=MODEL_NAME, prompt=list(range(3, 30)), max_tokens=1, echo=True,
                                       extra_body={"truncate_prompt_tokens": 4})
    assert echoed.usage.prompt_tokens == 4
    assert echoed.choices[0].text.startswith(tokenizer.decode(list(range(26, 30)), skip_special_tokens=False))
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=4, extra_body={"truncate_prompt_tokens": 3, "bad_words": ["a"]})
    assert chat.usage.prompt_tokens == 3


def test_prompts_longer_than_the_context_are_truncated_not_refused(server):
    client = server.openai()
    max_model_len = server.llm.engine.max_model_len
    long = [5 + i % 50 for i in range(max_model_len + 40)]
    out = client.completions.create(model=MODEL_NAME, prompt=long, max_tokens=2,
                                    extra_body={"truncate_prompt_tokens": 8})
    assert out.usage.prompt_tokens == 8
    words = "word " * (max_model_len + 40)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": words}],
                                          max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert chat.usage.prompt_tokens == max_model_len - 1
    whole = client.embeddings.create(model=MODEL_NAME, input=[long[-16:]], encoding_format="float")
    cut = client.embeddings.create(model=MODEL_NAME, input=[long], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 16})
    assert cut.usage.prompt_tokens == 16 and cut.data[0].embedding == whole.data[0].embedding
    with server.http() as http:  # without truncation, refused as before
        assert_error(http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": long}), 400, "prompt")


def test_offline_embeddings_truncate_too(llm):
    from folio import PoolingParams

    long = {"prompt_token_ids": list(range(3, 60))}
    cut = llm.embed(long, PoolingParams(truncate_prompt_tokens=6), use_tqdm=False)[0]
    assert cut.prompt_token_ids == list(range(54, 60))
    assert cut.outputs.embedding == llm.embed({"prompt_token_ids": list(range(54, 60))},
                                              use_tqdm=False)[0].outputs.embedding


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [10 ** 9]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["x"] * 65}, "bad_words"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": 10 ** 6},
     "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 10 ** 6}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "bad_words": ["x"]}, "bad_words"),
    ("/v1/responses", {"input": "hi", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
])
def test_refused_with_a_400_naming_the_field(server, path, body, field):
    with server.http() as http:
        assert_error(http.post(path, json={"model": MODEL_NAME, **body}), 400, field)


def test_constraints_that_leave_no_token_are_refused_or_end_the_request(llm):
    eos = next(iter(llm.llm_engine.input_processor.eos_token_ids))
    with pytest.raises(ValueError, match="only stop tokens"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[eos], min_tokens=2), use_tqdm=False)
    word = llm.get_tokenizer().decode([11])
    if bad_words_token_ids(llm.get_tokenizer(), [word])[0] == [11]:
        with pytest.raises(ValueError, match="bad_words forbid"):
            llm.generate(PROMPT, SamplingParams(allowed_token_ids=[11], bad_words=[word]), use_tqdm=False)
    for field in (dict(allowed_token_ids=[11]), dict(bad_words=["x"])):
        with pytest.raises(ValueError, match="structured_outputs"):
            SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]), **field)
    # a two-token bad word that bans the only allowed token once its first token came: the request ends there
    for params in (dict(temperature=0), dict(temperature=1.0, seed=1)):
        out = llm.generate(PROMPT, SamplingParams(max_tokens=8, allowed_token_ids=[11, eos],
                                                  bad_words_token_ids=[[11, 11], [eos]], **params),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids[-1:] != [11] or len(out.token_ids) == 8
        assert 11 not in [a for a, b in zip(out.token_ids, out.token_ids[1:]) if b == 11]  # never 11 after 11
        assert set(out.token_ids) <= {11, eos}
