"""POST /v1/completions: prompts as text or token ids, echo, and the legacy logprobs shape.

`echo` with `max_tokens: 0` and `logprobs` scores a prompt without generating (lm-eval's loglikelihood):
the engine runs one token, which is dropped, and the prompt's own logprobs are returned. `suffix` asks a code
model for the text between the prompt and the suffix (fill_in_the_middle.py); echo then shows the prompt.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Optional

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response

from folio.entrypoints.beam_search import BeamSearchParams, beam_search_async
from folio.entrypoints.openai.errors import OpenAIError
from folio.entrypoints.openai.fill_in_the_middle import fim_prompt_ids
from folio.entrypoints.openai.protocol import (CompletionChoice, CompletionLogProbs, CompletionRequest,
                                               CompletionResponse, UsageInfo)
from folio.entrypoints.openai.serving import (ChoiceDelta, OpenAIServing, PositionLogprobs, Prompt, cancel_on_disconnect,
                                             clamp_logprob, logprob_token, prompt_logprobs_field)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class OpenAIServingCompletion(OpenAIServing):
    request_id_prefix = "cmpl"

    async def serve(self, request: CompletionRequest, raw_request: Request) -> Response:
        if not request.use_beam_search:
            return await super().serve(request, raw_request)
        self.check_model(request.model)
        try:
            prompts, params = await self.prepare(request)
            beam = BeamSearchParams(beam_width=max(params.n, request.best_of or params.n),
                                    max_tokens=params.max_tokens, ignore_eos=request.ignore_eos,
                                    length_penalty=request.length_penalty)
        except ValueError as e:
            raise OpenAIError.bad_request(e, type(request).model_fields) from e
        return await cancel_on_disconnect(raw_request, self._beam_search(request, prompts, params.n, beam))

    async def _beam_search(self, request: CompletionRequest, prompts: list[Prompt], n: int,
                           beam: BeamSearchParams) -> Response:
        results = await beam_search_async(self.llm, [p.token_ids for p in prompts], beam, request.priority)
        choices = [CompletionChoice(index=p * n + i, text=seq.text, finish_reason=seq.finish_reason)
                   for p, result in enumerate(results) for i, seq in enumerate(result.sequences[:n])]
        generated = sum(len(seq.tokens) for result in results for seq in result.sequences[:n])
        body = self.envelope(f"{self.request_id_prefix}-{uuid.uuid4().hex}", int(time.time()), choices,
                             self.usage(prompts, generated, {}), stream=False)
        return Response(body.model_dump_json(), media_type="application/json")

    def prompts(self, request: CompletionRequest) -> list[Prompt]:
        raw = request.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]
        for item in raw:
            self.limits.for_prompts(request.truncate_prompt_tokens).prompt(
                item + (request.suffix or "") if isinstance(item, str) else item)
        if request.suffix is not None:
            if not all(isinstance(item, str) for item in raw):
                raise ValueError("suffix needs the prompt as text, not token ids")
            return [Prompt(item, fim_prompt_ids(self.tokenizer, item, request.suffix)) for item in raw]
        return [Prompt(item, self.tokenizer.encode(item)) if isinstance(item, str) else Prompt(None, list(item))
                for item in raw]

    def max_tokens(self, request: CompletionRequest, longest_prompt: int) -> int:
        if request.max_tokens == 0:
            return 1  # echo only: the one generated token is dropped in first_delta
        return DEFAULT_MAX_TOKENS if request.max_tokens is None else request.max_tokens

    def logprob_counts(self, request: CompletionRequest) -> tuple[Optional[int], Optional[int]]:
        """prompt_logprobs, or echo's: echo with logprobs gives the prompt's in the choice's logprobs."""
        return request.logprobs, request.logprobs if request.echo and request.logprobs is not None else \
            request.prompt_logprobs

    def first_delta(self, request: CompletionRequest, prompt: Prompt, prompt_logprobs: list[PositionLogprobs],
                    delta: ChoiceDelta) -> ChoiceDelta:
        if request.max_tokens == 0:
            delta = dataclasses.replace(delta, text="", token_ids=[], num_generated=0, finish_reason="length",
                                        stop_reason=None, logprobs=None if delta.logprobs is None else [],
                                        output_token_ids=[])
        if not request.echo:
            return delta
        text = prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids,
                                                                                 skip_special_tokens=False)
        logprobs = None if delta.logprobs is None else prompt_logprobs + delta.logprobs
        return dataclasses.replace(delta, text=text + delta.text, token_ids=prompt.token_ids + delta.token_ids,
                                   logprobs=logprobs)

    def choice(self, request: CompletionRequest, delta: ChoiceDelta, stream: bool) -> CompletionChoice:
        logprobs = None if delta.logprobs is None else self._logprobs(delta, bool(request.return_tokens_as_token_ids))
        return CompletionChoice(index=delta.index, text=delta.text, logprobs=logprobs,
                                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                                prompt_token_ids=delta.prompt_token_ids,
                                token_ids=delta.output_token_ids if request.return_token_ids else None,
                                prompt_logprobs=prompt_logprobs_field(delta.prompt_logprobs))

    def envelope(self, request_id: str, created: int, choices: list[BaseModel], usage: Optional[UsageInfo],
                 stream: bool, prompt: Optional[ChoiceDelta] = None) -> CompletionResponse:
        return CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices, usage=usage)

    def _logprobs(self, delta: ChoiceDelta, as_ids: bool) -> CompletionLogProbs:
        """OpenAI's legacy shape: per token its text, logprob, top alternatives and offset in the choice's text
        (as_ids: tokens named "token_id:<id>", the offsets still in the text)."""
        out = CompletionLogProbs()
        offset = delta.text_offset
        for token_id, position in zip(delta.token_ids, delta.logprobs):
            chosen = position.get(token_id) if position is not None else None
            text = chosen.decoded_token if chosen is not None else self.tokenizer.decode_token(token_id)
            out.tokens.append(logprob_token(token_id, text, as_ids))
            out.text_offset.append(offset)
            offset += len(text)
            out.token_logprobs.append(None if chosen is None else clamp_logprob(chosen.logprob))
            out.top_logprobs.append(None if position is None else
                                    {logprob_token(i, lp.decoded_token, as_ids): clamp_logprob(lp.logprob)
                                     for i, lp in position.items()})
        return out
