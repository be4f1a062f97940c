"""One response of the Responses API while it is generated: the output items its text makes, and what each engine
output did to them (for the stream's events).

With a reasoning parser, the text's reasoning is read out first (folio.reasoning_parser): it makes a reasoning
item, ended when the answer begins. The rest goes through a tool-call reader where tool_choice is not "none": its
pieces, in the order written, make the items. Content goes to the open message item (a new one after a call); a
call's first delta opens a function_call item and its end closes it; a call opening closes the message before it.
So a turn that writes "<think>Paris.</think>Checking.\n<tool_call>...</tool_call>" is [reasoning, message,
function_call], in that order, whatever tokens arrive together.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from folio.entrypoints.openai.protocol import (ChatLogProb, ChatMessage, DeltaToolCall, FunctionCallRequest,
                                               ToolCallRequest)
from folio.entrypoints.openai.protocol_responses import (IncompleteDetails, InputTokensDetails, OutputFunctionCall,
                                                         OutputItem, OutputMessage, OutputReasoning,
                                                         OutputReasoningText, OutputText, OutputTokensDetails,
                                                         ResponseError, ResponseObject, ResponsesRequest,
                                                         ResponseUsage)
from folio.entrypoints.openai.serving import token_logprobs
from folio.entrypoints.openai.tool_parser import CallEnd, ToolCallReader
from folio.outputs import RequestOutput
from folio.reasoning_split import OutputSplitter
from folio.sampling_params import SamplingParams

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def text_item_status(done: bool, turn_status: str) -> ItemStatus:
    """A message's or reasoning's status while the turn has turn_status: an item the turn went on after is
    complete; the last one is as complete as the turn (a turn that failed or ran out of tokens leaves it
    incomplete)."""
    if done or turn_status == "completed":
        return "completed"
    return "in_progress" if turn_status == "in_progress" else "incomplete"


@dataclass
class ReasoningItem:
    """The turn's reasoning: the text before the closing tag."""

    output_index: int
    id: str = field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    text: str = ""
    done: bool = False  # the answer came after it

    def item(self, turn_status: str) -> OutputReasoning:
        return OutputReasoning(id=self.id, status=text_item_status(self.done, turn_status),
                               content=[OutputReasoningText(text=self.text)])

    def opened(self) -> OutputReasoning:
        """The item as output_item.added shows it: its one part is added next, empty."""
        return OutputReasoning(id=self.id, status="in_progress", content=[])


@dataclass
class MessageItem:
    """An output message: a run of the turn's text."""

    output_index: int  # its place among the turn's items
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    text: str = ""
    logprobs: list[ChatLogProb] = field(default_factory=list)  # its tokens', where the request asked for them
    done: bool = False  # a tool call came after it

    def item(self, turn_status: str) -> OutputMessage:
        return OutputMessage(id=self.id, status=text_item_status(self.done, turn_status),
                             content=[OutputText(text=self.text, logprobs=list(self.logprobs))])

    def opened(self) -> OutputMessage:
        """The item as output_item.added shows it: its one part is added next, empty."""
        return OutputMessage(id=self.id, status="in_progress", content=[])


@dataclass
class CallItem:
    """An output function call, its arguments as they stream."""

    output_index: int
    call_id: str
    name: str
    id: str = field(default_factory=lambda: f"fc_{uuid.uuid4().hex}")
    arguments: str = ""
    done: bool = False  # its closing tag came

    def item(self, turn_status: str) -> OutputFunctionCall:
        """The item as the response shows it while the turn has turn_status (a call cut short is incomplete)."""
        status = "completed" if self.done else "in_progress" if turn_status == "in_progress" else "incomplete"
        return OutputFunctionCall(id=self.id, call_id=self.call_id, name=self.name, arguments=self.arguments,
                                  status=status)

    def opened(self) -> OutputFunctionCall:
        """The item as output_item.added shows it: the arguments come in the deltas."""
        return OutputFunctionCall(id=self.id, call_id=self.call_id, name=self.name, arguments="",
                                  status="in_progress")


Item = Union[ReasoningItem, MessageItem, CallItem]


@dataclass
class Edit:
    """What an engine output did to one of the turn's items: "added" and "done" with the item as it was then
    (`snapshot`: later text must not show in an earlier event), "delta" with the text or arguments it added."""

    kind: Literal["added", "delta", "done"]
    item: Item
    delta: str = ""
    logprobs: list[ChatLogProb] = field(default_factory=list)  # a message delta's tokens'
    snapshot: Optional[OutputItem] = None


@dataclass
class Turn:
    """One response while it is generated, and everything its ResponseObject is made of."""

    request: ResponsesRequest
    params: SamplingParams
    model_name: str
    conversation: list[ChatMessage]  # without the instructions
    prompt_tokens: int
    parser: Optional[ToolCallReader]  # where the tool-call format reads the output (ToolCallFormat.reads)
    splitter: Optional[OutputSplitter] = None  # with a reasoning parser: the reasoning is read out first
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    items: list[Item] = field(default_factory=list)
    pending_logprobs: list[ChatLogProb] = field(default_factory=list)  # of tokens whose text has not come yet
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: Optional[str] = None

    def add(self, output: RequestOutput) -> list[Edit]:
        """Take one DELTA output (a response has one completion)."""
        self.cached_tokens = output.num_cached_tokens
        edits: list[Edit] = []
        for completion in output.outputs:
            self.output_tokens += len(completion.token_ids)
            self.finish_reason = completion.finish_reason
            final = self.finish_reason is not None
            text, answer = completion.text, range(len(completion.token_ids))  # the answer's text, and its tokens
            if self.splitter is not None:
                split = self.splitter.feed(text, completion.token_ids, final)
                text, answer = split.content, split.logprob_tokens(len(completion.token_ids), with_reasoning=False)
                self.reasoning_tokens += split.num_reasoning_tokens
                edits += self._reasoning(split.reasoning)
            if completion.logprobs is not None:  # (asked for without tools only: then the answer is the message)
                self.pending_logprobs += token_logprobs([completion.token_ids[i] for i in answer],
                                                        [completion.logprobs[i] for i in answer],
                                                        self.request.logprobs or 0)
            for piece in [text] if self.parser is None else self.parser.pieces(text, final=final):
                if isinstance(piece, str):
                    edits += self._text(piece)
                elif isinstance(piece, CallEnd):
                    call = self._calls()[piece.index]
                    call.done = True
                    edits.append(Edit("done", call, snapshot=call.item(self.status)))
                else:
                    edits += self._call_piece(piece)
        return edits

    def _reasoning(self, text: str) -> list[Edit]:
        """Reasoning: to the reasoning item, opened by its first text."""
        if not text:
            return []
        edits = [] if self.items else self._open(ReasoningItem(0))
        reasoning = self.items[0]
        reasoning.text += text
        return edits + [Edit("delta", reasoning, text)]

    def _text(self, text: str) -> list[Edit]:
        """Content: to the open message, or a new one (after a call or the reasoning), with the logprobs of the
        tokens so far."""
        if not text:
            return []
        edits = []
        if not self.items or not isinstance(self.items[-1], MessageItem):
            edits += self._open(MessageItem(len(self.items)))
        message, logprobs = self.items[-1], self.pending_logprobs
        message.text += text
        message.logprobs += logprobs
        self.pending_logprobs = []
        return edits + [Edit("delta", message, text, logprobs)]

    def _call_piece(self, delta: DeltaToolCall) -> list[Edit]:
        """A call's first piece opens its item; every piece adds to its arguments."""
        edits = self._open(CallItem(len(self.items), delta.id, delta.function.name)) if delta.id is not None else []
        call = self._calls()[delta.index]
        if delta.function.arguments:
            call.arguments += delta.function.arguments
            edits.append(Edit("delta", call, delta.function.arguments))
        return edits

    def finish(self) -> list[Edit]:
        """The items still open, ended (an empty message where the turn wrote no message or call, holding the
        logprobs of tokens that wrote no text)."""
        answered = any(isinstance(item, (MessageItem, CallItem)) for item in self.items)
        # (a reasoning cut off stays as complete as the turn: the empty message does not end it)
        edits = [] if answered else self._open(MessageItem(len(self.items)), end_last=False)
        if self.pending_logprobs and isinstance(self.items[-1], MessageItem):
            edits.append(Edit("delta", self.items[-1], "", self.pending_logprobs))
            self.items[-1].logprobs += self.pending_logprobs
            self.pending_logprobs = []
        return edits + [Edit("done", item, snapshot=item.item(self.status)) for item in self.items if not item.done]

    def _open(self, item: Item, end_last: bool = True) -> list[Edit]:
        """Add an item, ending the message or reasoning before it (unless end_last is false)."""
        edits = []
        last = self.items[-1] if self.items else None
        if end_last and isinstance(last, (ReasoningItem, MessageItem)) and not last.done:
            last.done = True  # a call ends the text before it, the answer the reasoning
            edits.append(Edit("done", last, snapshot=last.item(self.status)))
        self.items.append(item)
        return edits + [Edit("added", item, snapshot=item.opened())]

    def _calls(self) -> list[CallItem]:
        """The call items, by the parser's call index."""
        return [item for item in self.items if isinstance(item, CallItem)]

    @property
    def status(self) -> str:
        """The response's status: an output that ended for another reason than its stop or its length (an
        abort) failed."""
        return {None: "in_progress", "stop": "completed", "length": "incomplete"}.get(self.finish_reason, "failed")

    def assistant_messages(self) -> list[ChatMessage]:
        """The turn as the next turn's template sees it: an assistant message per message item, the calls after
        it as its tool_calls, the reasoning as the first one's reasoning_content (as serving_responses.chat_messages
        reads the same items sent back)."""
        messages: list[ChatMessage] = []
        reasoning = None
        for item in self.items:
            if isinstance(item, ReasoningItem):
                reasoning = item.text
            elif isinstance(item, MessageItem):
                messages.append(ChatMessage(role="assistant", content=item.text))
            else:
                call = ToolCallRequest(id=item.call_id, function=FunctionCallRequest(name=item.name,
                                                                                     arguments=item.arguments))
                if messages:
                    messages[-1].tool_calls = (messages[-1].tool_calls or []) + [call]
                else:
                    messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        if reasoning is not None:  # (finish() made an answer: a message where there was nothing else)
            messages[0].reasoning_content = reasoning
        return messages

    def response(self, error: Optional[ResponseError] = None) -> ResponseObject:
        """The response as it stands (no output while in progress), the request's settings echoed."""
        request, status = self.request, "failed" if error is not None else self.status
        usage = ResponseUsage(input_tokens=self.prompt_tokens,
                              input_tokens_details=InputTokensDetails(cached_tokens=self.cached_tokens),
                              output_tokens=self.output_tokens, total_tokens=self.prompt_tokens + self.output_tokens,
                              output_tokens_details=OutputTokensDetails(reasoning_tokens=self.reasoning_tokens))
        text_format = request.text.format if request.text is not None else None
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, model=self.model_name,
            output=[] if status == "in_progress" else [item.item(status) for item in self.items],
            usage=None if status == "in_progress" else usage,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            error=error, instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id, store=request.store,
            temperature=self.params.temperature, top_p=self.params.top_p, metadata=request.metadata or {},
            user=request.user, parallel_tool_calls=request.parallel_tool_calls is not False,
            tool_choice="auto" if request.tool_choice is None else request.echoed(request.tool_choice),
            tools=[request.echoed(tool) for tool in request.tools or ()],
            text={"format": {"type": "text"} if text_format is None else request.echoed(text_format)},
            reasoning={"effort": request.reasoning.effort if request.reasoning is not None else None,
                       "summary": None},
            truncation=request.truncation or "disabled")
