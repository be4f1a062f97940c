"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests are strict where OpenAI is (`"stream": 0` or `"n": "2"` is a 400, not a silent conversion) and
reject NaN/Infinity, which Python's JSON parser accepts but no sampler can use. Value ranges are left to
SamplingParams, so the API and the Python engine give the same error for the same bad value. Unknown
fields are ignored, as vLLM does, because clients send fields of newer API versions.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from folio.sampling_params import SamplingParams

MAX_N = 16  # completions per prompt; more would let one request monopolise the batch


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(RequestModel):
    include_usage: Optional[bool] = False


class SamplingRequest(RequestModel):
    """Fields that completions and chat share, turned into SamplingParams in one place."""

    model: Optional[str] = None
    n: Optional[int] = 1
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    # vLLM's extra sampling parameters (extra_body with the openai client)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: Optional[str] = None  # keeps this request's prompt out of other tenants' prefix-cache hits

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_tokens: int, logprobs: Optional[int] = None,
                           prompt_logprobs: Optional[int] = None) -> SamplingParams:
        """SamplingParams for this request; raises ValueError naming the field for a bad value."""
        n = 1 if self.n is None else self.n
        if n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {n}")
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                 "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                 "repetition_penalty": self.repetition_penalty}
        return SamplingParams(
            n=n, max_tokens=max_tokens, stop=self.stop, seed=self.seed, logit_bias=self.logit_bias,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, **{k: v for k, v in given.items() if v is not None})


# ---- completions -----------------------------------------------------------------------------------------

class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    suffix: Optional[str] = None  # fill-in-the-middle: for code models with FIM tokens
    echo: bool = False
    logprobs: Optional[int] = None  # legacy completions: how many top tokens per position
    # beam search (vLLM's extra): beam width max(n, best_of), the n best beams returned
    use_beam_search: bool = False
    best_of: Optional[int] = None
    length_penalty: float = 1.0

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens may be 0 only with echo (to score the prompt)")
        return self

    @model_validator(mode="after")
    def _best_of_is_beam_width(self) -> "CompletionRequest":
        if self.best_of is not None and not self.use_beam_search:
            raise ValueError("best_of is supported as the beam width of use_beam_search only")
        if self.use_beam_search and (self.stream or self.echo or self.logprobs is not None):
            raise ValueError("use_beam_search cannot be combined with stream, echo or logprobs")
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise ValueError("best_of must be >= n")
        return self


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None  # vLLM's extra: the stop string or token id that ended it


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionResponse(BaseModel):
    """A whole completion, and also the shape of each streamed chunk (OpenAI uses the same object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


# ---- chat ------------------------------------------------------------------------------------------------

class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCall(RequestModel):
    """A call an assistant message made, sent back by the client with the rest of the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCall


def text_parts_only(*text_types: str) -> Callable[[Any], Any]:
    """A validator refusing content parts of other types up front: as a union member they would fail with
    pydantic's opaque union message."""

    def check(content: Any) -> Any:
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind is not None and kind not in text_types:
                    raise ValueError(f"only text content is supported, got a content part of type {kind!r}")
        return content

    return check


class ChatMessage(RequestModel):
    """Every message shape of the Chat Completions API. `developer` is OpenAI's newer name for `system`; a tool
    result comes as a `tool` message naming the call it answers; an assistant message that called tools may
    have no content."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None

    _only_text = field_validator("content", mode="before")(text_parts_only("text"))

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content is required in a {self.role} message (only an assistant message with "
                             "tool_calls may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages only")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    def to_template_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class FunctionDefinition(RequestModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema
    strict: Optional[bool] = None


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None  # e.g. {"enable_thinking": false} for Qwen3
    tools: Optional[list[ChatTool]] = None  # rendered by the chat template; calls come back as text
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    response_format: Optional[ResponseFormat] = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return self

    # What needs structured output (a grammar over the sampler) is refused until folio has it.
    @field_validator("tool_choice")
    @classmethod
    def _unconstrained_tool_choice(cls, value: Any) -> Any:
        if value == "required" or isinstance(value, dict):
            raise ValueError("'required' or a named function needs structured output, which this server does not "
                             "support yet; use 'auto' or 'none'")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_response_format(cls, value: Optional[ResponseFormat]) -> Optional[ResponseFormat]:
        if value is not None and value.type != "text":
            raise ValueError(f"{value.type!r} needs structured output, which this server does not support yet; "
                             "use 'text'")
        return value


class TopLogProb(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogProb(TopLogProb):
    top_logprobs: list[TopLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(BaseModel):
    content: Optional[list[ChatLogProb]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatChoiceLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        """OpenAI's deltas carry only what changed: {"role": ...} first, then {"content": ...}."""
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


# ---- models, tokenizer endpoints -------------------------------------------------------------------------

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "folio"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    """Either a prompt, or chat messages rendered with the chat template first."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    tools: Optional[list[ChatTool]] = None  # with messages: rendered by the chat template as chat does
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages (they are rendered by the chat template)")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
