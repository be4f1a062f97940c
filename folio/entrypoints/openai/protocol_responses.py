"""Request and response bodies of the Responses API (/v1/responses), in the conventions of protocol.py.

A request takes chat's sampling fields, vLLM's extras included (extra_body with the openai client), except `n`
and `max_tokens`: a response has one output, and `max_output_tokens` is its limit. Input is text only: messages
(a plain string is one user message), and the function calls and their outputs of an earlier turn. Tools are
function tools (the Responses API's flat shape: name and parameters beside `type`); built-in tools (web search,
file search, ...) are refused, since nothing here runs them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator

from folio.entrypoints.openai.protocol import (BillingAndCacheHints, ChatLogProb, ChatTool, FunctionDefinition,
                                               NamedFunction, NamedToolChoice, RequestModel, SamplingRequest,
                                               text_parts_only)
from folio.entrypoints.openai.request_limits import RequestLimits
from folio.entrypoints.openai.unsupported_fields import LOGPROBS, RESPONSES_UNSUPPORTED


class InputTextPart(RequestModel):
    type: Literal["input_text", "output_text"]  # output_text: an earlier response's message sent back
    text: str


class InputMessage(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[InputTextPart]]

    _only_text = field_validator("content", mode="before")(text_parts_only("input_text", "output_text"))


class FunctionCallItem(RequestModel):
    """A function call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(RequestModel):
    """The result of a function call, sent by the client: text, or text parts."""

    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputTextPart]]

    _only_text = field_validator("output", mode="before")(text_parts_only("input_text", "output_text"))


class ReasoningText(RequestModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningSummaryText(RequestModel):
    type: Literal["summary_text"]
    text: str


class ReasoningInputItem(RequestModel):
    """An earlier turn's reasoning, sent back (clients and agent frameworks send the whole output): it goes to the
    assistant message or function call after it as `reasoning_content`, which reasoning models' templates read."""

    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[ReasoningSummaryText] = Field(default_factory=list)
    content: Optional[list[ReasoningText]] = None
    encrypted_content: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None

    @field_validator("encrypted_content")
    @classmethod
    def _no_encrypted_content(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            raise ValueError("encrypted reasoning is not supported: this server writes its reasoning as text")
        return value

    @property
    def text(self) -> str:
        """The reasoning text (its summary where the item has no content, as OpenAI's own items have it)."""
        parts = self.content if self.content is not None else self.summary
        return "\n\n".join(part.text for part in parts)


def _item_type(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("type", "message")  # an "easy" input message has no type
    return getattr(value, "type", None)


InputItem = Annotated[
    Union[Annotated[InputMessage, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")],
          Annotated[ReasoningInputItem, Tag("reasoning")]],
    Discriminator(_item_type, custom_error_type="input_item",
                  custom_error_message="input items must be messages, function_call, function_call_output or "
                                       "reasoning items (this server takes text only)")]


class FunctionTool(RequestModel):
    """A function the model may call: chat's function definition, flattened."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema; none: the function takes any object
    strict: Optional[bool] = None  # arguments always follow the schema here (they are constrained by it)

    @field_validator("type", mode="before")
    @classmethod
    def _function_tools_only(cls, kind: Any) -> Any:
        if kind != "function":
            raise ValueError(f"only function tools are supported (this server runs no built-in tools), got a tool "
                             f"of type {kind!r}")
        return kind

    def as_chat_tool(self) -> ChatTool:
        """The tool in chat's shape, which the chat template and the tool grammar take."""
        return ChatTool(type="function", function=FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters, strict=self.strict))


class FunctionToolChoice(RequestModel):
    """tool_choice naming a function: the output is one call of it."""

    type: Literal["function"]
    name: str

    def as_chat_tool_choice(self) -> NamedToolChoice:
        return NamedToolChoice(type="function", function=NamedFunction(name=self.name))


class TextFormat(RequestModel):
    """text.format: "text" (no constraint), "json_object", or "json_schema" with its schema beside the type."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None  # the output always follows the schema here

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "TextFormat":
        if (self.type == "json_schema") != (self.json_schema is not None and self.name is not None):
            raise ValueError("name and schema are required when type is 'json_schema', and only then")
        return self


class TextConfig(RequestModel):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None  # refused unless "medium" (unsupported_fields.RESPONSES_UNSUPPORTED)


class ReasoningConfig(RequestModel):
    effort: Optional[str] = None  # a template variable where the template reads one (reasoning_effort)
    summary: Optional[str] = None  # refused (unsupported_fields.RESPONSES_UNSUPPORTED): no summary is written
    generate_summary: Optional[str] = None  # (the deprecated name of summary)


class ResponsesRequest(SamplingRequest, BillingAndCacheHints):
    unsupported = RESPONSES_UNSUPPORTED

    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None  # a system message before the input; not carried to later turns
    max_output_tokens: Optional[int] = None
    previous_response_id: Optional[str] = None
    store: bool = True
    metadata: Optional[dict[str, str]] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionToolChoice, None] = None  # default: auto with tools
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    truncation: Optional[Literal["auto", "disabled"]] = None  # auto: the oldest messages go, to fit
    max_tool_calls: Optional[int] = None  # calls of built-in tools, and there are none here
    reasoning: Optional[ReasoningConfig] = None
    # refused unless empty, or asking for nothing missing (unsupported_fields.RESPONSES_UNSUPPORTED)
    background: Optional[bool] = None
    include: Optional[list[str]] = None  # LOGPROBS only
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None  # alternatives per token, with logprobs
    background_options: Optional[Any] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    context_management: Optional[Any] = None
    image: Optional[Any] = None
    access_programs: Optional[Any] = None
    moderation: Optional[Any] = None

    def check_limits(self, limits: RequestLimits) -> None:
        super().check_limits(limits)
        limits.tools(self.tools)

    def chat_tools(self) -> Optional[list[ChatTool]]:
        return None if self.tools is None else [tool.as_chat_tool() for tool in self.tools]

    @property
    def logprobs(self) -> Optional[int]:
        """The most likely tokens to return beside each of the message's (include LOGPROBS or top_logprobs ask for
        logprobs), or None."""
        if LOGPROBS in (self.include or ()) or self.top_logprobs is not None:
            return self.top_logprobs or 0
        return None

    @staticmethod
    def echoed(value: Union[str, BaseModel]) -> Union[str, dict[str, Any]]:
        """A field's value as the response echoes it."""
        return value.model_dump(by_alias=True, exclude_none=True) if isinstance(value, BaseModel) else value

    def chat_tool_choice(self) -> Union[str, NamedToolChoice, None]:
        choice = self.tool_choice
        return choice.as_chat_tool_choice() if isinstance(choice, FunctionToolChoice) else choice


# ---- the response ----------------------------------------------------------------------------------------

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatLogProb] = Field(default_factory=list)  # its tokens', where the request asked for them


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    """A call the model made: the client runs it and sends back a function_call_output item with its call_id."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"]


class OutputReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A reasoning model's reasoning (with a reasoning parser), as text: no summary is written."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[OutputReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Union[OutputReasoning, OutputMessage, OutputFunctionCall]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem]
    usage: Optional[ResponseUsage] = None
    incomplete_details: Optional[IncompleteDetails] = None
    error: Optional[ResponseError] = None
    # the request's settings, echoed
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    previous_response_id: Optional[str] = None
    store: bool
    temperature: float
    top_p: float
    metadata: dict[str, str] = Field(default_factory=dict)
    user: Optional[str] = None
    parallel_tool_calls: bool = True
    tool_choice: Union[str, dict[str, Any]] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Optional[str]] = Field(default_factory=lambda: {"effort": None, "summary": None})
    truncation: Literal["auto", "disabled"] = "disabled"


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
