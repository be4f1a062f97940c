"""Speculative decoding through the server: the same greedy completions as without it, streamed several
tokens at a time, and the spec_decode counters of /metrics moving with the verified drafts."""

from __future__ import annotations

import pytest

from conftest import prior_step_costs
from folio import LLM, SamplingParams
from server_fixture import MODEL_NAME, running_server
from test_server_concurrency import metrics

PROMPT = [5, 6, 7, 8, 9] * 6


@pytest.fixture(scope="module")
def server(llama_dir):
    with prior_step_costs(), running_server(llama_dir, speculative_config={"method": "ngram",
                                                                           "num_speculative_tokens": 4}) as s:
        yield s


def test_completions_equal_decoding_without_speculation(server, llama_dir):
    expected = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22).generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    before = metrics(server)
    client = server.openai()
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].text == expected and full.usage.completion_tokens == 40
    chunks = [c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True})]
    assert "".join(chunks) == expected
    assert len([c for c in chunks if c]) < 40, "accepted drafts arrive together"
    server.wait_idle()
    after = metrics(server)
    grew = {name: after[(f"folio:spec_decode_{name}_total", ())] - before.get((f"folio:spec_decode_{name}_total", ()), 0)
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    assert grew["num_drafts"] > 0 and grew["num_draft_tokens"] >= grew["num_accepted_tokens"] > 0
    assert after[("folio:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] > 0
