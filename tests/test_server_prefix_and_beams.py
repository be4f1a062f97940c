"""Prefix caching and beam search through the server: usage.cached_tokens, use_beam_search, best_of."""

from __future__ import annotations

import pytest
import torch

from conftest import _hf_model
from folio import LLM, BeamSearchParams
from server_fixture import MODEL_NAME, running_server

PREFIX = list(range(30, 70))


@pytest.fixture(scope="module")
def server(llama_dir):
    with running_server(llama_dir) as s:
        yield s


def test_usage_reports_cached_prompt_tokens(server):
    client = server.openai()
    first = client.completions.create(model=MODEL_NAME, prompt=PREFIX + [1, 2], max_tokens=2)
    second = client.completions.create(model=MODEL_NAME, prompt=PREFIX + [3, 4], max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    salted = client.completions.create(model=MODEL_NAME, prompt=PREFIX + [5], max_tokens=2,
                                       extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    metrics = server.http().get("/metrics").text
    assert "folio:prefix_cache_hits_total" in metrics


def test_use_beam_search_equals_offline_and_transformers(server, llama_dir):
    prompt = [100, 101, 102, 103]
    out = server.openai().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, n=2,
                                             extra_body={"use_beam_search": True, "best_of": 3, "ignore_eos": True})
    got = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    offline = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22).beam_search(
        {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
    assert got == [s.text for s in offline.sequences[:2]]
    ref = _hf_model(llama_dir).generate(torch.tensor([prompt]), max_new_tokens=6, num_beams=3, do_sample=False,
                                        num_return_sequences=3, eos_token_id=None, pad_token_id=0)
    assert [s.tokens for s in offline.sequences] == [r[len(prompt):].tolist() for r in ref]
    assert out.usage.completion_tokens == 12
    server.wait_idle()


@pytest.mark.parametrize("body,param", [({"use_beam_search": True, "stream": True}, None),
                                        ({"best_of": 2}, None), ({"use_beam_search": True, "n": 11}, "beam_width")])
def test_bad_beam_requests(server, body, param):
    r = server.http().post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3, **body})
    assert r.status_code == 400 and r.json()["error"]["type"]
