"""Speculative decoding is exact: greedy outputs equal decoding without it, token for token, whatever the
proposer, the batch, the dtype, stop conditions or preemption; the rejection sampler's sampled tokens follow
the target distribution (chi-square); proposers, scheduling, rollback and the adaptive policy in isolation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fake_runner import fake_runner_output
from folio import LLM, SamplingParams
from folio.core.step_contract import SampledTokens
from folio.sample.logits_processors import default_logits_processors
from folio.sample.rejection_sampler import RejectionSampler
from folio.spec_decode.config import SpeculativeConfig
from folio.spec_decode.ngram import NgramProposer
from folio.spec_decode.proposer import continuations
from folio.spec_decode.speculator import EXPLORE_EVERY, PROBE_EVERY, Speculator
from folio.spec_decode.suffix import SuffixProposer
from folio.worker.request_state import RequestState
from test_sampler import chi2_sf_even_df
from test_scheduler import make_request, make_scheduler

# prompts whose tokens repeat, so that lookups find drafts, and one without repetition
REPEATING = [[5, 6, 7, 8, 9] * 6, [40, 41, 42, 43] * 5 + [44, 45], list(range(100, 140)) + list(range(100, 120)),
             [300, 301] * 12]
RANDOM = [[(37 * i * i + 11 * i) % 480 + 10 for i in range(30)]]
PROMPTS = REPEATING + RANDOM


def _spec(method: str, draft: str | None = None) -> dict:
    """The config of a method; draft_model drafts with `draft` (tests use a tiny model, often the target itself)."""
    return {"method": method, "num_speculative_tokens": 4, **({"model": draft} if method == "draft_model" else {})}


def _generate(folder: str, prompts, params, **engine) -> tuple[list, LLM]:
    llm = LLM(folder, kv_cache_memory=1 << 22, **engine)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outputs, llm


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


# --- greedy exactness, end to end ---------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_equals_no_speculation(tiny_model_factory, llama_dir, method, dtype, steps_cost_the_prior):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected, _ = _generate(llama_dir, PROMPTS, params, dtype=dtype)
    draft = tiny_model_factory("qwen2")  # another model with the same vocabulary: it guesses wrong often
    accepted = 0
    for first, last in ((0, len(PROMPTS)), (0, 1), (2, 4)):  # batch compositions: all together, alone, a pair
        got, llm = _generate(llama_dir, PROMPTS[first:last], params, dtype=dtype,
                             speculative_config=_spec(method, draft if first else llama_dir))
        assert _tokens(got) == _tokens(expected[first:last])
        accepted += llm.llm_engine.get_stats().spec_decoding.num_accepted_tokens
    assert accepted > 0, "speculation should have run"


def test_stop_tokens_max_tokens_logprobs_n_and_preemption(llama_dir, steps_cost_the_prior):
    """Stops inside an accepted run, max_tokens cut, logprobs of accepted tokens, n > 1 and preemption with a
    tight KV cache: the same outputs as without speculation."""
    per_block = 2 * 2 * 2 * 16 * 4 * 4
    engine = dict(dtype="float32", block_size=4, max_model_len=64)
    params = [SamplingParams(temperature=0, max_tokens=30, logprobs=2),
              SamplingParams(temperature=0, max_tokens=7),
              SamplingParams(temperature=0, max_tokens=30, n=2, stop_token_ids=[8, 43, 119]),
              SamplingParams(temperature=0, max_tokens=25, min_tokens=20, stop_token_ids=[7, 42]),
              SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.2, presence_penalty=0.3)]
    prompts = [REPEATING[0], REPEATING[1], REPEATING[3], RANDOM[0], REPEATING[0][:20]]
    results, logprobs = [], []
    for spec in (None, _spec("ngram"), _spec("suffix"), _spec("draft_model", llama_dir)):
        models = 2 if spec and spec["method"] == "draft_model" else 1  # a draft model keeps its KV in each block too
        llm = LLM(llama_dir, kv_cache_memory=20 * models * per_block, speculative_config=spec, **engine)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
        results.append([[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs])
        logprobs.append([(t, v.logprob) for e in outs[0].outputs[0].logprobs for t, v in sorted(e.items())])
        if spec is not None:
            assert llm.llm_engine.get_stats().spec_decoding.num_accepted_tokens > 0
            assert llm.llm_engine.kv_cache_manager.num_free_blocks == 20
    assert results[1] == results[0] and results[2] == results[0] and results[3] == results[0]
    for other in logprobs[1:]:  # the same tokens; values computed in a verification chunk, not a decode step
        assert [t for t, _ in other] == [t for t, _ in logprobs[0]]
        assert [v for _, v in other] == pytest.approx([v for _, v in logprobs[0]], abs=1e-4)


def test_a_draft_model_identical_to_the_target_is_always_right(llama_dir, steps_cost_the_prior):
    """The target as its own draft model: every guess is accepted, through preemptions too, which shows the
    draft's KV cache stays consistent (after rejections, catch-ups and freed blocks)."""
    per_block = 2 * (2 * 2 * 2 * 16 * 4 * 4)  # the target's KV and the draft's
    llm = LLM(llama_dir, dtype="float32", block_size=4, max_model_len=64, kv_cache_memory=20 * per_block,
              speculative_config=_spec("draft_model", llama_dir))
    prompts = [REPEATING[0], REPEATING[1], RANDOM[0], REPEATING[3]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=30),
                        use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_decoding.num_draft_tokens > 20
    assert stats.spec_decoding.acceptance_rate == 1.0
    expected, _ = _generate(llama_dir, prompts, SamplingParams(temperature=0, max_tokens=30), dtype="float32")
    assert _tokens(outs) == _tokens(expected)


def test_a_draft_model_must_share_the_vocabulary(llama_dir, tmp_path):
    from conftest import build_tiny_model

    other = build_tiny_model(str(tmp_path / "big-vocab"), "llama", vocab_size=600)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(llama_dir, speculative_config=_spec("draft_model", other))


def test_streaming_gets_several_tokens_per_chunk(llama_dir, steps_cost_the_prior):
    from folio.engine.output_processor import OutputKind

    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22, speculative_config=_spec("ngram"))
    engine = llm.llm_engine
    engine.add_request("s", {"prompt_token_ids": REPEATING[0]}, SamplingParams(temperature=0, max_tokens=40),
                       output_kind=OutputKind.DELTA)
    chunks = []
    while engine.has_unfinished_requests():
        chunks += [o.outputs[0].token_ids for o in engine.step() if o.outputs]
    full = llm.generate({"prompt_token_ids": REPEATING[0]}, SamplingParams(temperature=0, max_tokens=40),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert [t for chunk in chunks for t in chunk] == full
    assert max(map(len, chunks)) > 1


def test_bad_speculative_config_names_the_field(llama_dir):
    for bad, field in (({"method": "eagle"}, "method"), ({"method": "ngram", "num_speculative_tokens": 0},
                                                         "num_speculative_tokens"),
                       ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_max"),
                       ({"method": "ngram", "lookahead": 3}, "lookahead"), ({"num_speculative_tokens": 3}, "method"),
                       ({"method": "ngram", "model": "x"}, "model")):
        with pytest.raises(ValueError, match=field):
            LLM(llama_dir, speculative_config=bad)
    with pytest.raises(ValueError, match="JSON"):
        SpeculativeConfig.parse("{method: ngram}")


# --- the rejection sampler's distribution ----------------------------------------------------------------------

def _state(params: SamplingParams, output=(), seed=None) -> RequestState:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return RequestState("r", [1, 2], params, frozenset(), generator, list(output))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)])
def test_rejection_sampler_follows_the_target_distribution(params):
    """Two verified positions with a fixed (one-hot) draft: the first output token is distributed as the target
    at position 0, and the second, given the draft was accepted, as the target at position 1."""
    vocab, n = 8, 6000
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, vocab, generator=g) * 1.5
    draft = int(rows[0].argsort()[-3])  # a plausible but not the likeliest token
    sampler = RejectionSampler()
    torch.manual_seed(1)
    requests = [_state(params) for _ in range(n)]
    out = sampler(rows.repeat(n, 1), requests, [[draft]] * n, default_logits_processors())

    def target(logits: torch.Tensor) -> torch.Tensor:
        x = logits.double() / params.temperature
        if params.top_k:
            x = x.masked_fill(x < x.topk(params.top_k).values[-1], -math.inf)
        return torch.softmax(x, 0)

    for position, tokens in ((0, [o.token_ids[0] for o in out]),
                             (1, [o.token_ids[1] for o in out if o.token_ids[0] == draft and len(o.token_ids) > 1])):
        p = target(rows[position])
        observed = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
        expected = p * len(tokens)
        keep = expected > 0
        assert observed[~keep].sum() == 0, "a token outside the target's support was emitted"
        statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        df = int(keep.sum()) - 1
        p_value = chi2_sf_even_df(statistic, df + (df % 2))  # an even df is the stricter neighbour
        assert p_value > 1e-6, f"position {position}: chi2={statistic:.1f}, observed={observed.tolist()}"
    assert all(len(o.token_ids) == 2 for o in out if o.token_ids[0] == draft)


def test_rejection_sampler_greedy_and_seeded():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0)
    sampler = RejectionSampler()
    # drafts [1, 0] both match the argmax: accepted, then the bonus argmax 2
    assert sampler(logits, [_state(greedy)], [[1, 0]], [])[0].token_ids == [1, 0, 2]
    # the second draft is wrong: the target's token replaces it and nothing more
    assert sampler(logits, [_state(greedy)], [[1, 2]], [])[0].token_ids == [1, 0]
    # min_tokens sees the drafts before each position: a stop token accepted only once enough tokens exist
    held = SamplingParams(temperature=0, min_tokens=2)
    state = RequestState("r", [1], held, frozenset({0}), None, [])
    assert sampler(logits, [state], [[1, 0]], default_logits_processors())[0].token_ids == [1, 2]
    state = RequestState("r", [1], held, frozenset({0}), None, [9])
    assert sampler(logits, [state], [[1, 0]], default_logits_processors())[0].token_ids == [1, 0, 2]
    seeded = SamplingParams(temperature=1.0, seed=3)
    runs = [sampler(logits, [_state(seeded, seed=3)], [[1, 0]], [])[0].token_ids for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_rejection_sampler_logprobs_are_those_of_each_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    out = RejectionSampler()(logits, [_state(SamplingParams(temperature=0, logprobs=1))], [[1]],
                             default_logits_processors())[0]
    raw = torch.log_softmax(logits, -1)
    assert out.token_ids == [1, 0]
    assert [lp.token_ids[0] for lp in out.logprobs] == [1, 0]
    assert out.logprobs[0].logprobs[0] == pytest.approx(float(raw[0, 1]))
    assert out.logprobs[1].logprobs[0] == pytest.approx(float(raw[1, 0]))


def test_rejection_sampler_logprobs_of_several_requests_are_each_their_own():
    """A step's logprobs are gathered together: each request still gets its own rows', with its own count."""
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    states = [_state(SamplingParams(temperature=0, logprobs=2)), _state(SamplingParams(temperature=0)),
              _state(SamplingParams(temperature=1.0, seed=1, logprobs=1), seed=1)]
    drafts = [[int(logits[0].argmax())], [], [3]]  # rows 0-1, 2, 3-4
    out = RejectionSampler()(logits, states, drafts, [])
    raw = torch.log_softmax(logits, -1)
    assert len(out[0].token_ids) == 2 and out[1].logprobs == []
    for i, first, k in ((0, 0, 2), (2, 3, 1)):
        assert len(out[i].logprobs) == len(out[i].token_ids)
        for row, token, lp in zip(raw[first:], out[i].token_ids, out[i].logprobs):
            assert lp.token_ids[:k] == row.topk(k).indices.tolist()
            assert lp.logprobs[lp.token_ids.index(token)] == pytest.approx(float(row[token]))


# --- proposers ---------------------------------------------------------------------------------------------

def test_continuations_find_the_longest_recurring_suffix():
    tokens = np.array([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], dtype=np.int32)
    assert continuations(tokens, 2, 5).tolist() == [3]  # "1 2 3" occurred at 0..2: continuation at 3
    assert continuations(tokens, 4, 5).tolist() == []  # no 4-token suffix recurs
    assert continuations(np.array([4, 5, 6], dtype=np.int32), 1, 3).tolist() == []


def test_ngram_copies_the_latest_occurrence():
    tokens = np.array([1, 2, 3, 4, 5, 1, 2, 3, 8, 9, 1, 2, 3], dtype=np.int32)
    assert NgramProposer(2, 4).propose([None], [tokens], [3]) == [[8, 9, 1]]
    loop = np.array([7, 5, 6, 5, 6, 5, 6], dtype=np.int32)  # a loop: its period is repeated past the end
    assert NgramProposer(2, 4).propose([None], [loop], [5]) == [[5, 6, 5, 6, 5]]
    assert NgramProposer(2, 4).propose([None], [np.arange(10, dtype=np.int32)], [3]) == [[]]


def test_suffix_votes_across_requests_and_stops_where_they_disagree():
    proposer = SuffixProposer(2, 4, cache_requests=8)
    for out in ([7, 8, 9, 10, 11], [7, 8, 9, 10, 12], [7, 8, 9, 10, 11]):
        proposer.finished(_state(SamplingParams(), output=out))
    context = np.array([50, 51, 7, 8], dtype=np.int32)
    assert proposer.propose([None], [context], [5]) == [[9, 10, 11]]  # 11 won 2 to 1
    proposer.finished(_state(SamplingParams(), output=[7, 8, 9, 10, 12]))
    assert proposer.propose([None], [context], [5]) == [[9, 10]]  # a tie: no majority for the next one
    assert proposer.propose([None], [np.array([70, 71], dtype=np.int32)], [5]) == [[]]


# --- scheduling and the adaptive policy ----------------------------------------------------------------------

def test_drafts_are_scheduled_within_the_budget_and_rolled_back_when_rejected():
    sched = make_scheduler(budget=6, block_size=4)
    sched.add_request(make_request("a", 3, max_tokens=20))
    out = sched.schedule()
    answer = fake_runner_output(sched, out, 9)
    answer.draft_token_ids = {"a": [10, 11, 12, 13, 14, 15, 16]}
    sched.update_from_output(out, answer)
    request = sched.requests["a"]
    out = sched.schedule()  # 1 known token + at most 5 drafts fit the budget of 6
    (item,) = out.scheduled
    assert item.num_tokens == 6 and item.draft_token_ids == [10, 11, 12, 13, 14]
    computed_before = request.num_computed_tokens
    sched.update_from_output(out, answer.__class__(sampled={"a": SampledTokens([10, 11, 99])}))
    assert request.num_computed_tokens == computed_before + 3  # the known token and two accepted drafts
    assert request.output_token_ids == [9, 10, 11, 99] and request.num_tokens == request.num_computed_tokens + 1
    stats = sched.stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 5, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0, 0, 0]
    # a block holding drafts is never published to the prefix cache: only block 0 is all known tokens
    assert len(sched.kv_cache_manager.pool.cached) == 1


class _Everything:
    """A proposer that always has as many guesses as it may give."""

    def propose(self, requests, tokens, max_drafts):
        return [[1] * k for k in max_drafts]

    def finished(self, request):
        pass


def _request(rid: str, **params) -> RequestState:
    request = _state(SamplingParams(max_tokens=500, **params))
    request.request_id = rid
    return request


def test_step_cost_model_interpolates_and_extrapolates_optimistically():
    from folio.spec_decode.step_cost import PRIOR_TOKEN_COST, StepCostModel

    model = StepCostModel()
    assert model.cost(3) == pytest.approx(1 + 2 * PRIOR_TOKEN_COST)  # nothing measured: the prior, in step units
    model.observe(1, 0.10)
    model.observe(5, 0.30)
    assert model.cost(3) == pytest.approx(0.20)  # between measurements
    assert model.cost(7) == pytest.approx(0.30 * (1 + 2 * PRIOR_TOKEN_COST))  # past them: the optimistic prior
    for _ in range(100):
        model.observe(5, 0.50)  # the machine got slower: recent steps weigh most
    assert model.cost(5) == pytest.approx(0.50, rel=1e-3)


def test_policy_gives_drafts_where_steps_are_cheap_and_guesses_good():
    speculator = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=6), _Everything(), max_model_len=1000)
    tokens = [np.zeros(4, dtype=np.int32)]
    for n in range(1, 20):  # mostly weight-bound: a token costs a fifth of a one-token step
        speculator.observe_step(n, 0.100 + 0.020 * n)
    good, bad = _request("good"), _request("bad")
    for _ in range(10):
        speculator.verified(good, 6, 6)
    for _ in range(5):
        speculator.verified(bad, 2, 0)
    drafts = speculator.propose([good, bad], tokens * 2)
    assert len(drafts["good"]) == 6 and "bad" not in drafts  # the failing request's guesses are not worth a token
    stats = speculator._acceptance["bad"]
    stats.steps_without_drafts = 0
    for wait in (PROBE_EVERY, 2 * PROBE_EVERY):  # a probe that fails doubles the wait for the next
        proposals = [len(speculator.propose([bad], tokens).get("bad", [])) for _ in range(wait + 1)]
        assert proposals[:wait] == [0] * wait and proposals[wait] >= 1, "tried again once the wait is over"
        speculator.verified(bad, proposals[wait], 0)
    assert stats.probe_every == 4 * PROBE_EVERY
    speculator.verified(bad, 2, 1)
    assert stats.probe_every == PROBE_EVERY  # a guess that pays resets the wait


def test_policy_backs_off_where_every_token_costs_its_share():
    speculator = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=6), _Everything(), max_model_len=1000)
    for n in range(1, 80):  # compute-bound: time proportional to tokens
        speculator.observe_step(n, 0.010 * n)
    requests = [_request(f"r{i}") for i in range(32)]
    for request in requests:
        for _ in range(3):
            speculator.verified(request, 4, 2)  # decent guesses, but far from certain
    assert speculator.propose(requests, [np.zeros(4, dtype=np.int32)] * 32) == {}
    near_end = _request("end")
    near_end.params.max_tokens = 3
    near_end.output_token_ids = [5, 5]
    assert speculator.propose([near_end], [np.zeros(4, dtype=np.int32)]) == {}  # one token left: no room


def test_policy_explores_when_its_estimates_rule_speculation_out():
    """A step cost measured in a slow moment must not switch speculation off for good: after EXPLORE_EVERY
    steps without drafts one request gets its full room; a failed exploration doubles the wait, one that pays
    resets it."""
    speculator = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=5), _Everything(), max_model_len=1000)
    speculator.observe_step(1, 0.01)
    for n in range(2, 8):
        speculator.observe_step(n, 10.0)  # one slow moment: longer steps look ruinous
    request, tokens = _request("r"), [np.zeros(4, dtype=np.int32)]
    for wait, accepted in ((EXPLORE_EVERY, 0), (2 * EXPLORE_EVERY, 0), (4 * EXPLORE_EVERY, 3)):
        assert speculator._explore_every == wait
        proposals = [len(speculator.propose([request], tokens).get("r", [])) for _ in range(wait)]
        assert proposals == [0] * (wait - 1) + [5], "explored once the wait is over, with the full room"
        speculator.verified(request, 5, accepted)
    assert speculator._explore_every == EXPLORE_EVERY


def test_structured_outputs_with_speculation(llama_dir, steps_cost_the_prior):
    """The grammar's mask at every verified position: drafts it forbids are rejected, so constrained outputs
    equal those without speculation (and the grammar still ends requests)."""
    from folio import StructuredOutputsParams

    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex))
              for regex in ("(fox )+dog", "(quick brown )+(lazy dog)?", "[a-e ]+")]
    prompts = [{"prompt_token_ids": REPEATING[i]} for i in range(3)]
    expected = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22).generate(prompts, params, use_tqdm=False)
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=1 << 22, speculative_config=_spec("ngram"))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == \
        [(o.outputs[0].text, o.outputs[0].finish_reason) for o in expected]
    assert llm.llm_engine.get_stats().spec_decoding.num_accepted_tokens > 0
