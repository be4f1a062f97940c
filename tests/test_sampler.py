"""Batched sampler: greedy, seeded reproducibility, truncation (top_k/top_p/min_p), the sampled distribution,
penalties, logprobs. Each check computes its expectation independently of folio's code (float64, plain loops)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from folio.sample import sampler as sampler_mod, sampling_ops
from folio.sample.logits_processors import LogitsProcessor, default_logits_processors
from folio.sample.sampler import Sampler, compute_prompt_logprobs
from folio.sample.sampling_metadata import SamplingMetadata
from folio.sampling_params import SamplingParams
from folio.worker.request_state import RequestState

torch.set_num_threads(1)
sampler = Sampler()


def sample(logits: torch.Tensor, rows: list[RequestState]):
    """One step of the sampler: the step's metadata built from the rows, then the batch sampled."""
    return sampler(logits, SamplingMetadata.build(rows, default_logits_processors()))


def row(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
        generator: torch.Generator | None = None, stop: set[int] | None = None) -> RequestState:
    return RequestState("r", list(prompt or [0]), params, frozenset(stop or ()), generator, list(output or []))


def allowed_tokens(logits: torch.Tensor, params: SamplingParams, tol: float = 1e-6) -> set[int]:
    """Tokens the params allow, in float64 and vLLM's order (temperature, min_p, top_k, top_p); tol widens
    each boundary slightly, so the set is a superset robust to float32 rounding in the sampler."""
    x = logits.double()
    if params.is_greedy:
        return set(torch.nonzero(x == x.max()).flatten().tolist())
    x = x / params.temperature
    keep = x > -math.inf
    if params.min_p > 0:
        p = torch.softmax(x, 0)
        keep &= p >= params.min_p * p.max() * (1 - tol)
    if params.top_k:
        kth = x.masked_fill(~keep, -math.inf).sort(descending=True).values[min(params.top_k, len(x)) - 1]
        keep &= x >= kth - tol * (1 + abs(kth))
    if params.top_p < 1:
        p = torch.softmax(x.masked_fill(~keep, -math.inf), 0)
        # "more likely" beyond rounding: probabilities that float32 cannot tell apart are ties either way
        mass_of_more_likely = torch.stack([p[p > pi * (1 + tol)].sum() for pi in p])
        keep &= mass_of_more_likely < params.top_p + tol
    return set(torch.nonzero(keep).flatten().tolist())


def chi2_sf_even_df(x: float, df: int) -> float:
    """Survival function of chi-square with an even number of degrees of freedom (closed form)."""
    half = x / 2
    return math.exp(-half) * sum(half ** i / math.factorial(i) for i in range(df // 2))


# --- greedy -----------------------------------------------------------------------------------------------

def test_all_greedy_is_argmax_and_skips_random_path(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(5, 100, dtype=torch.bfloat16)
    before = logits.clone()

    def fail(*args):
        raise AssertionError("all-greedy batch must not take the random path")

    monkeypatch.setattr(sampler_mod, "draw", fail)
    monkeypatch.setattr(Sampler, "_sample", fail)  # plain greedy rows never need the float32 copy
    out = sample(logits, [row(SamplingParams(temperature=0.0)) for _ in range(5)])
    assert out.sampled_token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 5
    assert torch.equal(logits, before), "the caller's logits must not be modified"


def test_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    rows = [row(SamplingParams(temperature=0.0)),
            row(SamplingParams(temperature=1.0, top_k=1)),
            row(SamplingParams(temperature=0.0, seed=3), generator=torch.Generator().manual_seed(3)),
            row(SamplingParams(temperature=1.3))]
    out = sample(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    assert out.sampled_token_ids[:3] == argmax[:3]
    assert 0 <= out.sampled_token_ids[3] < 50


def test_plain_greedy_rows_beside_rows_that_need_the_full_path():
    """Greedy rows with logprobs, penalties, logit_bias or pending min_tokens take the full path; the
    others the fast argmax; each row gets what it would get alone."""
    torch.manual_seed(2)
    logits = torch.randn(6, 40, dtype=torch.bfloat16)
    greedy = SamplingParams(temperature=0.0)
    rows = [row(greedy),
            row(SamplingParams(temperature=0.0, logprobs=2)),
            row(greedy, output=[1]),
            row(SamplingParams(temperature=0.0, logit_bias={7: 100.0})),
            row(SamplingParams(temperature=0.0, min_tokens=3), stop={int(logits[4].float().argmax())}),
            row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[int(logits[5].float().argmax())])]
    out = sample(logits, rows)
    alone = [sample(logits[i:i + 1], [r]) for i, r in enumerate(rows)]
    assert out.sampled_token_ids == [a.sampled_token_ids[0] for a in alone]
    assert out.sampled_token_ids[3] == 7
    assert out.sampled_token_ids[4] != int(logits[4].float().argmax())
    assert out.logprobs[1] is not None and out.logprobs[1].token_ids[0] == out.sampled_token_ids[1]
    assert [lp is None for lp in out.logprobs] == [True, False, True, True, True, True]


class AllowedTokens(LogitsProcessor):
    """A stand-in for a grammar's token mask: requests whose prompt starts with 0 may only emit given tokens."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed
        self.calls: list[list[int]] = []

    def applies(self, request: RequestState) -> bool:
        return request.prompt_token_ids[0] == 0

    def apply(self, logits: torch.Tensor, rows: list[int], requests: list[RequestState]) -> None:
        self.calls.append(list(rows))
        mask = torch.full((logits.shape[1],), -math.inf)
        mask[self.allowed] = 0.0
        logits[torch.tensor(rows)] += mask


def test_a_new_logits_processor_joins_the_list_without_changing_the_sampler():
    torch.manual_seed(4)
    logits = torch.randn(5, 30)
    processor = AllowedTokens([3, 17])
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=5.0, seed=1)
    rows = [row(greedy, prompt=[5]), row(greedy, prompt=[0]), row(hot, prompt=[0], generator=torch.Generator()),
            row(greedy, prompt=[6], output=[2]), row(hot, prompt=[0], generator=torch.Generator())]
    metadata = SamplingMetadata.build(rows, default_logits_processors() + [processor])
    assert metadata.fast_rows == [0, 3] and metadata.full_rows == [1, 2, 4]
    assert [(type(p), r) for p, r in metadata.processors] == [(AllowedTokens, [0, 1, 2])]
    for _ in range(20):
        out = sampler(logits, metadata)
        assert out.sampled_token_ids[0] == int(logits[0].argmax()) and out.sampled_token_ids[3] == int(logits[3].argmax())
        assert {out.sampled_token_ids[i] for i in (1, 2, 4)} <= {3, 17}
    assert processor.calls == [[0, 1, 2]] * 20  # positions within the full rows, only those that need it


def test_processors_see_only_their_rows():
    """Penalties and logit_bias on a few rows of a batch leave the other rows' logits exactly as they were."""
    torch.manual_seed(6)
    logits = torch.randn(4, 12)
    rows = [row(SamplingParams(repetition_penalty=1.5), prompt=[1, 2], output=[3]),
            row(SamplingParams(logprobs=1)),
            row(SamplingParams(logit_bias={4: 1.0}, frequency_penalty=0.25), output=[4, 4]),
            row(SamplingParams(top_k=3))]
    got = torch.tensor(processed(logits.tolist(), rows))
    assert torch.equal(got[[1, 3]], logits[[1, 3]])
    assert not torch.equal(got[0], logits[0]) and not torch.equal(got[2], logits[2])
    assert got[2, 4] == logits[2, 4] + 1.0 - 2 * 0.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 15), (2, 16), (5, 17), (4, 1000), (3, 49152)])
def test_argmax_rows_equals_torch_argmax(dtype, shape):
    """The argmax kernel returns torch's indices: first of tied maxima, first NaN, all -inf, strided rows."""
    from folio.sample.sampling_ops import argmax_rows

    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(*shape, generator=g).to(dtype)
    ties = (x * 2).round().clamp(-2, 2).to(dtype)
    nan = x.clone()
    nan[:, shape[1] // 2:] = float("nan")
    cases = [x, ties, nan, torch.full(shape, -math.inf, dtype=dtype), x[:, : max(1, shape[1] // 2)]]
    for case in cases:
        assert torch.equal(argmax_rows(case), case.argmax(dim=-1))


def test_empty_batch_and_shape_mismatch():
    assert sample(torch.zeros(0, 10), []).sampled_token_ids == []
    assert compute_prompt_logprobs(torch.zeros(0, 10), [], 2) == []
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(2, 10), [row(SamplingParams())])


# --- seeded reproducibility -------------------------------------------------------------------------------

VOCAB = 64


@dataclass
class FakeRequest:
    """A request driven by a fake model whose logits depend on the request and its history."""

    rid: int
    params: SamplingParams
    output: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.generator = None if self.params.seed is None else torch.Generator().manual_seed(self.params.seed)

    def logits(self) -> torch.Tensor:
        seed = self.rid * 1_000_003 + sum((i + 1) * t for i, t in enumerate(self.output))
        return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2

    def row(self) -> RequestState:
        return row(self.params, prompt=[1, 2, 3], output=self.output, generator=self.generator)


def run_steps(make_batch, steps: int = 10) -> list[FakeRequest]:
    """make_batch(step) -> requests sampling this step, in batch order; every request appends its token."""
    seen: dict[int, FakeRequest] = {}
    for step in range(steps):
        batch = make_batch(step)
        out = sample(torch.stack([r.logits() for r in batch]), [r.row() for r in batch])
        for r, token in zip(batch, out.sampled_token_ids):
            r.output.append(token)
            seen[r.rid] = r
    return list(seen.values())


def seeded_params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed)


def test_seeded_tokens_independent_of_batch():
    alone = FakeRequest(0, seeded_params(42))
    run_steps(lambda step: [alone])
    other_alone = FakeRequest(1, seeded_params(7))
    run_steps(lambda step: [other_alone])
    assert len(set(alone.output)) > 1, "the seeded request should actually be sampling"

    a, b = FakeRequest(0, seeded_params(42)), FakeRequest(1, seeded_params(7))
    companions = [FakeRequest(2, SamplingParams(temperature=1.0)),
                  FakeRequest(3, SamplingParams(temperature=0.0)),
                  FakeRequest(4, SamplingParams(temperature=0.7, top_k=5, min_p=0.1))]
    everyone = [a, b, *companions]
    run_steps(lambda step: everyone[step % 5:] + everyone[:step % 5])
    assert a.output == alone.output
    assert b.output == other_alone.output

    # a third composition: odd steps a batch of its own kind, even steps with unseeded neighbours on both sides
    a = FakeRequest(0, seeded_params(42))
    run_steps(lambda step: [a] if step % 2 else [FakeRequest(9, SamplingParams()), a, FakeRequest(8, SamplingParams())])
    assert a.output == alone.output

    different_seed = FakeRequest(0, seeded_params(43))
    run_steps(lambda step: [different_seed])
    assert different_seed.output != alone.output


# --- truncation -------------------------------------------------------------------------------------------

TRUNCATION_CASES = [
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=1e-6),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.7, min_p=0.05),
    SamplingParams(temperature=2.0, top_k=8, top_p=0.9),
]


@pytest.fixture(params=["kernel", "torch"])
def kernels(request, monkeypatch) -> str:
    """Exercise both implementations of the sampling ops: the C++ kernels and the torch reference."""
    if request.param == "torch":
        monkeypatch.setattr(sampling_ops, "_kernel_for", lambda *args: None)
    return request.param


@pytest.mark.parametrize("params", TRUNCATION_CASES, ids=repr)
@pytest.mark.parametrize("seeded", [False, True])
def test_truncation_never_emits_excluded_token(params: SamplingParams, seeded: bool, kernels: str):
    torch.manual_seed(2)
    logits = torch.randn(20) * 2
    allowed = allowed_tokens(logits, params)
    n = 3000
    rows = [row(params, generator=torch.Generator().manual_seed(i) if seeded else None) for i in range(n)]
    drawn = sample(logits.expand(n, -1), rows).sampled_token_ids
    assert set(drawn) <= allowed
    assert int(logits.argmax()) in drawn
    if params.top_p == 1e-6:
        assert allowed == {int(logits.argmax())}


@pytest.mark.parametrize("top_p,kept", [(0.25, 1), (0.5, 2), (0.75, 3), (0.76, 4)])
def test_top_p_keeps_smallest_set_reaching_top_p(top_p: float, kept: int, kernels: str):
    """Four equally likely tokens make every cumulative mass exact, so the boundary itself is tested; ties
    are ranked by token index."""
    n = 400
    drawn = sample(torch.zeros(n, 4), [row(SamplingParams(top_p=top_p)) for _ in range(n)]).sampled_token_ids
    assert set(drawn) == set(range(kept))


@pytest.mark.parametrize("vocab", [7, 5000, 49152])
def test_top_p_mask_kernel_equals_the_sorted_reference(monkeypatch, vocab):
    """Peaked and flat rows, ties across the boundary, zeros (masked tokens) and several top_p values."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=g) * torch.tensor([0.1, 1.0, 3.0, 8.0] * 3).unsqueeze(1)
    logits[1] = (logits[1] * 4).round() / 4  # many exact ties
    logits[2, ::3] = -math.inf
    probs = logits.softmax(dim=-1)
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.9, 0.95, 0.999] * 2)
    kernel = sampling_ops.top_p_mask(probs, top_p)
    monkeypatch.setattr(sampling_ops, "_kernel_for", lambda *args: None)
    reference = sampling_ops.top_p_mask(probs, top_p)
    assert torch.equal(kernel, reference)
    assert bool(kernel.gather(1, probs.argmax(dim=-1, keepdim=True)).all())


# --- the sampled distribution -----------------------------------------------------------------------------

@pytest.mark.parametrize("temperature,seeded", [(1.0, False), (0.5, False), (2.0, False), (1.5, True)])
def test_temperature_sampling_follows_softmax(temperature: float, seeded: bool):
    torch.manual_seed(3)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.5, -0.2])  # 9 tokens: 8 degrees of freedom
    n = 20_000
    params = SamplingParams(temperature=temperature)
    rows = [row(params, generator=torch.Generator().manual_seed(i) if seeded else None) for i in range(n)]
    drawn = sample(logits.expand(n, -1), rows).sampled_token_ids
    observed = torch.bincount(torch.tensor(drawn), minlength=len(logits)).double()
    expected = n * torch.softmax(logits.double() / temperature, 0)
    assert expected.min() > 20  # the chi-square approximation holds
    statistic = float(((observed - expected) ** 2 / expected).sum())
    p_value = chi2_sf_even_df(statistic, len(logits) - 1)
    assert p_value > 1e-6, f"chi2={statistic:.1f}, p={p_value:.2e}, observed={observed.tolist()}"


# --- logits processors ------------------------------------------------------------------------------------

def processed(logits: list[list[float]], rows: list[RequestState]) -> list[list[float]]:
    """The logits after the logits processors (rows that need none of them, or the fast path, stay as given)."""
    t = torch.tensor(logits)
    metadata = SamplingMetadata.build(rows, default_logits_processors())
    full = t[metadata.full_rows]
    sampler_mod.process_logits(full, metadata)
    t[metadata.full_rows] = full
    return t.tolist()


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("u, want", [(0.0, [1, 0]), (1 - 2 ** -24, [2, 1])])
def test_inverse_transform_draw_never_lands_on_zero_probability_tokens(monkeypatch, use_kernel, u, want):
    """At both ends of u's range the draw stays on tokens with probability: zeros before, between and after."""
    if not use_kernel:
        monkeypatch.setattr(sampling_ops, "_kernel_for", lambda *args: None)
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0], [0.25, 0.75, 0.0, 0.0, 0.0]])
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *a, **k: self.fill_(u))
    assert sampler_mod.draw(probs, [row(SamplingParams(temperature=1.0))] * 2).tolist() == want


def test_draw_kernel_agrees_with_the_torch_reference(monkeypatch):
    g = torch.Generator().manual_seed(5)
    probs = torch.rand(64, 3001, generator=g) ** 4
    probs[:, ::7] = 0.0
    probs /= probs.sum(dim=-1, keepdim=True)
    u = torch.rand(64, generator=g)
    kernel = sampling_ops.draw_rows(probs, u)
    monkeypatch.setattr(sampling_ops, "_kernel_for", lambda *args: None)
    assert torch.equal(kernel, sampling_ops.draw_rows(probs, u))
    assert bool((probs.gather(1, kernel.unsqueeze(1)) > 0).all())


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = [[2.0, -2.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5]]
    rows = [row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1]), row(SamplingParams(), prompt=[0])]
    assert processed(logits, rows) == [[1.0, -4.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5]]


def test_frequency_and_presence_subtract_over_output_only():
    rows = [row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[3], output=[2, 2, 2, 4]),
            row(SamplingParams(), output=[2, 2])]
    assert processed([[0.0] * 6, [0.0] * 6], rows) == [[0.0, 0.0, -1.75, 0.0, -0.75, 0.0], [0.0] * 6]


def test_logit_bias_adds_and_rejects_ids_outside_vocab():
    rows = [row(SamplingParams(logit_bias={1: 3.0, 4: -2.5})), row(SamplingParams())]
    assert processed([[1.0] * 5, [1.0] * 5], rows) == [[1.0, 4.0, 1.0, 1.0, -1.5], [1.0] * 5]
    for bad in (5, -1):
        with pytest.raises(ValueError, match="logit_bias"):
            sample(torch.zeros(1, 5), [row(SamplingParams(logit_bias={bad: 1.0}))])


def test_allowed_token_ids_forbid_every_other_token():
    logits = [[1.0, 5.0, 2.0, 0.0, 4.0], [1.0, 5.0, 2.0, 0.0, 4.0]]
    rows = [row(SamplingParams(allowed_token_ids=[0, 2])), row(SamplingParams())]
    assert processed(logits, rows) == [[1.0, -math.inf, 2.0, -math.inf, -math.inf], logits[1]]
    greedy = [row(SamplingParams(temperature=0, allowed_token_ids=[3, 0]))]
    assert sample(torch.tensor(logits[:1]), greedy).sampled_token_ids == [0]
    n = 300
    random_rows = [row(SamplingParams(allowed_token_ids=[2, 3])) for _ in range(n)]
    assert set(sample(torch.tensor(logits[:1]).expand(n, -1), random_rows).sampled_token_ids) == {2, 3}


def test_bad_words_forbid_a_word_s_last_token_after_the_rest_of_it():
    params = SamplingParams(bad_words_token_ids=[[4], [1, 2, 3]])  # a one-token word, and a three-token one
    logits = [[0.0] * 5]
    assert processed(logits, [row(params, output=[7])]) == [[0.0, 0.0, 0.0, 0.0, -math.inf]]
    assert processed(logits, [row(params, output=[7, 1, 2])]) == [[0.0, 0.0, 0.0, -math.inf, -math.inf]]
    assert processed(logits, [row(params, output=[1, 2, 7])]) == [[0.0, 0.0, 0.0, 0.0, -math.inf]]
    assert processed(logits, [row(params, output=[2])]) == [[0.0, 0.0, 0.0, 0.0, -math.inf]]  # its start not out


def test_min_tokens_holds_back_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.0, 0.0, 3.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3)
    stop = {5, 100}  # 100 lies outside the vocabulary: nothing to hold back
    for generated in range(5):
        token = sample(logits, [row(params, output=[2] * generated, stop=stop)]).sampled_token_ids[0]
        assert token == (1 if generated < 3 else 5)
    n = 500
    random_rows = [row(SamplingParams(min_tokens=1), stop={5}) for _ in range(n)]
    assert 5 not in sample(logits.expand(n, -1), random_rows).sampled_token_ids


# --- logprobs ---------------------------------------------------------------------------------------------

def test_logprobs_are_raw_sorted_ranked_and_include_sampled_token():
    torch.manual_seed(4)
    logits = torch.randn(4, 30, dtype=torch.bfloat16)
    raw = torch.log_softmax(logits.float(), dim=-1)
    low = int(raw[0].argmin())
    rows = [row(SamplingParams(temperature=0.0, logprobs=3, logit_bias={low: 100.0}, repetition_penalty=1.5),
                output=[low]),
            row(SamplingParams(temperature=0.0, logprobs=0, presence_penalty=1.0), output=[1]),
            row(SamplingParams(temperature=0.0)),
            row(SamplingParams(temperature=0.0, logprobs=2))]
    out = sample(logits, rows)
    assert out.sampled_token_ids[0] == low
    assert out.logprobs[2] is None

    first = out.logprobs[0]
    top3 = raw[0].topk(3)
    assert first.token_ids == top3.indices.tolist() + [low]
    assert first.logprobs == pytest.approx(top3.values.tolist() + [float(raw[0, low])], abs=1e-6)
    assert first.logprobs[:3] == sorted(first.logprobs[:3], reverse=True)
    assert first.ranks == [1, 2, 3, 30]

    token = out.sampled_token_ids[1]
    second = out.logprobs[1]
    assert second.token_ids == [token]
    assert second.logprobs == pytest.approx([float(raw[1, token])], abs=1e-6)
    assert second.ranks == [int((raw[1] > raw[1, token]).sum()) + 1]

    fourth = out.logprobs[3]
    assert out.sampled_token_ids[3] == int(raw[3].argmax())
    assert fourth.token_ids == raw[3].topk(2).indices.tolist() and fourth.ranks == [1, 2]


def test_prompt_logprobs_match_log_softmax_gather():
    torch.manual_seed(5)
    logits = torch.randn(6, 40)
    targets = [3, 0, 39, 17, 17, 8]
    out = compute_prompt_logprobs(logits, targets, num_logprobs=2)
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i, (entry, target) in enumerate(zip(out, targets)):
        assert entry.token_ids[:2] == raw[i].topk(2).indices.tolist()
        assert target in entry.token_ids
        position = entry.token_ids.index(target)
        assert entry.logprobs[position] == pytest.approx(float(raw[i, target]), abs=1e-5)
        assert entry.ranks[position] == int((raw[i] > raw[i, target]).sum()) + 1
        assert len(entry.token_ids) == (2 if target in entry.token_ids[:2] else 3)


# --- property ---------------------------------------------------------------------------------------------

@st.composite
def sampling_cases(draw):
    vocab = draw(st.integers(2, 12))
    finite = st.floats(-20, 20, width=32)
    values = draw(st.lists(st.one_of(finite, st.just(-math.inf)), min_size=vocab, max_size=vocab)
                  .filter(lambda v: any(math.isfinite(x) for x in v)))
    greedy = draw(st.booleans())
    params = SamplingParams(temperature=0.0 if greedy else draw(st.floats(0.05, 5.0)),
                            top_k=draw(st.integers(0, vocab + 2)),
                            top_p=draw(st.floats(1e-6, 1.0)),
                            min_p=draw(st.floats(0.0, 1.0)),
                            seed=draw(st.one_of(st.none(), st.integers(0, 2**31))))
    return torch.tensor(values), params, draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(sampling_cases())
def test_sampled_token_is_always_allowed_and_finite(case):
    logits, params, use_kernels = case
    n = 32
    rows = [row(params, generator=None if params.seed is None else torch.Generator().manual_seed(params.seed + i))
            for i in range(n)]
    allowed = allowed_tokens(logits, params, tol=1e-3)
    with mock.patch.object(sampling_ops, "_kernel_for", sampling_ops._kernel_for if use_kernels else lambda *a: None):
        drawn = sample(logits.expand(n, -1), rows).sampled_token_ids
    for token in drawn:
        assert token in allowed and math.isfinite(logits[token])
