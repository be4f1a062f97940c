"""Magistral's reasoning (`reasoning_parser="mistral"`): the model opens `[THINK]` itself, so an output starts as
content and a `[THINK]` at its start opens the reasoning up to `[/THINK]`. The split of any pieces of a text; the
reasoning tokens; the prompt deciding where the output starts (an assistant prefill inside the block starts in
it); and the engine's structured outputs on the Magistral-style tiny model: the first token's mask is the
grammar's and `[THINK]`, the grammar waits for `[/THINK]` where the model opened the block, and drafts follow the
same rows (speculative decoding gives what plain decoding gives)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from folio.config import REASONING_PARSER_NAMES
from folio.core.step_contract import ScheduledRequestData, SchedulerOutput
from folio.reasoning_parser import REASONING_PARSERS, ReasoningSplitter
import test_reasoning_parser
from reasoning_fixture import build_magistral_model, build_reasoning_model, token_id

PARSER = REASONING_PARSERS["mistral"]
ENGINE = dict(dtype="float32", kv_cache_memory=1 << 22, num_threads=1)
PROMPT = "<|im_start|>Think in [THINK] and [/THINK].<|im_end|>[INST]hi[/INST]"  # tags of an earlier turn


def split_whole(text: str, in_reasoning: bool = False) -> tuple[str, str]:
    """The split, written independently of the streaming splitter: what the whole output gives."""
    body = text.lstrip()
    if not in_reasoning:
        if not body.startswith("[THINK]"):
            return "", body
        body = body[len("[THINK]"):].lstrip()
    while body.startswith("[THINK]"):
        body = body[len("[THINK]"):].lstrip()
    reasoning, tag, content = body.partition("[/THINK]")
    return reasoning.rstrip(), content.lstrip() if tag else ""


def split_streamed(pieces: list[str], in_reasoning: bool = False) -> tuple[str, str]:
    return test_reasoning_parser.split_streamed(pieces, in_reasoning, PARSER)


@pytest.mark.parametrize("text, in_reasoning, expected", [
    ("[THINK]Let me see.[/THINK]It is 4.", False, ("Let me see.", "It is 4.")),
    ("\n [THINK]\nLet me see.\n[/THINK]\n\nIt is 4.", False, ("Let me see.", "It is 4.")),  # whitespace around
    ("It is 4.", False, ("", "It is 4.")),  # no [THINK]: all content
    ("It is [THINK]4[/THINK].", False, ("", "It is [THINK]4[/THINK].")),  # a tag after the start is content
    ("[THINK]Still thinking when cut", False, ("Still thinking when cut", "")),  # cut off inside: reasoning
    ("[THINK][/THINK]Hello", False, ("", "Hello")),  # an empty block
    ("[THINK]a[/THINK][THINK]b[/THINK]c", False, ("a", "[THINK]b[/THINK]c")),  # only the first block
    ("[TH", False, ("", "[TH")),  # a cut-off tag is text
    ("so it is 4.[/THINK]Four.", True, ("so it is 4.", "Four.")),  # a prefill opened it
])
def test_splits(text, in_reasoning, expected):
    assert split_streamed([text], in_reasoning) == expected == split_whole(text, in_reasoning)


TAG_BITS = st.sampled_from(["[THINK]", "[/THINK]", "[", "[/", "[TH", "INK]", "]", "THINK", " ", "\n", "a", "b c"])


@settings(max_examples=400, deadline=None)
@given(st.lists(TAG_BITS, max_size=14), st.lists(st.integers(0, 80), max_size=5), st.booleans())
def test_any_pieces_join_to_the_whole_split(bits, cuts, in_reasoning):
    text = "".join(bits)
    cuts = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    assert split_streamed(pieces, in_reasoning) == split_whole(text, in_reasoning)


def test_a_streamed_piece_holds_back_only_a_possible_opening_tag():
    splitter = ReasoningSplitter(PARSER, False)
    assert splitter.feed(" [TH") == splitter.feed("")  # nothing yet: it may be the tag
    assert splitter.feed("E").content == "[THE"
    assert splitter.feed(" [THINK]").content == " [THINK]"


def test_reasoning_tokens_are_counted_from_the_opening_tag():
    think, end = 10, 11
    splitter = ReasoningSplitter(PARSER, False, (end,))
    assert splitter.feed("[THINK]a", [think, 1]).num_reasoning_tokens == 2
    assert splitter.feed("b[/THINK]c", [2, end, 3]).num_reasoning_tokens == 2
    assert splitter.feed("d", [4]).num_reasoning_tokens == 0
    plain = ReasoningSplitter(PARSER, False, (end,))
    assert plain.feed("a[THINK]", [1, think]).num_reasoning_tokens == 0
    assert plain.feed("[/THINK]", [end]).num_reasoning_tokens == 0


@pytest.fixture(scope="module")
def magistral_dir(tmp_path_factory) -> str:
    return build_magistral_model(str(tmp_path_factory.mktemp("magistral")))


@pytest.fixture(scope="module")
def llm(magistral_dir):
    return LLM(magistral_dir, reasoning_parser="mistral", **ENGINE)


def test_the_prompt_decides_where_the_output_starts(llm):
    tokenizer = llm.get_tokenizer()

    def starts_in_reasoning(prompt: str) -> bool:
        return PARSER.starts_in_reasoning(tokenizer, tokenizer.encode(prompt, add_special_tokens=False))

    assert not starts_in_reasoning(PROMPT)  # the model opens the block, if it thinks
    assert starts_in_reasoning(PROMPT + "[THINK]Let me")  # a prefill inside the block
    assert not starts_in_reasoning(PROMPT + "[THINK]Done.[/THINK]The answer")  # a prefill after it
    assert not starts_in_reasoning("")
    assert REASONING_PARSERS["qwen3"].starts_in_reasoning(tokenizer, [])  # (the families whose prompt opens it)


def test_every_name_the_option_takes_has_a_parser():
    assert sorted(REASONING_PARSERS) == sorted(REASONING_PARSER_NAMES)


def test_a_tokenizer_without_the_tags_is_refused(tmp_path):
    folder = build_reasoning_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"needs '\[THINK\]' as one token"):
        LLM(folder, reasoning_parser="mistral", **ENGINE)


def _choice(seed: int, bias: dict[int, float], temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=40, logit_bias=bias,
                          structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))


def test_the_grammar_holds_from_the_first_token_unless_the_model_opens_the_block(llm, magistral_dir):
    """A bias makes the model open the block (and close it soon): the reasoning is free, the answer after it the
    grammar's; a bias against [THINK] leaves the grammar's answer from the first token."""
    tokenizer = llm.get_tokenizer()
    think, end = token_id(magistral_dir, "[THINK]"), token_id(magistral_dir, "[/THINK]")
    opened = llm.generate([PROMPT] * 6, [_choice(seed, {think: 4.0, end: 5.0}) for seed in range(6)], use_tqdm=False)
    answers = [tokenizer.decode(ids[ids.index(end) + 1:]) for ids in (o.outputs[0].token_ids for o in opened)
               if ids[0] == think and end in ids]
    assert len(answers) >= 3 and set(answers) <= {"yes", "no"}
    plain = llm.generate([PROMPT] * 4, [_choice(seed, {think: -30.0}) for seed in range(4)], use_tqdm=False)
    assert all(o.outputs[0].text in ("yes", "no") for o in plain)


def _rows(mask, request_id: str, count: int, vocab: int) -> list[set[int]]:
    return [{t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1}
            for row in mask.rows_of(request_id, count)]


def test_drafts_follow_the_rows_of_the_tokens_they_guess(magistral_dir):
    """Rows of one step for drafts that open the block (and close it), that do not, and after the first token."""
    engine = LLMEngine.from_kwargs(magistral_dir, reasoning_parser="mistral", **ENGINE)
    tokenizer, vocab = engine.get_tokenizer(), engine.model_config.vocab_size
    think, end = token_id(magistral_dir, "[THINK]"), token_id(magistral_dir, "[/THINK]")
    y = tokenizer.encode("y", add_special_tokens=False)[0]
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    for request_id in ("a", "b"):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, _choice(0, {}))
    requests = engine.scheduler.requests
    while not all(r.structured_output.ready for r in requests.values()):
        time.sleep(0.001)

    def rows(request_id: str, drafts: list[int]) -> list[set[int]]:
        step = SchedulerOutput(scheduled=[ScheduledRequestData(request_id, 0, requests[request_id].num_tokens,
                                                               draft_token_ids=drafts)])
        mask = engine.structured_output.grammar_bitmask(step, requests)
        return None if mask is None else _rows(mask, request_id, 1 + len(drafts), vocab)

    everything = set(range(vocab))
    opening = rows("a", [think, y, end, y])  # opened and closed within the drafts
    start, after_y = opening[3], opening[4]  # the grammar's rows at its start and after "y"
    assert opening == [start | {think}, everything, everything, start, after_y]
    assert y in start and len(start) < 10 and think not in start | after_y
    assert rows("a", []) == [start | {think}]  # the first token may open the block
    assert rows("a", [y]) == [start | {think}, after_y]
    assert rows("a", [think, y]) == [start | {think}, everything, everything]
    requests["a"].structured_output.advance(think)  # the model opened it: free up to the closing tag
    assert rows("a", [y, y]) is None
    assert rows("a", [end, y]) == [everything, start, after_y]
    requests["a"].structured_output.advance(end)
    assert rows("a", [y]) == [start, after_y]
    requests["b"].structured_output.advance(y)  # the grammar's first token: [THINK] is no longer allowed
    assert rows("b", []) == [after_y]


def test_speculation_gives_what_plain_decoding_gives(magistral_dir, steps_cost_the_prior):
    """Greedy outputs with n-gram drafts equal those without speculation. The prompts repeat an earlier turn, so
    the drafts guess the block opened and closed within one step, or an answer at the first token."""
    think, end = token_id(magistral_dir, "[THINK]"), token_id(magistral_dir, "[/THINK]")
    thought, answered = ("[INST]hi[/INST][THINK][/THINK]yes<|im_end|>[INST]hi[/INST]",
                         "[INST]hi[/INST]no<|im_end|>[INST]hi[/INST]")
    prompts = [thought, answered, answered]
    params = [_choice(0, bias, 0.0) for bias in ({think: 8.0, end: 12.0}, {think: -30.0}, {think: 8.0, end: 12.0})]
    expected = LLM(magistral_dir, reasoning_parser="mistral", **ENGINE).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids[:2] == [think, end] for o in expected] == [True, False, True]
    llm = LLM(magistral_dir, reasoning_parser="mistral", speculative_config={"method": "ngram",
                                                                              "num_speculative_tokens": 4}, **ENGINE)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert llm.llm_engine.get_stats().spec_decoding.num_accepted_tokens > 0
