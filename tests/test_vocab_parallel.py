"""Vocabulary-parallel embedding and lm_head (folio.models.vocab_parallel): each rank holds its slice of the
vocabulary's rows, and two ranks give one rank's greedy tokens (the head's argmax and the gathered logits), logprobs
and prompt logprobs: tied and untied, a vocabulary the ranks do not divide, an int8 head, Gemma 2's soft-capped
logits and a GGUF file whose tied table is stored as Q8_0 (the rescored int4 head: its greedy tokens)."""

from __future__ import annotations

import math
import multiprocessing

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from conftest import build_tiny_model
from folio import LLM, SamplingParams
from folio.distributed import parallel_state
from folio.distributed.parallel_state import TensorParallelGroup
from folio.distributed.placement import free_port
from folio.models.dense_linear import DenseLinearMethod
from folio.models.int8_linear import Int8LinearMethod
from folio.models.linear import LinearMethod, process_weights_after_loading
from folio.models.rescored_head import RescoredInt4Head
from folio.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, VocabSlice, best_of_ranks
from folio.models.weight_loader import weight_loader_of
from folio.sample.sampling_ops import argmax_rows
from test_gemma import build_gemma
from test_gguf_loader import write_tiny_gguf
from test_tensor_parallel import ENGINE, _assert_same

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 61)), [100, 3, 250, 77, 1, 90, 91, 92, 93, 94, 95, 17, 280, 281]]  # < 284
FAST_GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)  # the head's argmax
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)  # the gathered logits
PROMPT_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)


def _outputs(model: str, ranks: int, **kwargs) -> tuple[list, list, list]:
    """(fast greedy, greedy with logprobs, prompt logprobs of the prompt tokens) of one engine of `ranks` ranks."""
    llm = LLM(model, tensor_parallel_size=ranks, **{**ENGINE, **kwargs})
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    try:
        fast, greedy = ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
                        for params in (FAST_GREEDY, GREEDY))
        prompt = [[entry[token].logprob for token, entry in zip(p, o.prompt_logprobs) if entry is not None]
                  for p, o in zip(PROMPTS, llm.generate(prompts, PROMPT_LOGPROBS))]
        return fast, greedy, prompt
    finally:
        llm.llm_engine.shutdown()


def _assert_two_ranks_give_one_ranks(model: str, **kwargs) -> None:
    one, two = _outputs(model, 1, **kwargs), _outputs(model, 2, **kwargs)
    _assert_same(one[0], two[0])
    _assert_same(one[1], two[1])
    assert [tokens for tokens, _ in one[0]] == [tokens for tokens, _ in one[1]]  # the argmax is the logits'
    for prompt1, prompt2 in zip(one[2], two[2]):
        assert len(prompt1) == len(prompt2) and all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)
                                                    for a, b in zip(prompt1, prompt2))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_two_ranks_give_one_ranks_tokens_over_a_vocabulary_they_do_not_divide(tmp_path, tie):
    """511 tokens: rank 0 holds 256, rank 1 255 and a pad row, cut off the gathered logits."""
    _assert_two_ranks_give_one_ranks(build_tiny_model(str(tmp_path), "llama", tie=tie, vocab_size=511))


def test_soft_capped_logits_over_two_ranks(tmp_path):
    """Gemma 2 caps the gathered logits, its greedy tokens too."""
    _assert_two_ranks_give_one_ranks(build_gemma(str(tmp_path), "gemma2"))


def _quantised_head_model(folder: str, tie: bool, scheme: str) -> tuple[str, type]:
    """A model whose row-parallel layers stay dense under the quantisation schemes (their inputs, 2 x 24 and 2 x 40,
    are not multiples of the kernels' block): its column-parallel layers and head quantise each row whole on either
    rank count. With the class of its head's method on one rank."""
    folder = build_tiny_model(folder, "llama", tie=tie, head_dim=12, intermediate_size=80)
    llm = LLM(folder, **ENGINE, quantization=scheme)
    model = llm.llm_engine.runner.model
    assert isinstance(model.layers[0].mlp.down_proj.method, DenseLinearMethod)
    head = type(model.lm_head.method)
    llm.llm_engine.shutdown()
    return folder, head


def test_an_int8_head_over_two_ranks(tmp_path):
    """Two ranks give one rank's int8 logits."""
    folder, head = _quantised_head_model(str(tmp_path), False, "int8")
    assert head is Int8LinearMethod
    _assert_two_ranks_give_one_ranks(folder, quantization="int8")


def test_a_rescored_int4_head_over_two_ranks(tmp_path):
    """Each rank recomputes its own TOP_K largest logits from its slice of the table, the whole vocabulary's TOP_K
    among them: one rank's greedy tokens, and the sampled tokens' logprobs near one rank's (of 512 tokens, 128 logits
    are exact on one rank and 256 on two, which moves the softmax's denominator a little)."""
    folder, head = _quantised_head_model(str(tmp_path), True, "int4")
    if head is not RescoredInt4Head:
        pytest.skip("the int4 schemes keep an int8 head here (no int4 block kernel for float32)")
    one, two = _outputs(folder, 1, quantization="int4"), _outputs(folder, 2, quantization="int4")
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(one[1], two[1]):
        assert tokens2 == tokens1
        for step1, step2, token in zip(logprobs1, logprobs2, tokens1):
            assert math.isclose(step1[token].logprob, step2[token].logprob, abs_tol=1e-2)
    assert [tokens for tokens, _ in two[0]] == [tokens for tokens, _ in one[1]]


@pytest.mark.usefixtures("isolated_gguf_cache")
def test_a_gguf_file_over_two_ranks(tmp_path):
    """A tied Qwen2 whose every matrix, the embedding's table included, is stored as Q8_0, dequantised ("none":
    GGUF layers as stored are not split), each rank taking its rows of the table."""
    path = write_tiny_gguf(str(tmp_path / "qwen2.gguf"), "qwen2", tensor_type=Q.Q8_0)
    _assert_two_ranks_give_one_ranks(path, quantization="none")


def _rank_model(monkeypatch, rank: int, ranks: int, table: torch.Tensor, head: torch.Tensor | None,
                method: LinearMethod) -> nn.Module:
    """Rank `rank`'s embedding and lm_head (tied where head is None), loaded and processed."""
    monkeypatch.setattr(parallel_state, "_group", TensorParallelGroup(rank, ranks))
    model = nn.Module()
    model.embed_tokens = VocabParallelEmbedding(*table.shape)
    model.lm_head = ParallelLMHead(table.shape[1], table.shape[0],
                                   tied_to=model.embed_tokens.weight if head is None else None)
    model.lm_head.bind(method)
    weight_loader_of(model.embed_tokens.weight)(model.embed_tokens.weight, table, None)
    if head is not None:
        weight_loader_of(model.lm_head.weight)(model.lm_head.weight, head, None)
    process_weights_after_loading(model)
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("method", [DenseLinearMethod, lambda: Int8LinearMethod(int8_activations=True, rotated=True)],
                         ids=["dense", "int8"])
def test_each_rank_holds_its_slice(monkeypatch, tied, method):
    """Without processes: of 11 tokens over 2 ranks each holds 6 rows (rank 1 a pad row). The ranks' lookups (each
    summed over one rank) add up to the table's rows, and their slices of the logits make the whole head's (int8
    too: its scales are per row). One rank holds everything and calls Embedding's and Linear's own forward."""
    torch.manual_seed(0)
    table, head, x = torch.randn(11, 64), torch.randn(11, 64), torch.randn(3, 64)
    ids = torch.tensor([[0, 5, 6, 10], [3, 3, 9, 1]])
    whole = _rank_model(monkeypatch, 0, 1, table, None if tied else head, method())
    assert whole.lm_head.part is None and whole.embed_tokens.part is None
    assert "forward" not in vars(whole.lm_head) and "forward" not in vars(whole.embed_tokens)
    lookups, logits = [], []
    for rank in range(2):
        part = _rank_model(monkeypatch, rank, 2, table, None if tied else head, method())
        assert part.lm_head.part == VocabSlice(11, 6, 6 * rank, 6 - rank) and part.lm_head.output_size == 6
        part.embed_tokens.tp = TensorParallelGroup(0, 1)  # its all-reduce: its own rows
        lookups.append(part.embed_tokens(ids))
        logits.append(part.lm_head.method.apply(part.lm_head, x))
    assert torch.equal(lookups[0] + lookups[1], table[ids])
    assert torch.equal(torch.cat(logits, dim=1)[:, :11], whole.lm_head(x))


def test_parameter_sizes_halve(monkeypatch):
    """Each of two ranks holds half of the table's and the untied head's bytes (as loaded: the dense method then packs
    its copy)."""
    monkeypatch.setattr(parallel_state, "_group", TensorParallelGroup(1, 2))
    embedding, head = VocabParallelEmbedding(1000, 64), ParallelLMHead(64, 1000)
    head.bind(DenseLinearMethod())
    assert embedding.weight.shape == head.weight.shape == (500, 64)
    with pytest.raises(ValueError, match="has 999 rows, expected the vocabulary's 1000"):
        weight_loader_of(head.weight)(head.weight, torch.randn(999, 64), None)


def test_best_of_ranks_is_the_whole_rows_argmax():
    """Ties to the lower token, a NaN above infinity, the first NaN, rows all minus infinity: each rank's
    (largest logit, token) pairs pick what torch.argmax picks over the whole row, pad cut off."""
    inf, nan = float("inf"), float("nan")
    rows = torch.randn(40, 11)
    rows[0, [2, 9]] = 5.0
    rows[1, [3, 8]] = nan
    rows[1, 0] = inf
    rows[2] = -inf
    rows[3, [1, 7]] = inf
    rows[4, 9] = nan
    rows[5, [1, 2, 6, 7]] = 4.0
    pieces = [rows[:, first:first + 4] for first in range(0, 11, 4)]  # 3 ranks of 4 rows, the last holding 3
    tokens = [argmax_rows(piece) for piece in pieces]
    values = torch.stack([piece.gather(1, t.unsqueeze(1)).squeeze(1).double() for piece, t in zip(pieces, tokens)])
    starts = torch.tensor([0, 4, 8]).unsqueeze(1)
    assert torch.equal(best_of_ranks(values, torch.stack(tokens) + starts), rows.argmax(dim=-1))


def test_a_vocabulary_that_leaves_a_rank_none_is_refused():
    with pytest.raises(ValueError, match="a vocabulary of 5 tokens leaves the last rank none"):
        VocabSlice.of(5, TensorParallelGroup(0, 4))


def _gather_both_ways(rank: int, size: int, port: int, failures) -> None:
    import torch.distributed as dist

    from folio.distributed.parallel_state import init_tensor_parallel, tensor_parallel_group

    torch.set_num_threads(1)
    init_tensor_parallel(rank, size, f"tcp://127.0.0.1:{port}", "gloo")
    group = tensor_parallel_group()
    assert group.shared_memory is not None
    generator = torch.Generator().manual_seed(rank)
    shapes = [(1, 6), (16, 300), (2, 3), (4, 1000)] * 10 + [(group.shared_memory.slot_bytes // 4 + 1, 1)]  # gloo's
    for i, shape in enumerate(shapes):
        dtype = (torch.bfloat16, torch.float32, torch.float64)[i % 3]
        x = torch.randn(shape, generator=generator).to(dtype)
        everyone = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(everyone, x)
        dim = i % 2 - 1  # -1, 0
        if not torch.equal(group.all_gather(x, dim), torch.cat(everyone, dim=dim)):
            failures.put(f"rank {rank}: not the gathered tensor at {i}")
        group.all_reduce(x.clone())  # the shared buffers serve both collectives in turn


def test_all_gather_through_shared_memory_and_gloo():
    """Three ranks: every rank gets every rank's tensor in rank order, all-gathers and all-reduces alternating; a
    tensor larger than a slot goes through gloo."""
    context = multiprocessing.get_context("spawn")
    failures = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_gather_both_ways, args=(rank, 3, port, failures)) for rank in range(3)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [process.exitcode for process in ranks] == [0, 0, 0]
    assert failures.empty(), failures.get()
