"""The Responses API: POST /v1/responses (plain or streamed as typed events), GET and DELETE /v1/responses/{id}.

A response is one chat turn: its input items become chat messages (after the stored conversation of
`previous_response_id`, and after `instructions` as a system message), the chat template renders them, and the
engine generates one output message. Finished responses with `store` (the default) go to the ResponseStore.

A stream is the event sequence OpenAI's clients assemble: response.created and response.in_progress at once;
then, with the first token, output_item.added and content_part.added; an output_text.delta per piece of text;
the matching .done events; and response.completed (or response.incomplete when max_output_tokens ran out,
response.failed when the engine failed). What would need structured output (tools, JSON formats) is refused.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Union

from fastapi import Request
from starlette.responses import Response, StreamingResponse

from folio.engine.async_llm import AsyncLLM, EngineError, RequestStream
from folio.engine.input_processor import check_prompt_fits
from folio.entrypoints.openai.errors import OpenAIError
from folio.entrypoints.openai.protocol import ChatMessage, FunctionCallRequest, TextPart, ToolCallRequest
from folio.entrypoints.openai.request_limits import RequestLimits
from folio.entrypoints.openai.protocol_responses import (DeletedResponse, FunctionCallItem, IncompleteDetails,
                                                         InputItem, InputMessage, InputTokensDetails, OutputMessage,
                                                         OutputText, ResponseError, ResponseObject, ResponsesRequest,
                                                         ResponseUsage)
from folio.entrypoints.openai.responses_store import ResponseStore
from folio.entrypoints.openai.serving import cancel_on_disconnect, check_context, check_model
from folio.entrypoints.openai.serving_chat import chat_prompt_ids
from folio.outputs import RequestOutput
from folio.sampling_params import SamplingParams

_STRUCTURED = "needs structured output, which this server does not support yet"
# Fields a request may send only empty: (field, is it set, why not).
_UNSUPPORTED = (
    ("n", lambda r: r.n not in (None, 1), "is not a field of the Responses API: a response has one output"),
    ("max_tokens", lambda r: r.max_tokens is not None, "is not a field of the Responses API: use max_output_tokens"),
    ("tools", lambda r: bool(r.tools), f"are refused: calling them {_STRUCTURED}"),
    ("tool_choice", lambda r: r.tool_choice not in (None, "auto", "none"), f"other than auto or none {_STRUCTURED}"),
    ("text", lambda r: r.text is not None and r.text.format is not None and r.text.format.type != "text",
     f"formats other than 'text' {_STRUCTURED}"),
    ("truncation", lambda r: r.truncation not in (None, "disabled"), "'auto' is not supported: a prompt that does "
                                                                     "not fit is refused"),
    ("reasoning", lambda r: any(v is not None for v in (r.reasoning or {}).values()),
     "is not supported: folio runs models without reasoning controls"),
    ("background", lambda r: bool(r.background), "is not supported: a response runs while its request is open"),
    ("include", lambda r: bool(r.include), "is not supported: a response holds its output text only"),
    ("top_logprobs", lambda r: bool(r.top_logprobs), "is not supported here (chat completions has logprobs)"),
)


def refuse_unsupported(request: ResponsesRequest) -> None:
    for name, is_set, why in _UNSUPPORTED:
        if is_set(request):
            raise ValueError(f"{name} {why}")


def chat_messages(items: Union[str, list[InputItem]]) -> list[ChatMessage]:
    """Input items as chat messages: a string is a user message; consecutive function calls are one assistant
    message with several tool_calls; a function call's output is a tool message."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, InputMessage):
            content = item.content if isinstance(item.content, str) else \
                [TextPart(type="text", text=part.text) for part in item.content]
            messages.append(ChatMessage(role=item.role, content=content))
        elif isinstance(item, FunctionCallItem):
            call = ToolCallRequest(id=item.call_id, type="function",
                                   function=FunctionCallRequest(name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant" and messages[-1].tool_calls:
                messages[-1].tool_calls.append(call)
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        else:
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
    return messages


@dataclass
class _Turn:
    """One response while it is generated, and everything its ResponseObject is made of."""

    request: ResponsesRequest
    params: SamplingParams
    model_name: str
    conversation: list[ChatMessage]  # without the instructions
    prompt_tokens: int
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: Optional[str] = None

    def add(self, output: RequestOutput) -> str:
        """Take one DELTA output; returns the text it added."""
        self.cached_tokens = output.num_cached_tokens
        added = ""
        for completion in output.outputs:
            added += completion.text
            self.output_tokens += len(completion.token_ids)
            self.finish_reason = completion.finish_reason
        self.text += added
        return added

    @property
    def status(self) -> str:
        return {None: "in_progress", "stop": "completed", "length": "incomplete"}.get(self.finish_reason, "failed")

    def message(self) -> OutputMessage:
        status = self.status if self.status in ("in_progress", "completed") else "incomplete"
        return OutputMessage(id=self.message_id, status=status, content=[OutputText(text=self.text)])

    def response(self, error: Optional[ResponseError] = None) -> ResponseObject:
        request, status = self.request, "failed" if error is not None else self.status
        usage = ResponseUsage(input_tokens=self.prompt_tokens,
                              input_tokens_details=InputTokensDetails(cached_tokens=self.cached_tokens),
                              output_tokens=self.output_tokens, total_tokens=self.prompt_tokens + self.output_tokens)
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, model=self.model_name,
            output=[] if status == "in_progress" else [self.message()],
            usage=None if status == "in_progress" else usage,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            error=error, instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id, store=request.store,
            temperature=self.params.temperature, top_p=self.params.top_p, metadata=request.metadata or {},
            user=request.user, parallel_tool_calls=request.parallel_tool_calls is not False,
            tool_choice=request.tool_choice or "auto")


class OpenAIServingResponses:
    def __init__(self, llm: AsyncLLM, model_name: str, limits: RequestLimits, store: ResponseStore) -> None:
        self.llm = llm
        self.model_name = model_name
        self.limits = limits
        self.store = store
        self.tokenizer = llm.engine.get_tokenizer()
        self.max_model_len = llm.engine.max_model_len

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        check_model(request.model, self.model_name)
        fields = ResponsesRequest.model_fields
        try:
            refuse_unsupported(request)
            request.check_limits(self.limits)
            if not request.input:
                raise ValueError("input must not be empty")
            conversation = self._earlier_turns(request.previous_response_id) + chat_messages(request.input)
            ids, params = await asyncio.to_thread(self._prompt_and_params, request, conversation)
        except ValueError as e:
            raise OpenAIError.bad_request(e, fields) from e
        turn = _Turn(request, params, self.model_name, conversation, len(ids))
        try:
            stream = await self.llm.add_requests([(turn.id, {"prompt_token_ids": ids,
                                                             "cache_salt": request.cache_salt})],
                                                 params, request.priority)
        except ValueError as e:
            raise OpenAIError.bad_request(e, fields) from e
        if request.stream:
            return StreamingResponse(self._events(stream, turn), media_type="text/event-stream")
        return await cancel_on_disconnect(raw_request, self._collect(stream, turn))

    def _prompt_and_params(self, request: ResponsesRequest,
                           conversation: list[ChatMessage]) -> tuple[list[int], SamplingParams]:
        """The rendered, tokenized prompt (in a worker thread: templates and tokenizing take time) and the
        SamplingParams; ValueError naming the field."""
        system = [ChatMessage(role="system", content=request.instructions)] if request.instructions else []
        ids = chat_prompt_ids(self.tokenizer, self.limits, system + conversation, field="input")
        check_prompt_fits(len(ids), self.max_model_len, "input")
        max_tokens = request.max_output_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(ids)
        elif max_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {max_tokens}")
        check_context(len(ids), max_tokens, self.max_model_len, "max_output_tokens")
        return ids, request.to_sampling_params(max_tokens)

    def retrieve(self, response_id: str, query: dict[str, str]) -> ResponseObject:
        for name, value in query.items():
            if (name, value) != ("stream", "false"):
                raise OpenAIError(400, f"{name} is not supported when retrieving a response", name)
        stored = self.store.get(response_id)
        if stored is None:
            raise OpenAIError(404, f"Response with id '{response_id}' not found.")
        return stored.response

    def delete(self, response_id: str) -> DeletedResponse:
        if not self.store.delete(response_id):
            raise OpenAIError(404, f"Response with id '{response_id}' not found.")
        return DeletedResponse(id=response_id)

    def _earlier_turns(self, previous_response_id: Optional[str]) -> list[ChatMessage]:
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise OpenAIError(404, f"Previous response with id '{previous_response_id}' not found (it was not "
                                   "stored, was deleted, or expired).", "previous_response_id")
        return stored.conversation

    def _finish(self, turn: _Turn) -> ResponseObject:
        final = turn.response()
        if turn.request.store and final.status in ("completed", "incomplete"):
            self.store.put(final, turn.conversation + [ChatMessage(role="assistant", content=turn.text)])
        return final

    async def _collect(self, stream: RequestStream, turn: _Turn) -> Response:
        try:
            async for output in stream:
                turn.add(output)
        finally:
            stream.close()
        return Response(self._finish(turn).model_dump_json(), media_type="application/json")

    async def _events(self, stream: RequestStream, turn: _Turn) -> AsyncIterator[str]:
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            body = json.dumps({"type": kind, "sequence_number": next(sequence), **fields})
            return f"event: {kind}\ndata: {body}\n\n"

        part = {"item_id": turn.message_id, "output_index": 0, "content_index": 0}

        def opening() -> list[str]:  # sent with the first token, so that a client timing it measures the prefill
            return [event("response.output_item.added", output_index=0, item=turn.message().model_dump()),
                    event("response.content_part.added", **part, part=OutputText(text="").model_dump())]

        yield event("response.created", response=turn.response().model_dump())
        yield event("response.in_progress", response=turn.response().model_dump())
        opened = False
        try:
            async for output in stream:
                added = turn.add(output)
                if not opened:
                    opened = True
                    for text in opening():
                        yield text
                if added:
                    yield event("response.output_text.delta", **part, delta=added, logprobs=[])
        except EngineError as e:  # the status line is long gone: the failure is the stream's last event
            failed = turn.response(ResponseError(code="server_error", message=str(e)))
            yield event("response.failed", response=failed.model_dump())
            return
        finally:
            stream.close()
        for text in [] if opened else opening():  # nothing came (aborted): still a well-formed stream
            yield text
        yield event("response.output_text.done", **part, text=turn.text, logprobs=[])
        yield event("response.content_part.done", **part, part=OutputText(text=turn.text).model_dump())
        yield event("response.output_item.done", output_index=0, item=turn.message().model_dump())
        final = self._finish(turn)
        yield event(f"response.{final.status}", response=final.model_dump())
