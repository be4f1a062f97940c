"""IncrementalDetokenizer: streamed text equals a full decode, and stop strings never leak into a stream."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_fixture import sentencepiece_like_json, smollm2_tokenizer_dir

from folio.detokenizer import IncrementalDetokenizer
from folio.sampling_params import SamplingParams
from folio.tokenizer import Tokenizer

TEXTS = [
    "Streaming 日本語 text with emoji 🎉👩‍👩‍👧 … café naïve.",
    "中文文本，한국어 텍스트, Ωμέγα, Привет!",
    "def f(x):\n    return x ** 2  # ✓\n",
    "🇫🇷🇯🇵🏳️‍🌈",
]
_SETTINGS = settings(max_examples=150, deadline=None)


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(smollm2_tokenizer_dir())


@pytest.fixture(scope="session")
def sp_tok() -> Tokenizer:
    return Tokenizer.from_parts(sentencepiece_like_json(), {"bos_token": "<s>", "eos_token": "</s>"})


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, chunk: int = 1,
           stop_terminated: bool = False, **params) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ids chunk by chunk as an engine would; check that the deltas join to the final text, so that nothing
    handed out (a partial stop string, a '\ufffd' a later token completes) was ever taken back."""
    detok = IncrementalDetokenizer(tok, prompt or [], SamplingParams(**params))
    deltas: list[str] = []
    stop = None
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        stop = detok.update(ids[i:i + chunk], stop_terminated=stop_terminated and last)
        deltas.append(detok.get_delta(finished=stop is not None or last))
        if stop is not None:
            break
    assert "".join(deltas) == detok.output_text
    return detok, deltas, stop


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_round_trip(tok, text, chunk):
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode_token(i) for i in ids)  # some character's bytes are split over tokens
    detok, deltas, stop = stream(tok, ids, chunk=chunk)
    assert stop is None and detok.output_text == text == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert detok.token_ids == ids


def test_prompt_context_keeps_leading_space(sp_tok):
    """A SentencePiece decoder drops the space of a sequence's first token; after the prompt it must stay."""
    prompt = sp_tok.encode("Hello the quick brown fox")
    ids = sp_tok.encode("world 日本語 café", add_special_tokens=False)
    assert sp_tok.decode(ids) == "world 日本語 café"
    detok, deltas, _ = stream(sp_tok, ids, prompt=prompt)
    assert detok.output_text == " world 日本語 café"
    assert not any("\ufffd" in d for d in deltas)
    without_prompt, _, _ = stream(sp_tok, ids)
    assert without_prompt.output_text == sp_tok.decode(ids)


@pytest.mark.parametrize("chunk", [1, 2])
def test_stop_string_across_tokens_never_streamed(tok, chunk):
    text = "We count: one two three, then the END marker and more text after it."
    ids = tok.encode(text)
    for stop in ["END marker", "three, then", "o t", "d more", "r it."]:
        assert all(stop not in tok.decode([i]) for i in ids)  # each stop string spans tokens
        detok, deltas, matched = stream(tok, ids, chunk=chunk, stop=[stop, "never there"])
        assert matched == stop
        assert detok.output_text == text[:text.index(stop)]
        assert len(deltas) > 2


def test_include_stop_str_in_output(tok):
    text = "alpha beta gamma delta"
    detok, deltas, matched = stream(tok, tok.encode(text), stop=["gam"], include_stop_str_in_output=True)
    assert matched == "gam" and detok.output_text == "alpha beta gam" == "".join(deltas)


def test_earliest_stop_string_wins(tok):
    detok, _, matched = stream(tok, tok.encode("xx ab cd"), chunk=8, stop=["cd", "ab"])
    assert matched == "ab" and detok.output_text == "xx "


def test_hold_back_then_release(tok):
    """Text that only starts like a stop string is held back while running, and released at the end."""
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["ENDING"]))
    assert detok.update(tok.encode("the END")) is None
    assert detok.get_delta(finished=False) == "th"  # len("ENDING") - 1 characters wait
    assert detok.get_delta(finished=True) == "e END"


@pytest.mark.parametrize("chunk", [1, 3])
def test_min_tokens_delays_stop(tok, chunk):
    ids = tok.encode("stop here, stop now")
    assert tok.decode(ids[:1]) == "stop" and tok.decode(ids[:2]) == "stop here"
    detok, _, matched = stream(tok, ids, stop=["stop"], min_tokens=1, chunk=chunk)
    assert matched == "stop" and detok.output_text == "stop here, "
    _, _, matched = stream(tok, ids, stop=["here"], min_tokens=2, chunk=chunk)
    assert matched is None  # the only "here" lies in the text of the first min_tokens tokens
    # a stop string that starts in that text but ends after it still counts, as in vLLM
    detok, _, matched = stream(tok, ids, stop=["p he"], min_tokens=1, chunk=chunk)
    assert matched == "p he" and detok.output_text == "sto"


def test_skip_special_tokens(tok):
    im_end = tok.backend.token_to_id("<|im_end|>")
    ids = tok.encode("Hi there") + [im_end] + tok.encode(" more")
    assert stream(tok, ids)[0].output_text == "Hi there more"
    assert stream(tok, ids, skip_special_tokens=False)[0].output_text == "Hi there<|im_end|> more"
    # stop strings see special tokens only when they are kept
    assert stream(tok, ids, skip_special_tokens=False, stop=["<|im_end|>"])[2] == "<|im_end|>"
    assert stream(tok, ids, stop=["<|im_end|>"])[2] is None


def test_stop_token_text_stays_out(tok):
    """The EOS / stop token id that ends a sequence is not text of the output, unless asked for (as in vLLM)."""
    ids = tok.encode("Done.") + [tok.eos_token_id]
    kept = {"skip_special_tokens": False}
    assert stream(tok, ids, stop_terminated=True, **kept)[0].output_text == "Done."
    assert stream(tok, ids, stop_terminated=True, include_stop_str_in_output=True, **kept)[0].output_text \
        == "Done.<|im_end|>"


def test_detokenize_false(tok):
    detok, deltas, matched = stream(tok, tok.encode("some text"), detokenize=False)
    assert detok.output_text == "" == "".join(deltas) and matched is None
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["text"], detokenize=False)


def test_unfinished_character_flushed_at_end(tok):
    ids = tok.encode("ok 🎉")[:-1]  # the emoji's last byte never comes
    detok, deltas, _ = stream(tok, ids)
    assert "\ufffd" not in "".join(deltas[:-1])
    assert detok.output_text == tok.decode(ids) == "ok \ufffd"


@_SETTINGS
@given(ids=st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 400)), max_size=24),
       chunk=st.integers(1, 4), skip=st.booleans(),
       stop=st.lists(st.sampled_from(["e", "th", "\n", " the", "<|im_end|>", "\ufffd"]), max_size=2))
def test_random_ids_property(tok, ids, chunk, skip, stop):
    detok, deltas, matched = stream(tok, ids, chunk=chunk, skip_special_tokens=skip, stop=stop)
    if matched is None:  # byte-level BPE: streaming is exactly a full decode, even for invalid UTF-8
        assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)
    else:
        assert matched in stop and matched not in detok.output_text


@_SETTINGS
@given(prompt=st.lists(st.integers(0, 280), max_size=8), ids=st.lists(st.integers(0, 280), max_size=16),
       chunk=st.integers(1, 3), skip=st.booleans())
def test_random_ids_sentencepiece_never_crash(sp_tok, prompt, ids, chunk, skip):
    """Random byte tokens make tokenizers' DecodeStream raise "Invalid prefix"; the stream restarts instead."""
    stream(sp_tok, ids, prompt=prompt, chunk=chunk, skip_special_tokens=skip, stop=["a b"])
