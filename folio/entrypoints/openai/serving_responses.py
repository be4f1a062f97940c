"""The Responses API: POST /v1/responses (plain or streamed as typed events), GET and DELETE /v1/responses/{id}.

A response is one chat turn: its input items become chat messages (after the stored conversation of
`previous_response_id`, and after `instructions` as a system message), the chat template renders them with the
tools, and the engine generates the turn. Its output items are what the turn wrote: a message for its text, and a
function_call item per tool call, read out of the text as chat reads them (tool_parser; tool_choice's grammar,
text.format's JSON or vLLM's structured_outputs constrains it: output_constraint). Finished responses with `store`
(the default) go to the ResponseStore, calls included, so that the next turn can answer them.

A stream is the event sequence OpenAI's clients assemble: response.created and response.in_progress at once; for
each output item as it starts, output_item.added (and a message's content_part.added); an output_text.delta per
piece of a message's text, a function_call_arguments.delta per piece of a call's arguments; the matching .done
events as the item ends; and response.completed (or response.incomplete when max_output_tokens ran out,
response.failed when the engine failed).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal, Optional, Union

from fastapi import Request
from starlette.responses import Response, StreamingResponse

from folio.engine.async_llm import AsyncLLM, EngineError, RequestStream
from folio.engine.input_processor import check_prompt_fits
from folio.entrypoints.openai.errors import OpenAIError
from folio.entrypoints.openai.output_constraint import json_format, output_constraint
from folio.entrypoints.openai.protocol import ChatMessage, ChatTool, FunctionCallRequest, TextPart, ToolCallRequest
from folio.entrypoints.openai.request_limits import RequestLimits
from folio.entrypoints.openai.protocol_responses import (DeletedResponse, FunctionCallItem, IncompleteDetails,
                                                         InputItem, InputMessage, InputTokensDetails,
                                                         OutputFunctionCall, OutputItem, OutputMessage, OutputText,
                                                         ResponseError, ResponseObject, ResponsesRequest,
                                                         ResponseUsage)
from folio.entrypoints.openai.responses_store import ResponseStore
from folio.entrypoints.openai.serving import cancel_on_disconnect, check_context, check_model
from folio.entrypoints.openai.serving_chat import chat_prompt_ids
from folio.entrypoints.openai.tool_grammar import ToolChoice, resolve_tool_choice
from folio.entrypoints.openai.tool_parser import ToolCallParser
from folio.outputs import RequestOutput
from folio.sampling_params import SamplingParams
from folio.structured_output.params import StructuredOutputsParams

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
class _Message:
    """An output message: a run of the turn's text."""

    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    output_index: int = 0  # its place among the turn's items
    text: str = ""
    done: bool = False  # a tool call came after it

    def item(self, turn_status: str) -> OutputMessage:
        status = "completed" if self.done else {"in_progress": "in_progress", "completed": "completed"}.get(
            turn_status, "incomplete")
        return OutputMessage(id=self.id, status=status, content=[OutputText(text=self.text)])


@dataclass
class _Call:
    """An output function call, its arguments as they stream."""

    call_id: str
    name: str
    id: str = field(default_factory=lambda: f"fc_{uuid.uuid4().hex}")
    output_index: int = 0  # its place among the turn's items
    arguments: str = ""
    done: bool = False  # its closing tag came

    def item(self, turn_status: str) -> OutputFunctionCall:
        status = "completed" if self.done else "in_progress" if turn_status == "in_progress" else "incomplete"
        return OutputFunctionCall(id=self.id, call_id=self.call_id, name=self.name, arguments=self.arguments,
                                  status=status)


@dataclass
class Edit:
    """What an engine output did to one of the turn's items, for the stream's events."""

    kind: Literal["added", "delta", "done"]
    item: Union[_Message, _Call]
    delta: str = ""  # a "delta": the text or arguments it added


@dataclass
class _Turn:
    """One response while it is generated, and everything its ResponseObject is made of."""

    request: ResponsesRequest
    params: SamplingParams
    model_name: str
    conversation: list[ChatMessage]  # without the instructions
    prompt_tokens: int
    parser: Optional[ToolCallParser]  # where tool_choice is not "none": tool calls are read out of the text
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    items: list[Union[_Message, _Call]] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: Optional[str] = None

    def add(self, output: RequestOutput) -> list[Edit]:
        """Take one DELTA output: its text goes to the open message (a new one after a call), its tool calls to
        function_call items."""
        self.cached_tokens = output.num_cached_tokens
        text = ""
        for completion in output.outputs:
            text += completion.text
            self.output_tokens += len(completion.token_ids)
            self.finish_reason = completion.finish_reason
        content, calls = (text, []) if self.parser is None else \
            self.parser.feed(text, final=self.finish_reason is not None)
        edits: list[Edit] = []
        if content:
            if not self.items or not isinstance(self.items[-1], _Message):
                edits += self._open(_Message())
            self.items[-1].text += content
            edits.append(Edit("delta", self.items[-1], content))
        for delta in calls:
            if delta.id is not None:  # a call's first piece
                edits += self._open(_Call(call_id=delta.id, name=delta.function.name))
            call = self._calls()[delta.index]
            if delta.function.arguments:
                call.arguments += delta.function.arguments
                edits.append(Edit("delta", call, delta.function.arguments))
        for call in self._calls()[:self.parser.num_calls if self.parser else 0]:
            if not call.done:
                call.done = True
                edits.append(Edit("done", call))
        return edits

    def finish(self) -> list[Edit]:
        """The items still open, ended (an empty message where the turn wrote nothing)."""
        edits = self._open(_Message()) if not self.items else []
        return edits + [Edit("done", item) for item in self.items if not item.done]

    def _open(self, item: Union[_Message, _Call]) -> list[Edit]:
        edits = []
        if self.items and isinstance(self.items[-1], _Message) and not self.items[-1].done:
            self.items[-1].done = True  # a call ends the text before it
            edits.append(Edit("done", self.items[-1]))
        item.output_index = len(self.items)
        self.items.append(item)
        return edits + [Edit("added", item)]

    def _calls(self) -> list[_Call]:
        return [item for item in self.items if isinstance(item, _Call)]

    @property
    def text(self) -> str:
        return "".join(item.text for item in self.items if isinstance(item, _Message))

    @property
    def status(self) -> str:
        return {None: "in_progress", "stop": "completed", "length": "incomplete"}.get(self.finish_reason, "failed")

    def assistant_message(self) -> ChatMessage:
        """The turn as the next turn's template sees it."""
        calls = [ToolCallRequest(id=c.call_id, function=FunctionCallRequest(name=c.name, arguments=c.arguments))
                 for c in self._calls()]
        return ChatMessage(role="assistant", content=self.text or (None if calls else ""), tool_calls=calls or None)

    def output(self, status: str) -> list[OutputItem]:
        return [item.item(status) for item in self.items]

    def response(self, error: Optional[ResponseError] = None) -> ResponseObject:
        request, status = self.request, "failed" if error is not None else self.status
        usage = ResponseUsage(input_tokens=self.prompt_tokens,
                              input_tokens_details=InputTokensDetails(cached_tokens=self.cached_tokens),
                              output_tokens=self.output_tokens, total_tokens=self.prompt_tokens + self.output_tokens)
        text_format = request.text.format if request.text is not None else None
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, model=self.model_name,
            output=[] if status == "in_progress" else self.output(status),
            usage=None if status == "in_progress" else usage,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            error=error, instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id, store=request.store,
            temperature=self.params.temperature, top_p=self.params.top_p, metadata=request.metadata or {},
            user=request.user, parallel_tool_calls=request.parallel_tool_calls is not False,
            tool_choice=_dumped(request.tool_choice) or "auto",
            tools=[_dumped(tool) for tool in request.tools or ()],
            text={"format": _dumped(text_format) or {"type": "text"}})


def _dumped(value: Any) -> Any:
    """A request's field as the response echoes it."""
    return value.model_dump(by_alias=True, exclude_none=True) if hasattr(value, "model_dump") else value


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
            request.refuse_unsupported()
            request.check_limits(self.limits)
            if not request.input:
                raise ValueError("input must not be empty")
            conversation = self._earlier_turns(request.previous_response_id) + chat_messages(request.input)
            ids, params, reads_calls = await asyncio.to_thread(self._prompt_and_params, request, conversation)
        except ValueError as e:
            raise OpenAIError.bad_request(e, fields) from e
        parser = ToolCallParser() if reads_calls else None
        turn = _Turn(request, params, self.model_name, conversation, len(ids), parser)
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
                           conversation: list[ChatMessage]) -> tuple[list[int], SamplingParams, bool]:
        """The rendered, tokenized prompt (in a worker thread: templates, tokenizing and checking constraints take
        time), the SamplingParams, and whether tool calls are read from the output; ValueError naming the field."""
        tools = request.chat_tools()
        tool_choice = resolve_tool_choice(tools, request.chat_tool_choice())
        constraint = self._constraint(request, tools, tool_choice)
        system = [ChatMessage(role="system", content=request.instructions)] if request.instructions else []
        ids = chat_prompt_ids(self.tokenizer, self.limits, system + conversation, tools=tools, field="input")
        check_prompt_fits(len(ids), self.max_model_len, "input")
        max_tokens = request.max_output_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(ids)
        elif max_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {max_tokens}")
        check_context(len(ids), max_tokens, self.max_model_len, "max_output_tokens")
        return ids, request.to_sampling_params(max_tokens, structured_outputs=constraint), tool_choice != "none"

    def _constraint(self, request: ResponsesRequest, tools: Optional[list[ChatTool]],
                    tool_choice: ToolChoice) -> Optional[StructuredOutputsParams]:
        """At most one of vLLM's structured_outputs, text.format's JSON, and tool_choice's grammar."""
        manager = self.llm.engine.structured_output
        given = []
        if request.structured_outputs is not None:
            constraint = request.structured_outputs.to_params()
            manager.validate(constraint)
            given.append(("structured_outputs", constraint))
        fmt = request.text.format if request.text is not None else None
        if fmt is not None and fmt.type != "text":
            constraint = json_format(fmt.json_schema)
            manager.validate(constraint, "text.format.schema")
            given.append(("text.format", constraint))
        return output_constraint(manager, given, tools, tool_choice, request.parallel_tool_calls is not False,
                                 "tools[{}].parameters")

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
            self.store.put(final, turn.conversation + [turn.assistant_message()])
        return final

    async def _collect(self, stream: RequestStream, turn: _Turn) -> Response:
        try:
            async for output in stream:
                turn.add(output)
        finally:
            stream.close()
        turn.finish()
        return Response(self._finish(turn).model_dump_json(), media_type="application/json")

    async def _events(self, stream: RequestStream, turn: _Turn) -> AsyncIterator[str]:
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            body = json.dumps({"type": kind, "sequence_number": next(sequence), **fields})
            return f"event: {kind}\ndata: {body}\n\n"

        def events(edits: list[Edit]) -> list[str]:
            """Each edit's events (a message has one content part)."""
            texts = []
            for edit in edits:
                item, where = edit.item, {"output_index": edit.item.output_index}
                if edit.kind != "delta":  # (not per delta: the item holds all its text so far)
                    whole = item.item(turn.status if edit.kind == "done" else "in_progress").model_dump()
                if isinstance(item, _Message):
                    part = {"item_id": item.id, **where, "content_index": 0}
                    if edit.kind == "added":
                        texts += [event("response.output_item.added", **where, item=whole),
                                  event("response.content_part.added", **part, part=OutputText(text="").model_dump())]
                    elif edit.kind == "delta":
                        texts.append(event("response.output_text.delta", **part, delta=edit.delta, logprobs=[]))
                    else:
                        texts += [event("response.output_text.done", **part, text=item.text, logprobs=[]),
                                  event("response.content_part.done", **part,
                                        part=OutputText(text=item.text).model_dump()),
                                  event("response.output_item.done", **where, item=whole)]
                elif edit.kind == "added":
                    texts.append(event("response.output_item.added", **where, item=whole))
                elif edit.kind == "delta":
                    texts.append(event("response.function_call_arguments.delta", item_id=item.id, **where,
                                       delta=edit.delta))
                else:
                    texts += [event("response.function_call_arguments.done", item_id=item.id, **where,
                                    arguments=item.arguments),
                              event("response.output_item.done", **where, item=whole)]
            return texts

        yield event("response.created", response=turn.response().model_dump())
        yield event("response.in_progress", response=turn.response().model_dump())
        try:
            async for output in stream:
                for text in events(turn.add(output)):
                    yield text
        except EngineError as e:  # the status line is long gone: the failure is the stream's last event
            failed = turn.response(ResponseError(code="server_error", message=str(e)))
            yield event("response.failed", response=failed.model_dump())
            return
        finally:
            stream.close()
        for text in events(turn.finish()):  # (an empty message where nothing came: still a well-formed stream)
            yield text
        final = self._finish(turn)
        yield event(f"response.{final.status}", response=final.model_dump())
