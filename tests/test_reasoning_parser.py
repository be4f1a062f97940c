"""Reasoning parsers (folio.reasoning_parser): the split of a choice's text into reasoning and content, streamed
in any pieces; the count of reasoning tokens; the prompt deciding where the output starts; and the engine's
structured outputs starting their grammar after the closing tag (with drafts too)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from folio.core.step_contract import ScheduledRequestData, SchedulerOutput
from folio.reasoning_parser import REASONING_PARSERS, EndTagWatcher, ReasoningParser, ReasoningSplitter
from reasoning_fixture import build_reasoning_model, end_tag_id

PARSER = REASONING_PARSERS["qwen3"]
ENGINE = dict(dtype="float32", kv_cache_memory=1 << 22, num_threads=1)
OPEN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
CLOSED_PROMPT = OPEN_PROMPT + "<think>\n\n</think>\n\n"


def split_whole(text: str, in_reasoning: bool = True) -> tuple[str, str]:
    """The split, written independently of the streaming splitter: what the whole output gives."""
    if not in_reasoning:
        return "", text.lstrip()
    body = text.lstrip()
    while body.startswith("<think>"):
        body = body[len("<think>"):].lstrip()
    reasoning, tag, content = body.partition("</think>")
    return reasoning.rstrip(), content.lstrip() if tag else ""


def split_streamed(pieces: list[str], in_reasoning: bool = True,
                   parser: ReasoningParser = PARSER) -> tuple[str, str]:
    """The reasoning and content that the pieces, fed in turn, give."""
    splitter = ReasoningSplitter(parser, in_reasoning)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        out = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + out.reasoning, content + out.content
    return reasoning, content


@pytest.mark.parametrize("text, in_reasoning, expected", [
    ("<think>\nLet me see.\n</think>\n\nIt is 4.", True, ("Let me see.", "It is 4.")),  # the model opens it
    ("Let me see.\n</think>\n\nIt is 4.", True, ("Let me see.", "It is 4.")),  # the prompt opened it (R1)
    ("Still thinking when cut", True, ("Still thinking when cut", "")),  # no closing tag: all reasoning
    ("<think>\n\n</think>\n\nHello", True, ("", "Hello")),  # an empty block
    ("It is 4. </think> and <think>", False, ("", "It is 4. </think> and <think>")),  # the prompt closed it
    ("a</think>b</think>c", True, ("a", "b</think>c")),  # only the first closing tag ends it
])
def test_splits(text, in_reasoning, expected):
    assert split_streamed([text], in_reasoning) == expected == split_whole(text, in_reasoning)


TAG_BITS = st.sampled_from(["<think>", "</think>", "<", "</", "</thi", "nk>", ">", "think", " ", "\n", "a", "b c"])


@settings(max_examples=300, deadline=None)
@given(st.lists(TAG_BITS, max_size=14), st.lists(st.integers(0, 80), max_size=5), st.booleans())
def test_any_pieces_join_to_the_whole_split(bits, cuts, in_reasoning):
    """Whatever the pieces (a tag split anywhere, whitespace held back at a piece's end), a streamed choice gives
    the reasoning and content of the whole text."""
    text = "".join(bits)
    cuts = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    assert split_streamed(pieces, in_reasoning) == split_whole(text, in_reasoning)


def test_a_streamed_piece_holds_back_only_a_possible_tag():
    splitter = ReasoningSplitter(PARSER, True)
    assert splitter.feed("<think>\nFirst,").reasoning == "First,"
    out = splitter.feed(" then \n</thi")
    assert (out.reasoning, out.content) == (" then", "")  # whitespace before a possible tag waits
    out = splitter.feed("nk>\n\nDone")
    assert (out.reasoning, out.content) == ("", "Done")
    assert splitter.feed(" </think>", final=True).content == " </think>"


def test_reasoning_tokens_are_counted_up_to_the_closing_tag():
    splitter = ReasoningSplitter(PARSER, True, (7, 8))  # a tag of two tokens
    assert splitter.feed("a", [1, 2]).num_reasoning_tokens == 2
    assert splitter.feed("b", [7]).num_reasoning_tokens == 1
    assert splitter.feed("c", [8, 3, 7, 8]).num_reasoning_tokens == 1  # the tag's last token, then the answer
    assert splitter.feed("d", [4]).num_reasoning_tokens == 0
    assert ReasoningSplitter(PARSER, False, (7,)).feed("x", [7, 7]).num_reasoning_tokens == 0


def test_end_tag_watcher_finds_without_moving():
    watcher = EndTagWatcher((5, 6, 7))
    assert watcher.feed([1, 5]) is None and watcher.find([6, 7, 9]) == 2 and not watcher.done
    assert watcher.feed([6]) is None and watcher.feed([1, 5, 6, 7, 2]) == 4 and watcher.done
    assert watcher.feed([5, 6, 7]) is None  # only the first tag ends the reasoning


@pytest.fixture(scope="module")
def reasoning_dir(tmp_path_factory) -> str:
    return build_reasoning_model(str(tmp_path_factory.mktemp("reasoning")))


@pytest.fixture(scope="module")
def llm(reasoning_dir):
    return LLM(reasoning_dir, reasoning_parser="qwen3", **ENGINE)


def test_the_prompt_decides_where_the_output_starts(llm):
    tokenizer = llm.get_tokenizer()
    assert PARSER.starts_in_reasoning(tokenizer, tokenizer.encode(OPEN_PROMPT, add_special_tokens=False))
    assert PARSER.starts_in_reasoning(tokenizer, tokenizer.encode(OPEN_PROMPT + "<think>\n",
                                                                  add_special_tokens=False))
    assert not PARSER.starts_in_reasoning(tokenizer, tokenizer.encode(CLOSED_PROMPT, add_special_tokens=False))
    # an assistant prefill after the block (continue_final_message) continues the answer
    assert not PARSER.starts_in_reasoning(tokenizer, tokenizer.encode(CLOSED_PROMPT + "The answer",
                                                                      add_special_tokens=False))
    # an earlier turn's block is not this one's: the turn's start comes after it
    earlier = "<|im_start|>assistant\n<think>\nx\n</think>\n\nok<|im_end|>\n"
    assert PARSER.starts_in_reasoning(tokenizer, tokenizer.encode(earlier + OPEN_PROMPT, add_special_tokens=False))


def _choice(seed: int, bias: dict[int, float]) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=60, logit_bias=bias,
                          structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))


def test_the_grammar_starts_after_the_reasoning(llm, reasoning_dir):
    """The random model thinks freely until it writes the closing tag (made likely by a bias), then answers
    under the grammar; where the prompt closed the reasoning, the grammar holds from the first token."""
    end = end_tag_id(reasoning_dir)
    outputs = llm.generate([OPEN_PROMPT] * 8, [_choice(seed, {end: 4.0}) for seed in range(8)], use_tqdm=False)
    thoughts = []
    for output in outputs:
        completion = output.outputs[0]
        if end in completion.token_ids:
            thought, _, answer = completion.text.partition("</think>")
            assert answer in ("yes", "no") and completion.finish_reason == "stop"
            thoughts.append(thought)
        else:  # EOS or the length came first: nothing was constrained
            assert completion.finish_reason in ("stop", "length")
    assert len(thoughts) >= 3 and any(thoughts)  # the reasoning was free: the grammar allows only "yes" or "no"
    closed = llm.generate([CLOSED_PROMPT] * 3, [_choice(seed, {}) for seed in range(3)], use_tqdm=False)
    assert all(o.outputs[0].text in ("yes", "no") for o in closed)


def _rows(mask, request_id: str, count: int, vocab: int) -> list[set[int]]:
    return [{t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1}
            for row in mask.rows_of(request_id, count)]


def test_drafts_past_the_closing_tag_are_constrained(reasoning_dir):
    """A step's drafts may end the reasoning: positions up to the closing tag stay free, the ones after it get
    the grammar's rows, as a request that started after the reasoning gets them."""
    engine = LLMEngine.from_kwargs(reasoning_dir, reasoning_parser="qwen3", **ENGINE)
    tokenizer, end = engine.get_tokenizer(), end_tag_id(reasoning_dir)
    vocab = engine.model_config.vocab_size
    y = tokenizer.encode("y", add_special_tokens=False)[0]
    engine.add_request("thinking", {"prompt_token_ids": tokenizer.encode(OPEN_PROMPT, add_special_tokens=False)},
                       _choice(0, {}))
    engine.add_request("answering", {"prompt_token_ids": tokenizer.encode(CLOSED_PROMPT, add_special_tokens=False)},
                       _choice(0, {}))
    requests = engine.scheduler.requests
    while not all(r.structured_output.ready for r in requests.values()):
        time.sleep(0.001)
    step = SchedulerOutput(scheduled=[
        ScheduledRequestData("thinking", 0, requests["thinking"].num_tokens, draft_token_ids=[y, end, y]),
        ScheduledRequestData("answering", 0, requests["answering"].num_tokens, draft_token_ids=[y])])
    mask = engine.structured_output.grammar_bitmask(step, requests)
    thinking, answering = _rows(mask, "thinking", 4, vocab), _rows(mask, "answering", 2, vocab)
    everything = set(range(vocab))
    assert thinking[:2] == [everything, everything] and thinking[2:] == answering
    assert len(answering[0]) < 10 and y in answering[0]
    assert engine.structured_output.grammar_bitmask(
        SchedulerOutput(scheduled=[ScheduledRequestData("thinking", 0, requests["thinking"].num_tokens,
                                                        draft_token_ids=[y, y])]), requests) is None
    np.testing.assert_array_equal(mask.bitmask[mask.rows["thinking"]], -1)


def test_a_tokenizer_that_hides_the_tag_is_refused(tmp_path):
    """A tokenizer whose closing tag is a special token decodes without it: the parser could never see the answer
    begin, so the engine refuses to start with it."""
    import json
    import os

    from tokenizers import AddedToken, Tokenizer

    folder = build_reasoning_model(str(tmp_path))
    path = os.path.join(folder, "tokenizer.json")
    with open(path) as f:
        data = json.load(f)
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in ("<think>", "</think>")]
    tokenizer = Tokenizer.from_str(json.dumps(data))
    tokenizer.add_special_tokens([AddedToken("<think>"), AddedToken("</think>")])
    tokenizer.save(path)
    with pytest.raises(ValueError, match="special token"):
        LLM(folder, reasoning_parser="deepseek_r1", **ENGINE)
    LLM(folder, **ENGINE)  # without a reasoning parser the model runs as before
