"""Incremental detokenization and stop strings for one generated sequence (vLLM V1's FastIncrementalDetokenizer).

Decoding token by token with `decode([id])` breaks characters whose UTF-8 bytes span tokens and loses the leading
space of SentencePiece tokens; decoding the whole sequence every step is quadratic. `tokenizers`' DecodeStream keeps a
small window in Rust and releases text only once it ends on a complete character.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from folio.sampling_params import SamplingParams
from folio.tokenizer import Tokenizer

# Prompt ids that prime the stream: the shortest suffix of at least _MIN_CONTEXT ids (and below _MAX_CONTEXT) that
# decodes cleanly, as vLLM does. A SentencePiece decoder strips the space of a sequence's first token; with context in
# front, the first generated word keeps its space, as in a decode of prompt + output.
_MIN_CONTEXT = 4
_MAX_CONTEXT = 24


class IncrementalDetokenizer:
    """Turns the ids of one sequence into text as they arrive, ends it at stop strings, and hands out safe deltas."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self._skip_special = params.skip_special_tokens
        self._text = ""  # text the stream released; stop strings are searched here
        self._pending: list[int] = []  # ids stepped in whose text the stream has not released yet
        self._sent = 0  # characters of output_text handed out by get_delta
        self._stopped = False
        # Without the stop string in the output, a stream must not show its first characters before knowing it is one.
        stop = params.stop or []
        self._hold_back = max(map(len, stop)) - 1 if stop and not params.include_stop_str_in_output else 0
        context = self._prompt_context(prompt_token_ids) if params.detokenize else []
        self._stream = DecodeStream(ids=context, skip_special_tokens=self._skip_special)
        self._stepped = context[-_MIN_CONTEXT:]  # the last ids the stream took in: context for _tail

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        if len(prompt_token_ids) <= _MIN_CONTEXT:
            return list(prompt_token_ids)
        for n in range(_MIN_CONTEXT, min(len(prompt_token_ids), _MAX_CONTEXT) + 1):
            suffix = prompt_token_ids[-n:]
            # A context ending inside a character (or cut inside one) would corrupt the stream's first chunk.
            if "\ufffd" not in self.tokenizer.decode(suffix, skip_special_tokens=self._skip_special):
                return list(suffix)
        return []

    def _step(self, token_id: int) -> str:
        try:
            chunk = self._stream.step(self.tokenizer.backend, token_id)
        except Exception as e:
            # tokenizers raises "Invalid prefix" when a decoder is not monotonic and the window's text stops
            # extending the previous text (vLLM #17448). Restart the stream with the ids still waiting for text.
            if not str(e).startswith("Invalid prefix"):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            chunk = self._stream.step(self.tokenizer.backend, self._pending + [token_id])
        self._stepped.append(token_id)
        if chunk is None:
            self._pending.append(token_id)
            return ""
        self._pending.clear()
        del self._stepped[:-_MIN_CONTEXT]  # _tail needs only a little context before the pending ids
        return chunk

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append ids and their text, then look for stop strings; returns the stop string that ended the sequence.

        stop_terminated: the last id is the EOS or stop token id that ended the sequence. Like vLLM, its text stays
        out of the output unless include_stop_str_in_output.
        """
        num_before = len(self.token_ids)
        self.token_ids.extend(new_token_ids)
        if not self.params.detokenize or self._stopped:
            return None
        if stop_terminated and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        check_from = len(self._text)
        for i, token_id in enumerate(new_token_ids):
            self._text += self._step(token_id)
            # min_tokens: a stop string must end after the text of the first min_tokens ids.
            if num_before + i + 1 <= self.params.min_tokens:
                check_from = len(self._text)
        return self._check_stop(check_from)

    def _check_stop(self, check_from: int) -> str | None:
        """Earliest stop string ending after check_from; the text is cut at its start (or its end if kept)."""
        best: tuple[int, str] | None = None
        for stop in self.params.stop or []:
            index = self._text.find(stop, max(0, check_from - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self._text = self._text[:index + len(stop) if self.params.include_stop_str_in_output else index]
        self._pending.clear()  # whatever the stream still holds comes after the stop string
        self._stopped = True
        return stop

    def _tail(self) -> str:
        """Text of the ids the stream still holds: an unfinished character ('\ufffd', as a full decode shows it) or
        skipped special tokens (''). Decoded after a few ids of context so leading-space rules match."""
        if not self._pending:
            return ""
        n = len(self._pending)
        context = self._stepped[-n - _MIN_CONTEXT:-n]
        head = self.tokenizer.decode(context, skip_special_tokens=self._skip_special)
        full = self.tokenizer.decode(context + self._pending, skip_special_tokens=self._skip_special)
        if full.startswith(head):
            return full[len(head):]
        return self.tokenizer.decode(self._pending, skip_special_tokens=self._skip_special)

    @property
    def output_text(self) -> str:
        return self._text + self._tail()

    def get_delta(self, finished: bool) -> str:
        """Text not handed out yet. While running, the last len(longest stop)-1 characters and any unfinished
        character wait, so a stream never shows part of a stop string or a '\ufffd' that a later token completes."""
        text = self.output_text if finished else self._text[:max(len(self._text) - self._hold_back, 0)]
        delta = text[self._sent:]
        self._sent = max(self._sent, len(text))
        return delta
