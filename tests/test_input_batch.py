"""The model runner's persistent input buffers: after any sequence of arrivals, chunks, decodes, preemptions
and finishes, each step's gathered inputs equal what the step's requests say, built naively per request.
The buffers only ever hear what the step messages carry (counts and new block ids) and the sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from folio.core.step_contract import ScheduledRequestData
from folio.sampling_params import SamplingParams
from folio.worker.input_batch import InputBatch
from folio.worker.request_state import RequestState

BLOCK = 4


@dataclass
class FakeRequest:
    """A request as both sides see it: the runner's RequestState, and the core's computed tokens and blocks."""

    state: RequestState
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    num_sent_blocks: int = 0  # how many of its blocks the runner has been told of

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.state.prompt_token_ids + self.state.output_token_ids

    def schedule(self, num_tokens: int) -> ScheduledRequestData:
        """This step's message, with the blocks the runner has not heard of yet."""
        item = ScheduledRequestData(self.request_id, self.num_computed_tokens, num_tokens,
                                    (self.blocks[self.num_sent_blocks:],))
        self.num_sent_blocks = len(self.blocks)
        return item


def fake_request(rid: str, prompt: list[int], blocks: list[int] = ()) -> FakeRequest:
    return FakeRequest(RequestState(rid, list(prompt), SamplingParams(), frozenset()), blocks=list(blocks))


def naive(reqs: list[FakeRequest], scheduled: list[ScheduledRequestData]):
    ids, pos, slots = [], [], []
    for r, item in zip(reqs, scheduled):
        for p in range(item.num_computed_tokens, item.num_computed_tokens + item.num_tokens):
            ids.append(r.all_token_ids[p])
            pos.append(p)
            slots.append(r.blocks[p // BLOCK] * BLOCK + p % BLOCK)
    return ids, pos, slots


def check_step(batch: InputBatch, reqs: list[FakeRequest], num_tokens: list[int]) -> None:
    scheduled = [r.schedule(n) for r, n in zip(reqs, num_tokens)]
    step = batch.prepare(scheduled, {r.request_id: r.state for r in reqs})
    ids, pos, slots = naive(reqs, scheduled)
    assert step.input_ids.tolist() == ids
    assert step.positions.tolist() == pos
    assert step.layouts[0].slot_mapping.tolist() == slots
    assert step.layouts[0].query_lens.tolist() == num_tokens
    assert step.layouts[0].seq_lens.tolist() == [r.num_computed_tokens + n for r, n in zip(reqs, num_tokens)]
    for i, (r, n) in enumerate(zip(reqs, num_tokens)):
        blocks = -(-(r.num_computed_tokens + n) // BLOCK)
        assert step.layouts[0].block_tables[i, :blocks].tolist() == r.blocks[:blocks]
    assert step.input_ids.dtype == step.positions.dtype == step.layouts[0].slot_mapping.dtype == torch.int64


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_incremental_rows_equal_naive_inputs(data):
    max_len = 40
    batch = InputBatch(max_num_reqs=3, max_model_len=max_len, block_size=BLOCK)  # grows past 3 rows
    live: dict[str, FakeRequest] = {}
    next_block, next_id = 0, 0
    for _ in range(data.draw(st.integers(1, 25))):
        action = data.draw(st.sampled_from(["add", "step", "step", "preempt", "finish"]))
        if action == "add" or not live:
            prompt = data.draw(st.lists(st.integers(0, 999), min_size=1, max_size=20))
            live[f"r{next_id}"] = fake_request(f"r{next_id}", prompt)
            next_id += 1
            continue
        rid = data.draw(st.sampled_from(sorted(live)))
        if action in ("preempt", "finish"):
            req = live[rid]
            batch.remove([rid])
            if action == "finish":
                del live[rid]
            else:  # recompute from scratch with new blocks, all sent again
                req.num_computed_tokens, req.blocks, req.num_sent_blocks = 0, [], 0
            continue
        reqs, num_tokens = [], []
        for req in live.values():
            if len(req.all_token_ids) >= max_len:
                continue
            left = len(req.all_token_ids) - req.num_computed_tokens
            n = data.draw(st.integers(1, left))
            while len(req.blocks) * BLOCK < req.num_computed_tokens + n:
                req.blocks.append(next_block)
                next_block += 1
            reqs.append(req)
            num_tokens.append(n)
        if not reqs:
            continue
        check_step(batch, reqs, num_tokens)
        for req, n in zip(reqs, num_tokens):  # what the runner and the scheduler do after the step
            req.num_computed_tokens += n
            if req.num_computed_tokens == len(req.all_token_ids):
                token = data.draw(st.integers(0, 999))
                req.state.output_token_ids.append(token)
                batch.append_tokens(req.request_id, [token])


def test_prepare_raises_when_blocks_are_missing():
    batch = InputBatch(max_num_reqs=2, max_model_len=16, block_size=BLOCK)
    req = fake_request("a", list(range(9)), blocks=[5])  # 9 tokens need 3 blocks
    with pytest.raises(ValueError, match="blocks"):
        batch.prepare([req.schedule(9)], {"a": req.state})


def test_rows_are_reused_after_release():
    batch = InputBatch(max_num_reqs=1, max_model_len=16, block_size=BLOCK)
    a = fake_request("a", [1, 2, 3], blocks=[7])
    check_step(batch, [a], [3])
    batch.remove(["a"])
    b = fake_request("b", [4, 5], blocks=[2])
    check_step(batch, [b], [2])
    assert batch.rows == {"b": 0} and len(batch.num_tokens) == 1
    assert np.array_equal(batch.token_ids[0, :2], [4, 5])


def test_append_tokens_refuses_to_pass_max_model_len():
    batch = InputBatch(max_num_reqs=1, max_model_len=4, block_size=BLOCK)
    a = fake_request("a", [1, 2, 3], blocks=[0])
    check_step(batch, [a], [3])
    batch.append_tokens("a", [9])
    assert batch.token_ids[0, :4].tolist() == [1, 2, 3, 9]
    with pytest.raises(ValueError, match="max_model_len"):
        batch.append_tokens("a", [10])
