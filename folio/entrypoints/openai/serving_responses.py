"""The Responses API: POST /v1/responses (plain or streamed as typed events), GET and DELETE /v1/responses/{id}.

A response is one chat turn: its input items become chat messages (after the stored conversation of
`previous_response_id`, and after `instructions` as a system message), the chat template renders them with the
tools, and the engine generates the turn. Its output items are what the turn wrote: with a reasoning parser a
reasoning item for its reasoning, a message for its text, and a function_call item per tool call, read out of the
text as chat reads them (the server's tool_call_format; tool_choice's grammar, text.format's JSON or vLLM's
structured_outputs constrains it: output_constraint). Finished responses with `store` (the default) go to the
ResponseStore, calls and reasoning included, so that the next turn can answer them.

A stream is the event sequence OpenAI's clients assemble: response.created and response.in_progress at once; for
each output item as it starts, output_item.added (and a message's or reasoning's content_part.added); an
output_text.delta per piece of a message's text (reasoning_text.delta for reasoning), a
function_call_arguments.delta per piece of a call's arguments; the matching .done events as the item ends; and
response.completed (or response.incomplete when max_output_tokens ran out, response.failed when the engine failed).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import Request
from starlette.responses import Response, StreamingResponse

from folio.engine.async_llm import AsyncLLM, EngineError, RequestStream
from folio.engine.input_processor import check_prompt_fits
from folio.entrypoints.openai.errors import OpenAIError
from folio.entrypoints.openai.output_constraint import MessageFormat, output_constraint
from folio.entrypoints.openai.protocol import ChatMessage, ChatTool, FunctionCallRequest, TextPart, ToolCallRequest
from folio.entrypoints.openai.protocol_responses import (DeletedResponse, FunctionCallItem, InputItem, InputMessage,
                                                         OutputReasoningText, OutputText, ReasoningInputItem,
                                                         ResponseError, ResponseObject, ResponsesRequest)
from folio.entrypoints.openai.request_limits import RequestLimits
from folio.entrypoints.openai.responses_store import ResponseStore
from folio.entrypoints.openai.responses_turn import CallItem, Edit, MessageItem, Turn
from folio.entrypoints.openai.serving import cancel_on_disconnect, check_context, check_model
from folio.entrypoints.openai.reasoning_effort import effort_template_kwargs
from folio.entrypoints.openai.serving_chat import chat_prompt_text
from folio.entrypoints.openai.tool_grammar import ToolChoice, resolve_tool_choice
from folio.entrypoints.openai.tool_call_format import ToolCallFormat
from folio.entrypoints.openai.unsupported_fields import LOGPROBS
from folio.sampling_params import SamplingParams
from folio.structured_output.params import StructuredOutputsParams


_REASONING_UNFOLLOWED = "a reasoning item must be followed by the assistant message or function call it came before"


def chat_messages(items: Union[str, list[InputItem]]) -> list[ChatMessage]:
    """Input items as chat messages: a string is a user message; function calls after an assistant message (an
    earlier response's output sent back: its text, then its calls) join it as its tool_calls, as the stored turn
    has them; a function call's output is a tool message; a reasoning item is the reasoning_content of the
    assistant message or call that follows it (ValueError, as OpenAI's, where none does)."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    reasoning: Optional[str] = None  # of the assistant turn to come
    for index, item in enumerate(items):
        if reasoning is not None and not isinstance(item, (ReasoningInputItem, FunctionCallItem)) and \
                not (isinstance(item, InputMessage) and item.role == "assistant"):
            raise ValueError(f"input[{index - 1}]: {_REASONING_UNFOLLOWED}")
        if isinstance(item, ReasoningInputItem):
            reasoning = item.text if reasoning is None else f"{reasoning}\n\n{item.text}"
        elif isinstance(item, InputMessage):
            content = item.content if isinstance(item.content, str) else \
                [TextPart(type="text", text=part.text) for part in item.content]
            messages.append(ChatMessage(role=item.role, content=content, reasoning_content=reasoning))
            reasoning = None
        elif isinstance(item, FunctionCallItem):
            call = ToolCallRequest(id=item.call_id, type="function",
                                   function=FunctionCallRequest(name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant" and reasoning is None:
                messages[-1].tool_calls = (messages[-1].tool_calls or []) + [call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call], reasoning_content=reasoning))
            reasoning = None
        else:
            output = item.output if isinstance(item.output, str) else "".join(part.text for part in item.output)
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=output))
    if reasoning is not None:
        raise ValueError(f"input[{len(items) - 1}]: {_REASONING_UNFOLLOWED}")
    return messages


def _text_item_events(edit: Edit, event: Callable[..., str]) -> list[str]:
    """A message's or reasoning's events: each has one content part, output_text or reasoning_text (a message's
    with its tokens' logprobs)."""
    item, where = edit.item, {"output_index": edit.item.output_index}
    part = {"item_id": item.id, **where, "content_index": 0}
    kind, empty = ("output_text", OutputText(text="")) if isinstance(item, MessageItem) else \
        ("reasoning_text", OutputReasoningText(text=""))
    snapshot = None if edit.snapshot is None else edit.snapshot.model_dump()
    if edit.kind == "added":
        return [event("response.output_item.added", **where, item=snapshot),
                event("response.content_part.added", **part, part=empty.model_dump())]
    if edit.kind == "delta":
        logprobs = {"logprobs": [lp.model_dump() for lp in edit.logprobs]} if kind == "output_text" else {}
        return [event(f"response.{kind}.delta", **part, delta=edit.delta, **logprobs)]
    whole = snapshot["content"][0]
    logprobs = {"logprobs": whole["logprobs"]} if kind == "output_text" else {}
    return [event(f"response.{kind}.done", **part, text=whole["text"], **logprobs),
            event("response.content_part.done", **part, part=whole),
            event("response.output_item.done", **where, item=snapshot)]


def _events_of(edits: list[Edit], event: Callable[..., str]) -> list[str]:
    """The stream's events for a turn's edits."""
    texts = []
    for edit in edits:
        item, where = edit.item, {"output_index": edit.item.output_index}
        if not isinstance(item, CallItem):
            texts += _text_item_events(edit, event)
        elif edit.kind == "added":
            texts.append(event("response.output_item.added", **where, item=edit.snapshot.model_dump()))
        elif edit.kind == "delta":
            texts.append(event("response.function_call_arguments.delta", item_id=item.id, **where, delta=edit.delta))
        else:
            texts += [event("response.function_call_arguments.done", item_id=item.id, **where,
                            arguments=edit.snapshot.arguments),
                      event("response.output_item.done", **where, item=edit.snapshot.model_dump())]
    return texts


class OpenAIServingResponses:
    def __init__(self, llm: AsyncLLM, model_name: str, limits: RequestLimits, store: ResponseStore,
                 tool_format: ToolCallFormat, auto_tool_choice: bool = True) -> None:
        self.llm = llm
        self.tool_format = tool_format
        self.auto_tool_choice = auto_tool_choice  # whether tool_choice "auto" is served (ServerOptions)
        self.reasoning_parser = llm.engine.structured_output.reasoning_parser  # as chat's
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
            ids, params, tool_choice = await asyncio.to_thread(self._prompt_and_params, request, conversation)
        except ValueError as e:
            raise OpenAIError.bad_request(e, fields) from e
        parser = self.tool_format.reader_for(request.chat_tools() or [], tool_choice) \
            if self.tool_format.reads(tool_choice) else None
        reasoning = self.reasoning_parser
        turn = Turn(request, params, self.model_name, conversation, len(ids), parser,
                    reasoning.splitter(self.tokenizer, ids) if reasoning is not None else None)
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
                           conversation: list[ChatMessage]) -> tuple[list[int], SamplingParams, ToolChoice]:
        """The rendered, tokenized prompt (in a worker thread: templates, tokenizing and checking constraints take
        time), the SamplingParams, and tool_choice resolved; ValueError naming the field."""
        tools = request.chat_tools()
        tool_choice = resolve_tool_choice(tools, request.chat_tool_choice(), self.auto_tool_choice)
        constraint = self._constraint(request, tools, tool_choice)
        max_tokens = request.max_output_tokens
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {max_tokens}")
        ids = self._prompt_ids(request, conversation, tools)
        check_prompt_fits(len(ids), self.max_model_len, "input")
        if max_tokens is None:
            max_tokens = self.max_model_len - len(ids)
        check_context(len(ids), max_tokens, self.max_model_len, "max_output_tokens")
        reads_calls = tool_choice != "none"
        if reads_calls and request.logprobs is not None:  # (a call's tokens are not the message's text)
            asked = "include" if LOGPROBS in (request.include or ()) else "top_logprobs"
            raise ValueError(f"{asked} asks for the message's logprobs, "
                             "which are not given beside tool calls: set tool_choice to 'none', or leave them out")
        params = request.to_sampling_params(max_tokens, request.logprobs, structured_outputs=constraint)
        params = self.tool_format.reading(params) if self.tool_format.reads(tool_choice) else params
        return ids, params if self.reasoning_parser is None else self.reasoning_parser.reading(params), tool_choice

    def _prompt_ids(self, request: ResponsesRequest, conversation: list[ChatMessage],
                    tools: Optional[list[ChatTool]]) -> list[int]:
        """The prompt: instructions, conversation and tools through the chat template. With truncation "auto", as
        OpenAI's: the conversation's oldest messages dropped (a dropped call's results with it) until the prompt
        leaves room for max_output_tokens (one token where none is given); the last message stays."""
        system = [ChatMessage(role="system", content=request.instructions)] if request.instructions else []
        room = self.max_model_len - (request.max_output_tokens or 1)
        effort = None if request.reasoning is None else request.reasoning.effort
        template_kwargs = effort_template_kwargs(self.tokenizer, effort, "reasoning.effort")
        while True:
            text = chat_prompt_text(self.tokenizer, system + conversation, tools=tools, template_kwargs=template_kwargs)
            if request.truncation != "auto" or len(conversation) == 1:
                self.limits.text(text, "input")
                return self.tokenizer.encode(text, add_special_tokens=False)
            if len(text) <= self.limits.max_prompt_chars:  # (longer cannot fit: no need to tokenize it)
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if len(ids) <= room:
                    return ids
            drop = 1
            while drop < len(conversation) - 1 and conversation[drop].role == "tool":
                drop += 1
            conversation = conversation[drop:]

    def _constraint(self, request: ResponsesRequest, tools: Optional[list[ChatTool]],
                    tool_choice: ToolChoice) -> Optional[StructuredOutputsParams]:
        """vLLM's structured_outputs, text.format's JSON, tool_choice's grammar, or the last two together."""
        fmt = request.text.format if request.text is not None else None
        message_format = None if fmt is None or fmt.type == "text" else \
            MessageFormat("text.format", "text.format.schema", fmt.json_schema)
        return output_constraint(self.llm.engine.structured_output, self.tool_format, tools, tool_choice,
                                 request.parallel_tool_calls is not False, "tools[{}].parameters",
                                 request.structured_outputs_params(), message_format,
                                 request.structured_outputs_field)

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

    def _finish(self, turn: Turn) -> ResponseObject:
        final = turn.response()
        if turn.request.store and final.status in ("completed", "incomplete"):
            self.store.put(final, turn.conversation + turn.assistant_messages())
        return final

    async def _collect(self, stream: RequestStream, turn: Turn) -> Response:
        try:
            async for output in stream:
                turn.add(output)
        finally:
            stream.close()
        turn.finish()
        return Response(self._finish(turn).model_dump_json(), media_type="application/json")

    async def _events(self, stream: RequestStream, turn: Turn) -> AsyncIterator[str]:
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            body = json.dumps({"type": kind, "sequence_number": next(sequence), **fields})
            return f"event: {kind}\ndata: {body}\n\n"

        yield event("response.created", response=turn.response().model_dump())
        yield event("response.in_progress", response=turn.response().model_dump())
        try:
            async for output in stream:
                for text in _events_of(turn.add(output), event):
                    yield text
        except EngineError as e:  # the status line is long gone: the failure is the stream's last event
            failed = turn.response(ResponseError(code="server_error", message=str(e)))
            yield event("response.failed", response=failed.model_dump())
            return
        finally:
            stream.close()
        for text in _events_of(turn.finish(), event):  # (an empty message where nothing came: a well-formed stream)
            yield text
        final = self._finish(turn)
        yield event(f"response.{final.status}", response=final.model_dump())
