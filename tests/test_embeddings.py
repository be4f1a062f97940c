"""Embeddings: pooled final hidden states equal Transformers' (last token or mean, normalised or not), through
chunked prefill, the prefix cache and batches shared with generation; and /v1/embeddings through the openai client."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from folio import LLM, PoolingParams, SamplingParams
from folio.engine.output_processor import OutputKind
from server_fixture import MODEL_NAME

# Small blocks and a small step budget: long prompts are chunked over several steps.
ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, kv_cache_memory=1 << 22, num_threads=1)
PROMPTS = ["Paged attention keeps the KV cache in fixed-size blocks; continuous batching fills every step.", "hi"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, **ENGINE)


def hf_pooled(folder: str, ids: list[int], params: PoolingParams) -> torch.Tensor:
    from transformers import AutoModel

    with torch.no_grad():
        hidden = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()(torch.tensor([ids])).last_hidden_state[0]
    vector = hidden[-1] if params.pooling_type == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if params.normalize else vector


@pytest.mark.parametrize("params", [PoolingParams(), PoolingParams("mean"), PoolingParams("last", normalize=False)])
def test_embed_equals_transformers(llm, llama_dir, params):
    outputs = llm.embed(PROMPTS, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outputs):
        ids = tokenizer.encode(prompt)
        assert out.finished and out.prompt_token_ids == ids and len(out.outputs.embedding) == 64
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), hf_pooled(llama_dir, ids, params),
                                   atol=1e-5, rtol=1e-5)


def test_pooling_shares_batches_with_generation_and_the_cache(llm):
    """Pooling requests finish after their prompt while generation goes on in the same steps; a mean-pooled
    prompt never takes positions from the prefix cache (it needs them all), a last-token one may."""
    alone = {p.pooling_type: llm.embed(PROMPTS[0], p, use_tqdm=False)[0].outputs.embedding
             for p in (PoolingParams(), PoolingParams("mean"))}
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(PROMPTS, greedy, use_tqdm=False)
    engine = llm.llm_engine
    engine.add_request("gen-0", PROMPTS[0], greedy, output_kind=OutputKind.FINAL_ONLY)
    engine.add_request("last", PROMPTS[0], PoolingParams(), output_kind=OutputKind.FINAL_ONLY)
    engine.add_request("mean", PROMPTS[0], PoolingParams("mean"), output_kind=OutputKind.FINAL_ONLY)
    engine.add_request("gen-1", PROMPTS[1], greedy, output_kind=OutputKind.FINAL_ONLY)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            finished[out.request_id] = (steps, out)
    assert finished["mean"][1].outputs.embedding == pytest.approx(alone["mean"], abs=1e-6)
    assert finished["last"][1].outputs.embedding == pytest.approx(alone["last"], abs=1e-6)
    assert finished["last"][1].prompt_token_ids == expected[0].prompt_token_ids
    assert max(finished["last"][0], finished["mean"][0]) < finished["gen-0"][0]
    for i in range(2):
        assert finished[f"gen-{i}"][1].outputs[0].token_ids == expected[i].outputs[0].token_ids
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.pool.num_blocks


def test_bad_pooling_params(llm):
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams("cls")
    with pytest.raises(ValueError, match="params must be SamplingParams or PoolingParams"):
        llm.llm_engine.add_request("x", "hi", {"pooling_type": "mean"})


def test_embeddings_endpoint(llama_server, llm):
    client = llama_server.openai()
    offline = {p: [o.outputs.embedding for o in llm.embed(PROMPTS, PoolingParams(p), use_tqdm=False)]
               for p in ("last", "mean")}
    # without an encoding_format the openai client asks for base64 and decodes it; float comes as JSON numbers
    for encoding in ({}, {"encoding_format": "float"}):
        out = client.embeddings.create(model=MODEL_NAME, input=PROMPTS, **encoding)
        assert out.object == "list" and out.model == MODEL_NAME and [d.index for d in out.data] == [0, 1]
        for data, expected in zip(out.data, offline["last"]):
            assert data.object == "embedding" and data.embedding == pytest.approx(expected, abs=1e-5)
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    assert out.usage.prompt_tokens == out.usage.total_tokens == len(llm.get_tokenizer().encode(PROMPTS[0])) + len(ids)
    mean = client.embeddings.create(model=MODEL_NAME, input=PROMPTS[1], dimensions=64,
                                    extra_body={"pooling_type": "mean"})
    assert mean.data[0].embedding == pytest.approx(offline["mean"][1], abs=1e-5)
    by_ids = client.embeddings.create(model=MODEL_NAME, input=[ids, ids], encoding_format="float")
    assert by_ids.data[1].embedding == pytest.approx(offline["last"][1], abs=1e-5)

    with llama_server.http() as http:
        raw = http.post("/v1/embeddings", json={"input": "hi", "encoding_format": "base64"}).json()
        decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        assert decoded.tolist() == pytest.approx(offline["last"][1], abs=1e-5)
        for body, param in [({"input": "hi", "dimensions": 8}, "dimensions"), ({"input": ""}, "input"),
                            ({"input": []}, "input"), ({"input": "hi", "pooling_type": "cls"}, "pooling_type"),
                            ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
                            ({"input": list(range(600))}, "input"), ({"input": "hi", "model": "x"}, "model")]:
            error = http.post("/v1/embeddings", json=body)
            assert error.status_code in (400, 404) and error.json()["error"]["param"] == param, (body, error.text)
    llama_server.wait_idle()
