"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests are strict where OpenAI is (`"stream": 0` or `"n": "2"` is a 400, not a silent conversion) and
reject NaN/Infinity, which Python's JSON parser accepts but no sampler can use. Value ranges are left to
SamplingParams, so the API and the Python engine give the same error for the same bad value. OpenAI's fields
that ask for what this server lacks (audio, legacy function calling, reasoning controls...) are declared and
refused when set (unsupported_fields, with why); those that only hint at billing, retention or caching are declared
and accepted (`BillingAndCacheHints`: they change nothing an open model returns). Other fields are ignored, as
vLLM does, because clients send fields of newer API versions, and the server log names them. A request body is
refused if any of its strings holds a lone UTF-16 surrogate ("\ud800", which JSON allows): it is not text,
and the tokenizer cannot encode it. Sizes that a server option bounds are checked by `check_limits`.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from typing import Annotated, Any, Callable, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_serializer, model_validator

from folio.entrypoints.openai.request_limits import RequestLimits
from folio.entrypoints.openai.unsupported_fields import CHAT_UNSUPPORTED, SAMPLING_UNSUPPORTED, Unsupported
from folio.sampling_params import SamplingParams
from folio.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_N = 16  # completions per prompt; more would let one request monopolise the batch


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_path(body: Any) -> Optional[str]:
    """Where in a parsed JSON body a string (a value or a key) holds a lone surrogate, or None. Iterative: a
    deeply nested body must not exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _LONE_SURROGATE.search(value):
                return (path or "body").encode("utf-8", "backslashreplace").decode()  # a key in it may be the one
        elif isinstance(value, dict):
            for key, item in value.items():
                item_path = f"{path}.{key}" if path else str(key)
                stack.extend(((item_path, key), (item_path, item)))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


_warned_unknown: set[str] = set()  # field names the log has named (each once: a client sends them every time)
_MAX_WARNED = 256  # names remembered at most; then no new one is named (random names cannot fill memory)


class RequestBody(RequestModel):
    """A whole request body: its strings must be valid Unicode; `unsupported` fields are refused when set."""

    unsupported: ClassVar[tuple[Unsupported, ...]] = ()

    def refuse_unsupported(self) -> None:
        """ValueError naming the first unsupported field the request sets."""
        for field in self.unsupported:
            field.check(self)

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and len(_warned_unknown) < _MAX_WARNED:
            new = data.keys() - _known_fields(cls) - _warned_unknown
            if new:
                _warned_unknown.update(new)
                logger.warning("%s: ignoring fields this server does not know: %s (logged once each)", cls.__name__,
                               ", ".join(sorted(repr(name)[:80] for name in new)))
        return data

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = lone_surrogate_path(data)
        if path is not None:
            raise ValueError(f"{path} holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair), "
                             "which is not valid Unicode text")
        return data


@functools.cache
def _known_fields(model: type[BaseModel]) -> frozenset[str]:
    """The names a request model takes, aliases included (computed once per model)."""
    return frozenset(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


class StreamOptions(RequestModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False  # vLLM's: with include_usage, the usage so far in every chunk


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs` body field: exactly one constraint (folio.structured_output.params)."""

    json_schema: Union[str, dict, None] = Field(None, alias="json")  # "json" would shadow BaseModel.json
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def to_params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(**self.model_dump(exclude_none=True, by_alias=True))


class SamplingRequest(RequestBody):
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
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: Optional[str] = None  # keeps this request's prompt out of other tenants' prefix-cache hits
    structured_outputs: Optional[StructuredOutputsRequest] = None
    # vLLM's earlier names of structured_outputs' constraints (guided decoding), which many clients still send
    guided_json: Union[str, dict, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None  # accepted whatever it names: there is one backend, llguidance
    guided_whitespace_pattern: Optional[str] = None  # refused when set
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None  # the prompt's last k tokens (-1: as many as fit); not on responses
    return_token_ids: Optional[bool] = None  # the prompt's and each choice's token ids in the response
    return_tokens_as_token_ids: Optional[bool] = None  # logprobs' tokens written "token_id:<id>"
    prompt_logprobs: Optional[int] = None  # the top-k logprobs at each prompt position, and the prompt token's
    # vLLM's other extras: refused when set (unsupported_fields.SAMPLING_UNSUPPORTED)
    logits_processors: Optional[Any] = None
    kv_transfer_params: Optional[Any] = None
    vllm_xargs: Optional[Any] = None

    unsupported = SAMPLING_UNSUPPORTED
    _guided_field: Optional[str] = PrivateAttr(None)  # the guided_* field mapped into structured_outputs

    @model_validator(mode="after")
    def _guided_fields_are_structured_outputs(self) -> "SamplingRequest":
        guided = {kind: getattr(self, f"guided_{kind}") for kind in ("json", "regex", "choice", "grammar")}
        guided = {kind: value for kind, value in guided.items() if value is not None}
        if guided:
            sent = [f"guided_{kind}" for kind in guided]
            if self.structured_outputs is not None:
                sent.append("structured_outputs")
            if len(sent) > 1:
                raise ValueError(f"{' and '.join(sent)} each constrain the output: give one of them")
            self.structured_outputs = StructuredOutputsRequest.model_validate(guided)
            self._guided_field = f"guided_{next(iter(guided))}"
        return self

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The structured_outputs field (guided_* mapped into it) as the engine takes it, or None; ValueError
        naming the field the client sent."""
        if self.structured_outputs is None:
            return None
        try:
            return self.structured_outputs.to_params()
        except ValueError as e:
            if self._guided_field is None:
                raise
            kind = self._guided_field.removeprefix("guided_")  # (the params name their own field)
            raise ValueError(str(e).replace(f"structured_outputs.{kind}", self._guided_field, 1)) from None

    @property
    def structured_outputs_field(self) -> Optional[str]:
        """Where the constraint came from, for errors: a guided_* field, or None for structured_outputs."""
        return self._guided_field

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def check_limits(self, limits: RequestLimits) -> None:
        """The sizes a server option bounds; ValueError naming the field."""
        limits.stop([self.stop] if isinstance(self.stop, str) else self.stop)
        limits.stop(self.bad_words, "bad_words")
        limits.logit_bias(self.logit_bias)
        limits.token_id_set(self.stop_token_ids, "stop_token_ids")
        limits.token_id_set(self.allowed_token_ids, "allowed_token_ids")

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def usage_in_every_chunk(self) -> bool:
        return self.include_usage_in_stream and bool(self.stream_options.continuous_usage_stats)

    def to_sampling_params(self, max_tokens: int, logprobs: Optional[int] = None,
                           prompt_logprobs: Optional[int] = None,
                           structured_outputs: Optional[StructuredOutputsParams] = None) -> SamplingParams:
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
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured_outputs=structured_outputs,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            **{k: v for k, v in given.items() if v is not None})


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

    def check_limits(self, limits: RequestLimits) -> None:
        super().check_limits(limits)
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            limits.prompt_count(len(self.prompt))

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens may be 0 only with echo (to score the prompt)")
        return self

    @model_validator(mode="after")
    def _best_of_is_beam_width(self) -> "CompletionRequest":
        if self.best_of is not None and not self.use_beam_search:
            raise ValueError("best_of is supported as the beam width of use_beam_search only")
        if self.use_beam_search and (self.stream or self.echo or self.logprobs is not None
                                     or self.structured_outputs is not None or self.allowed_token_ids is not None
                                     or self.bad_words is not None or self.return_token_ids
                                     or self.prompt_logprobs is not None):
            raise ValueError("use_beam_search cannot be combined with stream, echo, logprobs, structured_outputs, "
                             "allowed_token_ids, bad_words, return_token_ids or prompt_logprobs")
        if self.prompt_logprobs is not None and self.echo and self.logprobs is not None:
            raise ValueError("prompt_logprobs cannot be combined with echo and logprobs, which give the prompt's "
                             "logprobs in the choice's logprobs")
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise ValueError("best_of must be >= n")
        return self


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class OmitsNullExtras(BaseModel):
    """A response model whose optional fields `omitted_when_null` are left out where they are null (rather than
    sent as null), so that a response without them has the shape OpenAI's has."""

    omitted_when_null: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _without_null_extras(self, handler: Any):  # (no return type: the schema stays the fields')
        data = handler(self)
        for name in self.omitted_when_null:
            if data.get(name, 0) is None:
                del data[name]
        return data


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: a token's logprob at a prompt position, its rank and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


PromptLogprobs = Optional[list[Optional[dict[int, PromptLogprob]]]]  # per prompt position; the first has none


class CompletionChoice(OmitsNullExtras):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None  # vLLM's extra: the stop string or token id that ended it
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids (streamed: in the choice's first chunk)
    token_ids: Optional[list[int]] = None  # with return_token_ids: the generated tokens (streamed: the chunk's)
    prompt_logprobs: PromptLogprobs = None  # with prompt_logprobs (streamed: in the choice's first chunk)
    omitted_when_null: ClassVar[tuple[str, ...]] = ("prompt_token_ids", "token_ids", "prompt_logprobs")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # completion tokens up to the end of the reasoning, its closing tag included


class UsageInfo(OmitsNullExtras):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    completion_tokens_details: Optional[CompletionTokensDetails] = None  # with a reasoning parser only
    omitted_when_null: ClassVar[tuple[str, ...]] = ("completion_tokens_details",)


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


class FunctionCallRequest(RequestModel):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallRequest(RequestModel):
    """A call an assistant message made, sent back by the client with the rest of the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallRequest


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
    tool_calls: Optional[list[ToolCallRequest]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None  # an assistant turn's reasoning, as the server gave it
    reasoning: Optional[str] = None  # vLLM's newer name for it

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
        if (self.reasoning_content is not None or self.reasoning is not None) and self.role != "assistant":
            raise ValueError("reasoning belongs to assistant messages only")
        if None not in (self.reasoning_content, self.reasoning) and self.reasoning_content != self.reasoning:
            raise ValueError("reasoning and reasoning_content differ: an assistant message has one reasoning (this "
                             "server gives it under both names)")
        return self

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (the tokenizer parses tool-call arguments for them). Reasoning is
        `reasoning_content`, the name Qwen3's and DeepSeek-R1's templates read, and `thinking`, GPT-OSS's (its
        template renders it as the analysis message before the turn's call)."""
        message = self.model_dump(exclude_none=True, exclude={"reasoning"})
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if "reasoning_content" in message:
            message["thinking"] = message["reasoning_content"]
        return message


class FunctionDefinition(RequestModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema; none: the function takes any object
    strict: Optional[bool] = None  # arguments always follow the schema here (they are constrained by it)


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None  # the output always follows the schema here


class ResponseFormat(RequestModel):
    """OpenAI's response_format: "text" (no constraint), "json_object" or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required when type is 'json_schema', and only then")
        return self


class BillingAndCacheHints(RequestModel):
    """OpenAI's request fields that steer its billing, data retention, prompt caching or abuse tracking: accepted,
    and without effect here (folio's prefix cache is automatic; `cache_salt` scopes it)."""

    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    prompt_cache_retention: Optional[str] = None
    safety_identifier: Optional[str] = None


class ChatCompletionRequest(SamplingRequest, BillingAndCacheHints):
    unsupported = CHAT_UNSUPPORTED

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[ChatTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None  # default: auto with tools
    parallel_tool_calls: Optional[bool] = True
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: continue the last message (add_generation_prompt false)
    chat_template_kwargs: Optional[dict[str, Any]] = None  # e.g. {"enable_thinking": false} for Qwen3
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning model's reasoning out of the response
    reasoning_effort: Optional[str] = None  # a chat template variable (folio.entrypoints.openai.reasoning_effort)
    metadata: Optional[dict[str, str]] = None  # kept with a stored completion, and none is stored
    # refused when set (unsupported_fields.CHAT_UNSUPPORTED)
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[Any] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    verbosity: Optional[Any] = None
    store: Optional[Any] = None
    moderation: Optional[Any] = None
    echo: Optional[Any] = None  # vLLM's chat extras
    documents: Optional[Any] = None
    add_special_tokens: Optional[Any] = None
    use_beam_search: Optional[Any] = None
    best_of: Optional[Any] = None
    length_penalty: Optional[Any] = None
    chat_template: Optional[Any] = None
    mm_processor_kwargs: Optional[Any] = None

    def check_limits(self, limits: RequestLimits) -> None:
        super().check_limits(limits)
        limits.tools(self.tools)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return self


class TopLogProb(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogProb(TopLogProb):
    top_logprobs: list[TopLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(BaseModel):
    content: Optional[list[ChatLogProb]] = None


class WithoutNulls(BaseModel):
    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        """OpenAI's deltas carry only what changed: {"role": ...} first, then {"content": ...}."""
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(WithoutNulls):
    name: Optional[str] = None  # in a call's first delta
    arguments: Optional[str] = None  # the next piece of the arguments' JSON text


class DeltaToolCall(WithoutNulls):
    index: int  # which call of the choice this piece belongs to
    id: Optional[str] = None  # in a call's first delta
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall


class AssistantMessage(OmitsNullExtras):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]  # None when the model only called tools
    tool_calls: Optional[list[ToolCall]] = None
    # A reasoning model's reasoning (with a reasoning parser): under vLLM's name, and under the older one that
    # DeepSeek's API and many clients read. Left out when there is none.
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None
    omitted_when_null: ClassVar[tuple[str, ...]] = ("reasoning", "reasoning_content")


class ChatChoice(OmitsNullExtras):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatChoiceLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None  # with return_token_ids: the generated tokens, reasoning and calls too
    omitted_when_null: ClassVar[tuple[str, ...]] = ("token_ids",)


class ChatCompletionResponse(OmitsNullExtras):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids: the rendered prompt's
    prompt_logprobs: PromptLogprobs = None  # with prompt_logprobs
    omitted_when_null: ClassVar[tuple[str, ...]] = ("prompt_token_ids", "prompt_logprobs")


class DeltaMessage(WithoutNulls):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None
    reasoning: Optional[str] = None  # as in AssistantMessage
    reasoning_content: Optional[str] = None


class ChatStreamChoice(OmitsNullExtras):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None  # with return_token_ids: the chunk's generated tokens
    omitted_when_null: ClassVar[tuple[str, ...]] = ("token_ids",)


class ChatCompletionChunk(OmitsNullExtras):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids: in the first chunk
    prompt_logprobs: PromptLogprobs = None  # with prompt_logprobs: in the first chunk
    omitted_when_null: ClassVar[tuple[str, ...]] = ("prompt_token_ids", "prompt_logprobs")


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


class TokenizeRequest(RequestBody):
    """Either a prompt, or chat messages rendered with the chat template first."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    tools: Optional[list[ChatTool]] = None  # with messages: rendered by the chat template as chat does
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # with messages, as chat's

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
