"""A hybrid model's recurrent states come out of the KV cache budget: the engine sets max_num_seqs rows of them
aside before the blocks, lowers max_num_seqs where the budget cannot hold that many besides the KV of one request
of max_model_len, refuses a budget without room for one request's states and a block, and the states, like the
cache, cost resident memory only for the rows written (folio.memory.zeros_on_demand)."""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest
import torch

from conftest import hf_greedy
from folio import LLM, SamplingParams
from folio.models.recurrent_state import RecurrentStates, StateSpec
from greedy_match import PROMPTS
from test_granite_moe_hybrid import CONV_DIM, KV_BLOCK, STATE_BYTES, build_granite_hybrid
from test_kv_cache_memory import GIB, _status_mib
from test_lfm2 import STATE_BYTES as LFM2_STATE_BYTES, lfm2_dir  # noqa: F401 (a fixture)

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory) -> str:
    return build_granite_hybrid(str(tmp_path_factory.mktemp("granite-memory")), num_local_experts=0,
                                num_experts_per_tok=0, shared_intermediate_size=96)


def test_a_gib_of_states_costs_resident_memory_only_for_the_rows_written():
    gc.collect()
    before = _status_mib("VmRSS")
    states = RecurrentStates({0: ((1024,), StateSpec((64, 1024), torch.float32))}, GIB // (64 * 1024 * 4),
                             torch.bfloat16, torch.device("cpu"))
    conv, ssm = states.states[0]
    assert (conv.dtype, ssm.dtype) == (torch.bfloat16, torch.float32)  # a spec's own dtype, else the model's
    assert _status_mib("VmRSS") - before < 16
    ssm[:2] = 1
    step = states.step(np.array([1, 0]), [True, False], [3, 1])  # row 1 starts from token 0: zeroed
    assert not ssm[1].any() and bool((ssm[0] == 1).all()) and step.rows.tolist() == [1, 0]
    assert _status_mib("VmRSS") - before < 16


def test_states_are_counted_per_request(granite_dir, lfm2_dir, llama_dir):  # noqa: F811
    """One request's states as each rank reports them: the conv inputs in the model's dtype, the SSM state in
    float32 (bf16: half the first); LFM2's convolutions through the same count; none for a model without them."""
    def state_bytes(folder: str, dtype: str) -> int:
        llm = LLM(folder, dtype=dtype, kv_cache_memory=1 << 22, max_num_seqs=2)
        return llm.llm_engine.executor.kv_cache_needs().state_bytes_per_seq

    assert state_bytes(granite_dir, "float32") == STATE_BYTES
    assert state_bytes(granite_dir, "bfloat16") == STATE_BYTES - 3 * CONV_DIM * 3 * 2
    assert state_bytes(lfm2_dir, "float32") == LFM2_STATE_BYTES
    assert state_bytes(llama_dir, "float32") == 0


def test_a_small_budget_lowers_max_num_seqs(granite_dir, caplog):
    """KV for one request of max_model_len and the states of three: five requests, three at a time."""
    with caplog.at_level(logging.WARNING, logger="folio"):
        llm = LLM(granite_dir, dtype="float32", block_size=4, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                  kv_cache_memory=MAX_MODEL_LEN // 4 * KV_BLOCK + 3 * STATE_BYTES + KV_BLOCK - 1)
    assert "lowering max_num_seqs from 8 to 3" in caplog.text
    engine = llm.llm_engine
    assert engine.scheduler.config.max_num_seqs == engine.runner.recurrent.num_rows == 3
    assert engine.kv_cache_manager.pool.num_blocks == MAX_MODEL_LEN // 4 and engine.max_model_len == MAX_MODEL_LEN
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(granite_dir, p, 12) for p in PROMPTS]


def test_a_budget_without_room_for_one_requests_states_is_refused(granite_dir):
    with pytest.raises(ValueError, match="too small for one request's recurrent states"):
        LLM(granite_dir, dtype="float32", block_size=4, kv_cache_memory=STATE_BYTES + KV_BLOCK - 1)
    llm = LLM(granite_dir, dtype="float32", block_size=4, kv_cache_memory=STATE_BYTES + KV_BLOCK)
    engine = llm.llm_engine  # one request, in one block: max_model_len lowered to what the block holds
    assert engine.scheduler.config.max_num_seqs == 1 and engine.max_model_len == 4
