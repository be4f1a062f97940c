"""The request flow that completions and chat share: check, build SamplingParams, submit, then stream or collect.

Both endpoints consume the same thing, per-choice deltas made from the engine's DELTA outputs, so streaming
and non-streaming are one mechanism: a stream chunk is one delta, a full response is each choice's deltas
joined. Subclasses say only how to build prompts and how to dress a delta in their JSON shape.

A request's sizes are checked first (folio.entrypoints.openai.request_limits); its prompts are then tokenized,
and its chat template rendered, in a worker thread, so that a large prompt does not hold up the event loop
and every other client with it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Optional, Union

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse

from folio.engine.async_llm import AsyncLLM, EngineError, RequestStream
from folio.engine.input_processor import check_prompt_fits, truncated
from folio.entrypoints.openai.errors import OpenAIError, engine_error_status, error_body
from folio.entrypoints.openai.protocol import (ChatLogProb, CompletionTokensDetails, DeltaToolCall, PromptLogprob,
                                               PromptTokensDetails, SamplingRequest, TopLogProb, UsageInfo)
from folio.entrypoints.openai.request_limits import RequestLimits
from folio.outputs import Logprob, SampleLogprobs
from folio.reasoning_parser import ReasoningParser
from folio.sampling_params import SamplingParams
from folio.structured_output.params import StructuredOutputsParams

PositionLogprobs = Optional[dict[int, Logprob]]  # None for the first prompt token, which has no logprob


@dataclass
class Prompt:
    text: Optional[str]  # None when the prompt came as token ids or from a chat template
    token_ids: list[int]


@dataclass
class ChoiceDelta:
    """What one choice gained: a stream chunk carries one, a full response carries each choice's joined."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the tokens `logprobs` describe (echoed prompt too)
    logprobs: Optional[list[PositionLogprobs]] = None  # None unless requested
    num_generated: int = 0  # completion tokens, for usage (echoed prompt tokens are not)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    text_offset: int = 0  # characters of this choice handed out before this delta
    tool_calls: list[DeltaToolCall] = field(default_factory=list)  # chat: pieces of the tool calls read in the text
    reasoning: str = ""  # chat with a reasoning parser: the reasoning read out of the text
    num_reasoning_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)  # the tokens generated, as generated (return_token_ids)
    prompt_token_ids: Optional[list[int]] = None  # the choice's prompt, on its first delta (return_token_ids)
    prompt_logprobs: Optional[list[PositionLogprobs]] = None  # the prompt's, on its first delta (prompt_logprobs)

    def extend(self, other: "ChoiceDelta") -> None:
        self.text += other.text
        self.output_token_ids += other.output_token_ids
        self.reasoning += other.reasoning
        self.num_reasoning_tokens += other.num_reasoning_tokens
        self.tool_calls += other.tool_calls
        self.token_ids += other.token_ids
        if self.logprobs is not None and other.logprobs is not None:
            self.logprobs += other.logprobs
        self.num_generated += other.num_generated
        self.finish_reason, self.stop_reason = other.finish_reason, other.stop_reason


def clamp_logprob(value: float) -> float:
    """JSON has no -Infinity; vLLM reports impossible tokens as -9999."""
    return max(value, -9999.0)


def logprob_token(token_id: int, text: Optional[str], as_id: bool) -> str:
    """How a logprob names its token: its text, or with vLLM's return_tokens_as_token_ids "token_id:<id>" (a text
    that is not valid UTF-8 on its own, a byte of a character, cannot be told apart otherwise)."""
    return f"token_id:{token_id}" if as_id else text or ""


def _top_logprob(token_id: int, lp: Logprob, as_id: bool) -> TopLogProb:
    token = logprob_token(token_id, lp.decoded_token, as_id)
    return TopLogProb(token=token, logprob=clamp_logprob(lp.logprob), bytes=list(token.encode("utf-8")))


def token_logprobs(token_ids: list[int], positions: SampleLogprobs, top_n: int,
                   as_ids: bool = False) -> list[ChatLogProb]:
    """Each generated token's logprob and the top_n most likely at its position, in the shape chat completions and
    the Responses API share (as_ids: tokens named by id)."""
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = _top_logprob(token_id, position[token_id], as_ids)
        top = sorted(((i, lp) for i, lp in position.items() if lp.rank is not None and lp.rank <= top_n),
                     key=lambda item: item[1].rank)
        content.append(ChatLogProb(**chosen.model_dump(), top_logprobs=[_top_logprob(i, lp, as_ids) for i, lp in top]))
    return content


def prompt_logprobs_field(positions: Optional[list[PositionLogprobs]]) -> Optional[list[Optional[dict]]]:
    """vLLM's prompt_logprobs in a response: per prompt position (the first has none) its top tokens and the
    prompt's own, by id, each with its logprob, rank and text."""
    if positions is None:
        return None
    return [None if position is None else
            {token_id: PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
             for token_id, lp in position.items()} for position in positions]


def _event(payload: Union[BaseModel, dict]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


async def cancel_on_disconnect(raw_request: Request, work: Awaitable[Response]) -> Response:
    """Run a non-streaming handler, cancelling it when the client goes away (its engine requests are then
    aborted by the handler's finally blocks). Streaming responses get this from Starlette already."""

    async def disconnected() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody is left to read it
    return task.result()


def check_model(requested: Optional[str], served: str) -> None:
    """404 for a model this server does not serve (a request may leave the model out)."""
    if requested is not None and requested != served:
        raise OpenAIError(404, f"The model `{requested}` does not exist.", "model")


def check_context(prompt_len: int, max_tokens: int, max_model_len: int, field: str = "max_tokens") -> None:
    """A 400 in OpenAI's words when the prompt and the tokens asked for do not fit in the context."""
    if prompt_len + max_tokens > max_model_len:
        raise OpenAIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                               f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                               f"{max_tokens} in the completion). Please reduce the length of the messages or "
                               "completion.", field)


class OpenAIServing(ABC):
    request_id_prefix: str
    reasoning_parser: Optional[ReasoningParser] = None  # set where the endpoint reads reasoning out of the text

    def __init__(self, llm: AsyncLLM, model_name: str, limits: RequestLimits) -> None:
        self.llm = llm
        self.model_name = model_name
        self.limits = limits
        self.tokenizer = llm.engine.get_tokenizer()
        self.max_model_len = llm.engine.max_model_len

    # ---- what subclasses define --------------------------------------------------------------------

    @abstractmethod
    def prompts(self, request: SamplingRequest) -> list[Prompt]:
        """Tokenized prompts, each checked against self.limits before tokenizing; ValueError for bad input.
        Runs in a worker thread."""

    @abstractmethod
    def max_tokens(self, request: SamplingRequest, longest_prompt: int) -> int:
        """The max_tokens to run with, the endpoint's default filled in."""

    @abstractmethod
    def logprob_counts(self, request: SamplingRequest) -> tuple[Optional[int], Optional[int]]:
        """SamplingParams' (logprobs, prompt_logprobs)."""

    @abstractmethod
    def choice(self, request: SamplingRequest, delta: ChoiceDelta, stream: bool) -> BaseModel:
        """One choice of a chunk (stream) or of a full response."""

    @abstractmethod
    def envelope(self, request_id: str, created: int, choices: list[BaseModel], usage: Optional[UsageInfo],
                 stream: bool, prompt: Optional[ChoiceDelta] = None) -> BaseModel:
        """A chunk (stream) or a full response around the choices; `prompt`: a choice's first delta, whose prompt
        fields (return_token_ids, prompt_logprobs) chat gives beside its choices."""

    def first_delta(self, request: SamplingRequest, prompt: Prompt, prompt_logprobs: list[PositionLogprobs],
                    delta: ChoiceDelta) -> ChoiceDelta:
        """A choice's first delta; completions' echo prepends the prompt here."""
        return delta

    def opening_chunks(self, request_id: str, created: int, request: SamplingRequest,
                       first: ChoiceDelta) -> list[BaseModel]:
        """Chunks sent just before the first delta, `first` (chat's role announcement)."""
        return []

    def structured_outputs(self, request: SamplingRequest) -> Optional[StructuredOutputsParams]:
        """The constraint on the output (here the structured_outputs field), checked: ValueError naming the field."""
        constraint = request.structured_outputs_params()
        self.llm.engine.structured_output.validate(constraint, request.structured_outputs_field)
        return constraint

    def read_deltas(self, request: SamplingRequest, prompts: list[Prompt],
                    deltas: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
        """The deltas as the endpoint hands them out (chat reads reasoning and tool calls in them)."""
        return deltas

    # ---- the shared flow ---------------------------------------------------------------------------

    def check_model(self, name: Optional[str]) -> None:
        check_model(name, self.model_name)

    async def serve(self, request: SamplingRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        fields = type(request).model_fields
        try:
            prompts, params = await self.prepare(request)
        except ValueError as e:
            raise OpenAIError.bad_request(e, fields) from e
        request_id = f"{self.request_id_prefix}-{uuid.uuid4().hex}"
        engine_prompts = [(f"{request_id}-{i}", {"prompt": p.text, "prompt_token_ids": p.token_ids,
                                                 "cache_salt": request.cache_salt}) for i, p in enumerate(prompts)]
        try:
            stream = await self.llm.add_requests(engine_prompts, params, request.priority)
        except ValueError as e:
            raise OpenAIError.bad_request(e, fields) from e
        created = int(time.time())
        cached: dict[int, int] = {}  # prompt index -> its tokens found in the prefix cache, filled by _deltas
        deltas = self.read_deltas(request, prompts, self._deltas(stream, request, prompts, cached))
        if request.stream:
            return StreamingResponse(self._sse(stream, deltas, request_id, created, request, prompts, cached),
                                     media_type="text/event-stream")
        return await cancel_on_disconnect(raw_request, self._collect(stream, deltas, request_id, created, request,
                                                                     prompts, cached))

    async def prepare(self, request: SamplingRequest) -> tuple[list[Prompt], SamplingParams]:
        """The request's prompts and SamplingParams, its fields and sizes checked first; ValueError naming the
        field."""
        request.refuse_unsupported()
        request.check_limits(self.limits)

        def tokenize() -> tuple[list[Prompt], SamplingParams]:
            prompts = [self._truncated(prompt, request.truncate_prompt_tokens) for prompt in self.prompts(request)]
            return prompts, self._sampling_params(request, prompts)

        return await asyncio.to_thread(tokenize)

    def _truncated(self, prompt: Prompt, keep: Optional[int]) -> Prompt:
        """truncate_prompt_tokens applied here, before the prompt is checked against the context (the engine would
        do the same); a truncated prompt's text is its tokens' (completions' echo gives what the model read)."""
        ids = truncated(prompt.token_ids, keep, self.max_model_len)
        return prompt if len(ids) == len(prompt.token_ids) else Prompt(None, ids)

    def _sampling_params(self, request: SamplingRequest, prompts: list[Prompt]) -> SamplingParams:
        if not prompts or any(not p.token_ids for p in prompts):
            raise ValueError("prompt must not be empty")
        longest = max(len(p.token_ids) for p in prompts)
        check_prompt_fits(longest, self.max_model_len)
        max_tokens = self.max_tokens(request, longest)
        check_context(longest, max_tokens, self.max_model_len)
        logprobs, prompt_logprobs = self.logprob_counts(request)
        return request.to_sampling_params(max_tokens, logprobs, prompt_logprobs, self.structured_outputs(request))

    async def _deltas(self, stream: RequestStream, request: SamplingRequest, prompts: list[Prompt],
                      cached: dict[int, int]) -> AsyncIterator[ChoiceDelta]:
        n = request.n or 1
        prompt_index = {rid: i for i, rid in enumerate(stream.request_ids)}
        prompt_logprobs: list[list[PositionLogprobs]] = [[] for _ in prompts]
        sent: dict[int, int] = {}  # choice index -> characters handed out so far
        async for output in stream:
            p = prompt_index[output.request_id]
            cached[p] = output.num_cached_tokens
            prompt_logprobs[p].extend(output.prompt_logprobs or ())
            for completion in output.outputs:
                delta = ChoiceDelta(p * n + completion.index, completion.text, list(completion.token_ids),
                                    completion.logprobs, len(completion.token_ids), completion.finish_reason,
                                    completion.stop_reason, output_token_ids=list(completion.token_ids))
                if delta.index not in sent:
                    if request.return_token_ids:
                        delta.prompt_token_ids = prompts[p].token_ids
                    if request.prompt_logprobs is not None:
                        delta.prompt_logprobs = list(prompt_logprobs[p])
                    delta = self.first_delta(request, prompts[p], prompt_logprobs[p], delta)
                delta.text_offset = sent.get(delta.index, 0)
                sent[delta.index] = delta.text_offset + len(delta.text)
                yield delta

    def usage(self, prompts: list[Prompt], completion_tokens: int, cached: dict[int, int],
              reasoning_tokens: int = 0) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        details = None if self.reasoning_parser is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())),
                         completion_tokens_details=details)

    async def _sse(self, stream: RequestStream, deltas: AsyncIterator[ChoiceDelta], request_id: str, created: int,
                   request: SamplingRequest, prompts: list[Prompt], cached: dict[int, int]) -> AsyncIterator[str]:
        completion_tokens = reasoning_tokens = 0
        # Held back until the first token (as vLLM does): clients time the first chunk as the first token, and a
        # chunk sent before the prefill would report the time to the headers instead.
        opened = False
        try:
            async for delta in deltas:
                if not opened:
                    for chunk in self.opening_chunks(request_id, created, request, delta):
                        yield _event(chunk)
                    opened = True
                completion_tokens += delta.num_generated
                reasoning_tokens += delta.num_reasoning_tokens
                if delta.text or delta.reasoning or delta.finish_reason or delta.logprobs or delta.tool_calls or \
                        (request.return_token_ids and delta.output_token_ids) or delta.prompt_logprobs is not None \
                        or delta.prompt_token_ids is not None:
                    choice = self.choice(request, delta, stream=True)
                    usage = self.usage(prompts, completion_tokens, cached, reasoning_tokens) \
                        if request.usage_in_every_chunk else None
                    yield _event(self.envelope(request_id, created, [choice], usage, stream=True))
            if request.include_usage_in_stream:
                usage = self.usage(prompts, completion_tokens, cached, reasoning_tokens)
                yield _event(self.envelope(request_id, created, [], usage, stream=True))
        except EngineError as e:  # the status line is long gone: report it in the stream, as vLLM does
            yield _event(error_body(engine_error_status(e), str(e)))
        finally:
            stream.close()
        yield "data: [DONE]\n\n"

    async def _collect(self, stream: RequestStream, deltas: AsyncIterator[ChoiceDelta], request_id: str,
                       created: int, request: SamplingRequest, prompts: list[Prompt],
                       cached: dict[int, int]) -> Response:
        choices: dict[int, ChoiceDelta] = {}
        try:
            async for delta in deltas:
                if delta.index in choices:
                    choices[delta.index].extend(delta)
                else:
                    choices[delta.index] = delta
        finally:
            stream.close()
        ordered = [choices[i] for i in sorted(choices)]
        usage = self.usage(prompts, sum(c.num_generated for c in ordered), cached,
                           sum(c.num_reasoning_tokens for c in ordered))
        body = self.envelope(request_id, created, [self.choice(request, c, stream=False) for c in ordered], usage,
                             stream=False, prompt=ordered[0] if ordered else None)
        return Response(body.model_dump_json(), media_type="application/json")
