"""The model runner's persistent input buffers: after any sequence of arrivals, chunks, decodes, preemptions
and finishes, each step's gathered inputs equal what the step's requests say, built naively per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from folio.core.scheduler import ScheduledRequest
from folio.worker.input_batch import InputBatch

BLOCK = 4


@dataclass
class FakeRequest:
    """The fields of folio.core.request.Request that the input batch reads."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def naive(scheduled: list[ScheduledRequest]):
    ids, pos, slots = [], [], []
    for item in scheduled:
        r = item.request
        for p in range(r.num_computed_tokens, r.num_computed_tokens + item.num_tokens):
            ids.append(r.all_token_ids[p])
            pos.append(p)
            slots.append(r.blocks[p // BLOCK] * BLOCK + p % BLOCK)
    return ids, pos, slots


def check_step(batch: InputBatch, scheduled: list[ScheduledRequest]) -> None:
    by_id = {s.request.request_id: s.request for s in scheduled}
    step = batch.prepare(scheduled, lambda rid, start: by_id[rid].blocks[start:])
    ids, pos, slots = naive(scheduled)
    assert step.input_ids.tolist() == ids
    assert step.positions.tolist() == pos
    assert step.layout.slot_mapping.tolist() == slots
    assert step.layout.query_lens.tolist() == [s.num_tokens for s in scheduled]
    assert step.layout.seq_lens.tolist() == [s.request.num_computed_tokens + s.num_tokens for s in scheduled]
    for i, s in enumerate(scheduled):
        n = -(-(s.request.num_computed_tokens + s.num_tokens) // BLOCK)
        assert step.layout.block_tables[i, :n].tolist() == s.request.blocks[:n]
    assert step.input_ids.dtype == step.positions.dtype == step.layout.slot_mapping.dtype == torch.int64


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
            live[f"r{next_id}"] = FakeRequest(f"r{next_id}", prompt)
            next_id += 1
            continue
        rid = data.draw(st.sampled_from(sorted(live)))
        if action in ("preempt", "finish"):
            req = live[rid]
            batch.remove([rid])
            if action == "finish":
                del live[rid]
            else:  # recompute from scratch with new blocks
                req.num_computed_tokens, req.blocks = 0, []
            continue
        scheduled = []
        for req in live.values():
            if req.num_tokens >= max_len:
                continue
            left = req.num_tokens - req.num_computed_tokens
            n = data.draw(st.integers(1, left))
            while len(req.blocks) * BLOCK < req.num_computed_tokens + n:
                req.blocks.append(next_block)
                next_block += 1
            scheduled.append(ScheduledRequest(req, n))
        if not scheduled:
            continue
        check_step(batch, scheduled)
        for item in scheduled:  # what the scheduler does after the step
            req = item.request
            req.num_computed_tokens += item.num_tokens
            if req.num_computed_tokens == req.num_tokens:
                req.all_token_ids.append(data.draw(st.integers(0, 999)))


def test_prepare_raises_when_blocks_are_missing():
    batch = InputBatch(max_num_reqs=2, max_model_len=16, block_size=BLOCK)
    req = FakeRequest("a", list(range(9)), blocks=[5])  # 9 tokens need 3 blocks
    with pytest.raises(ValueError, match="blocks"):
        batch.prepare([ScheduledRequest(req, 9)], lambda rid, start: req.blocks[start:])


def test_rows_are_reused_after_release():
    batch = InputBatch(max_num_reqs=1, max_model_len=16, block_size=BLOCK)
    a = FakeRequest("a", [1, 2, 3], blocks=[7])
    check_step(batch, [ScheduledRequest(a, 3)])
    batch.remove(["a"])
    b = FakeRequest("b", [4, 5], blocks=[2])
    check_step(batch, [ScheduledRequest(b, 2)])
    assert batch.rows == {"b": 0} and len(batch.num_tokens) == 1
    assert np.array_equal(batch.token_ids[0, :2], [4, 5])
