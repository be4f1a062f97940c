"""Scheduler and KV block accounting without a model: hand-made model outputs drive the scheduler."""

from __future__ import annotations

import itertools

from hypothesis import given, settings, strategies as st

from folio.config import SchedulerOptions
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.request import Request, RequestStatus
from fake_runner import fake_runner_output
from folio.core.scheduler import Scheduler
from folio.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks=16, block_size=4, budget=32, max_seqs=8, max_model_len=64, policy="fcfs"):
    cfg = SchedulerOptions(max_num_batched_tokens=budget, max_num_seqs=max_seqs, scheduling_policy=policy)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size), max_model_len)


_distinct = itertools.count(1)


def make_request(rid, prompt_len, max_tokens=4, priority=0, arrival=0.0, **params):
    """A request whose prompt shares no block with any other request's (no prefix-cache hits)."""
    base = next(_distinct) * 1000
    return Request(str(rid), list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=frozenset({EOS}), priority=priority, arrival_time=arrival)


def run_step(sched, token=7):
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_runner_output(sched, out, token))


def test_running_first_then_waiting_with_chunked_prefill():
    sched = make_scheduler(budget=10)
    for i, n in enumerate([6, 8, 3]):
        sched.add_request(make_request(i, n))
    out, _ = run_step(sched)
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("0", 6), ("1", 4)]
    out, _ = run_step(sched)
    # request 0 decodes one token, request 1 finishes its prompt, request 2 is admitted with what is left
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("0", 1), ("1", 4), ("2", 3)]


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_seqs=2)
    for i in range(4):
        sched.add_request(make_request(i, 3))
    out, _ = run_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_preempts_most_recent_and_requeues_in_front():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    sched.add_request(make_request("a", 8, max_tokens=10))
    sched.add_request(make_request("b", 8, max_tokens=10))
    run_step(sched)  # both prompts fill exactly 2 blocks each: 4 of 4 blocks used
    out, _ = run_step(sched)  # a's 10th token needs a 3rd block -> b (admitted last) is preempted
    assert out.preempted_ids == ["b"]
    assert sched.waiting.peek().request_id == "b"
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_output_tokens == 1


def test_priority_policy_orders_and_preempts_by_priority():
    sched = make_scheduler(num_blocks=4, budget=64, policy="priority")
    sched.add_request(make_request("low", 8, priority=5, arrival=0.0))
    sched.add_request(make_request("high", 8, priority=0, arrival=1.0))
    out, _ = run_step(sched)
    assert [s.request_id for s in out.scheduled] == ["high", "low"]
    out, _ = run_step(sched)
    assert out.preempted_ids == ["low"]


def test_stop_conditions():
    sched = make_scheduler()
    sched.add_request(make_request("eos", 3, max_tokens=10))
    sched.add_request(make_request("ignore", 3, max_tokens=2, ignore_eos=True))
    sched.add_request(make_request("stopid", 3, max_tokens=10, stop_token_ids=[EOS], ignore_eos=True))
    _, outs = run_step(sched, token=EOS)
    reasons = {o.request_id: (o.finish_reason, o.stop_reason) for o in outs}
    assert reasons == {"eos": ("stop", None), "ignore": (None, None), "stopid": ("stop", EOS)}
    _, outs = run_step(sched, token=EOS)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("ignore", "length")]
    assert sched.kv_cache_manager.num_free_blocks == 16


def test_min_tokens_delays_stop_and_max_model_len_ends():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("m", 3, max_tokens=20, min_tokens=2))
    reasons = []
    for _ in range(3):
        _, outs = run_step(sched, token=EOS)
        reasons.append(outs[0].finish_reason)
    assert reasons == [None, None, "stop"]
    sched.add_request(make_request("long", 5, max_tokens=20))
    lengths = [run_step(sched)[1] for _ in range(3)]
    assert lengths[-1][0].finish_reason == "length"  # 5 prompt + 3 output = max_model_len 8


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.booleans()), min_size=1, max_size=12),
       st.integers(6, 24), st.sampled_from([2, 4, 8]), st.integers(3, 40), st.integers(0, 10_000))
def test_block_accounting_under_random_workloads(reqs, num_blocks, block_size, budget, seed):
    import random

    rng = random.Random(seed)
    max_model_len = min(num_blocks * block_size, 64)
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, budget=budget, max_seqs=6,
                           max_model_len=max_model_len)
    pool = sched.kv_cache_manager.pool
    submitted = []
    for i, (plen, max_tokens, abort_later) in enumerate(reqs):
        plen = min(plen, max_model_len - 1)
        sched.add_request(make_request(i, plen, max_tokens=max_tokens))
        submitted.append((str(i), abort_later))
    finished: set[str] = set()
    for step in range(2000):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        sampled = fake_runner_output(sched, out, lambda: rng.choice([EOS, 5, 6, 7]) if rng.random() < 0.2 else 9)
        for o in sched.update_from_output(out, sampled):
            if o.finish_reason:
                finished.add(o.request_id)
        # invariants after every step
        owners: dict[int, str] = {}
        for rid, blocks in sched.kv_cache_manager.req_to_blocks[0].items():
            for b in blocks:
                assert b.ref_cnt == 1, "no block is shared unless deliberately"
                assert b.block_id not in owners, f"block {b.block_id} held by {owners.get(b.block_id)} and {rid}"
                owners[b.block_id] = rid
        assert all(b.ref_cnt >= 0 for b in pool.blocks)
        assert pool.num_free_blocks + len(owners) == num_blocks
        assert out.num_tokens <= budget
        if step == 5:  # abort some requests mid-flight
            to_abort = [rid for rid, abort in submitted if abort and rid not in finished]
            sched.finish_requests(to_abort, RequestStatus.FINISHED_ABORTED)
            finished.update(to_abort)
    assert sched.num_unfinished == 0, "every request finished: none starved"
    assert pool.num_free_blocks == num_blocks
    assert sorted(pool.free_queue.block_ids()) == list(range(num_blocks))
    assert not any(sched.kv_cache_manager.req_to_blocks)
