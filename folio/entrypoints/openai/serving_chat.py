"""POST /v1/chat/completions: messages and tools through the model's chat template, chat-shaped logprobs and
chunks, and the output constraints chat adds: response_format, and tools (the server's tool-call format,
tool_call_format, constrains the calls and reads them back as tool_calls). With a reasoning parser, a reasoning
model's thinking is read out of the text first (folio.reasoning_parser) and given as the message's `reasoning`;
tool calls are read in the rest."""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from pydantic import BaseModel

from folio.engine.async_llm import AsyncLLM
from folio.entrypoints.openai.protocol import (AssistantMessage, ChatChoice, ChatChoiceLogProbs, ChatCompletionChunk,
                                               ChatCompletionRequest, ChatCompletionResponse, ChatMessage,
                                               ChatStreamChoice, ChatTool, DeltaMessage, UsageInfo)
from folio.entrypoints.openai.output_constraint import MessageFormat, output_constraint
from folio.entrypoints.openai.reasoning_effort import effort_template_kwargs
from folio.entrypoints.openai.request_limits import RequestLimits
from folio.entrypoints.openai.serving import (ChoiceDelta, OpenAIServing, Prompt, prompt_logprobs_field,
                                             token_logprobs)
from folio.entrypoints.openai.tool_grammar import resolve_tool_choice
from folio.entrypoints.openai.tool_call_format import ToolCallFormat
from folio.entrypoints.openai.tool_parser import ToolCallReader, join_tool_calls
from folio.reasoning_split import OutputSplitter
from folio.sampling_params import SamplingParams
from folio.structured_output.params import StructuredOutputsParams
from folio.tokenizer import Tokenizer

# Template variables a request may not override through chat_template_kwargs.
_RESERVED_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "tokenize", "tools", "continue_final_message",
                                     "chat_template"})


def chat_prompt_text(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                     tools: Optional[list[ChatTool]] = None, template_kwargs: Optional[dict[str, Any]] = None,
                     continue_final_message: bool = False) -> str:
    """The conversation through the model's chat template, tools as Transformers passes them (a list of dicts in
    the API's shape); ValueError for what the template rejects."""
    kwargs = template_kwargs or {}
    reserved = _RESERVED_TEMPLATE_ARGS & kwargs.keys()
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    if tools:
        kwargs = {**kwargs, "tools": [t.model_dump(exclude_none=True) for t in tools]}
    return tokenizer.apply_chat_template([m.to_template_dict() for m in messages],
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **kwargs)


def chat_prompt_ids(tokenizer: Tokenizer, limits: RequestLimits, messages: list[ChatMessage],
                    add_generation_prompt: bool = True, tools: Optional[list[ChatTool]] = None,
                    template_kwargs: Optional[dict[str, Any]] = None, field: str = "messages",
                    continue_final_message: bool = False) -> list[int]:
    """chat_prompt_text's tokens, its length checked before it is tokenized."""
    text = chat_prompt_text(tokenizer, messages, add_generation_prompt, tools, template_kwargs,
                            continue_final_message)
    limits.text(text, field)
    return tokenizer.encode(text, add_special_tokens=False)  # the template wrote any BOS the model wants


class OpenAIServingChat(OpenAIServing):
    request_id_prefix = "chatcmpl"

    def __init__(self, llm: AsyncLLM, model_name: str, limits: RequestLimits, tool_format: ToolCallFormat,
                 auto_tool_choice: bool = True) -> None:
        super().__init__(llm, model_name, limits)
        self.reasoning_parser = llm.engine.structured_output.reasoning_parser
        self.tool_format = tool_format
        self.auto_tool_choice = auto_tool_choice  # whether tool_choice "auto" is served (ServerOptions)

    def prompts(self, request: ChatCompletionRequest) -> list[Prompt]:
        template_kwargs = effort_template_kwargs(self.tokenizer, request.reasoning_effort, "reasoning_effort",
                                                 request.chat_template_kwargs)
        limits = self.limits.for_prompts(request.truncate_prompt_tokens)
        return [Prompt(None, chat_prompt_ids(self.tokenizer, limits, request.messages, request.add_generation_prompt,
                                             request.tools, template_kwargs,
                                             continue_final_message=request.continue_final_message))]

    def structured_outputs(self, request: ChatCompletionRequest) -> Optional[StructuredOutputsParams]:
        """structured_outputs, response_format, the grammar of tool_choice, or the last two together
        (output_constraint)."""
        fmt = request.response_format
        message_format = None if fmt is None or fmt.type == "text" else MessageFormat(
            "response_format", "response_format.json_schema.schema",
            fmt.json_schema.json_schema if fmt.json_schema is not None else None)
        return output_constraint(self.llm.engine.structured_output, self.tool_format, request.tools,
                                 resolve_tool_choice(request.tools, request.tool_choice, self.auto_tool_choice),
                                 request.parallel_tool_calls is not False, "tools[{}].function.parameters",
                                 request.structured_outputs_params(), message_format,
                                 request.structured_outputs_field)

    def _sampling_params(self, request: ChatCompletionRequest, prompts: list[Prompt]) -> SamplingParams:
        """With tools (and tool_choice not "none"), as the tool format reads the text; with a reasoning parser, as
        the parser reads it."""
        params = super()._sampling_params(request, prompts)
        tool_choice = resolve_tool_choice(request.tools, request.tool_choice, self.auto_tool_choice)
        params = self.tool_format.reading(params) if self.tool_format.reads(tool_choice) else params
        return params if self.reasoning_parser is None else self.reasoning_parser.reading(params)

    async def read_deltas(self, request: ChatCompletionRequest, prompts: list[Prompt],
                          deltas: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
        """With a reasoning parser, each choice's reasoning leaves its text first (dropped where include_reasoning
        is false, and its tokens' logprobs with it; harmony's logprobs are its content's alone). With tools (and
        tool_choice not "none"; always for a format that is the whole output's structure, harmony), the text left
        goes through the tool format's reader: calls leave the content for tool_calls, and a choice that called
        tools finishes with "tool_calls" (OpenAI keeps "stop" when tool_choice named the function)."""
        tool_choice = resolve_tool_choice(request.tools, request.tool_choice, self.auto_tool_choice)
        parsers: dict[int, ToolCallReader] = {}
        splitters: dict[int, OutputSplitter] = {}
        async for delta in deltas:
            final = delta.finish_reason is not None
            if self.reasoning_parser is not None:
                splitter = splitters.get(delta.index)
                if splitter is None:
                    splitter = splitters[delta.index] = self.reasoning_parser.splitter(self.tokenizer,
                                                                                       prompts[0].token_ids)
                split = splitter.feed(delta.text, delta.token_ids, final)
                delta.text, delta.num_reasoning_tokens = split.content, split.num_reasoning_tokens
                if request.include_reasoning:
                    delta.reasoning = split.reasoning
                if delta.logprobs is not None:  # the tokens of what the message gives
                    kept = split.logprob_tokens(len(delta.token_ids), request.include_reasoning)
                    delta.token_ids = [delta.token_ids[i] for i in kept]
                    delta.logprobs = [delta.logprobs[i] for i in kept]
            if self.tool_format.reads(tool_choice):
                parser = parsers.get(delta.index)
                if parser is None:
                    parser = parsers[delta.index] = self.tool_format.reader_for(request.tools or [], tool_choice)
                delta.text, delta.tool_calls = parser.feed(delta.text, final=final)
                if parser.num_calls and delta.finish_reason == "stop" and tool_choice in ("auto", "required"):
                    delta.finish_reason = "tool_calls"
            yield delta

    def max_tokens(self, request: ChatCompletionRequest, longest_prompt: int) -> int:
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        return self.max_model_len - longest_prompt if requested is None else requested  # default: the rest of the context

    def logprob_counts(self, request: ChatCompletionRequest) -> tuple[Optional[int], Optional[int]]:
        return (request.top_logprobs or 0) if request.logprobs else None, request.prompt_logprobs

    def opening_chunks(self, request_id: str, created: int, request: ChatCompletionRequest,
                       first: ChoiceDelta) -> list[BaseModel]:
        """The role of each choice; the first also carries the prompt's fields (return_token_ids,
        prompt_logprobs)."""
        return [self.envelope(request_id, created, [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                                                   content=""))],
                              None, stream=True, prompt=None if i else first)
                for i in range(request.n or 1)]

    def choice(self, request: ChatCompletionRequest, delta: ChoiceDelta, stream: bool) -> BaseModel:
        logprobs = None if delta.logprobs is None else self._logprobs(delta, request)
        token_ids = delta.output_token_ids if request.return_token_ids else None
        reasoning = delta.reasoning or None
        # null beside calls, as OpenAI's, and beside reasoning (a reasoning chunk, an output cut off in reasoning)
        content = delta.text if delta.text or not (delta.tool_calls or reasoning) else None
        if stream:
            return ChatStreamChoice(index=delta.index, delta=DeltaMessage(content=content,
                                                                          tool_calls=delta.tool_calls or None,
                                                                          reasoning=reasoning,
                                                                          reasoning_content=reasoning),
                                    logprobs=logprobs, finish_reason=delta.finish_reason,
                                    stop_reason=delta.stop_reason, token_ids=token_ids)
        message = AssistantMessage(content=content, tool_calls=join_tool_calls(delta.tool_calls) or None,
                                   reasoning=reasoning, reasoning_content=reasoning)
        return ChatChoice(index=delta.index, message=message, logprobs=logprobs, finish_reason=delta.finish_reason,
                          stop_reason=delta.stop_reason, token_ids=token_ids)

    def envelope(self, request_id: str, created: int, choices: list[BaseModel], usage: Optional[UsageInfo],
                 stream: bool, prompt: Optional[ChoiceDelta] = None) -> BaseModel:
        kind = ChatCompletionChunk if stream else ChatCompletionResponse
        return kind(id=request_id, created=created, model=self.model_name, choices=choices, usage=usage,
                    prompt_token_ids=None if prompt is None else prompt.prompt_token_ids,
                    prompt_logprobs=None if prompt is None else prompt_logprobs_field(prompt.prompt_logprobs))

    @staticmethod
    def _logprobs(delta: ChoiceDelta, request: ChatCompletionRequest) -> ChatChoiceLogProbs:
        return ChatChoiceLogProbs(content=token_logprobs(delta.token_ids, delta.logprobs, request.top_logprobs or 0,
                                                         bool(request.return_tokens_as_token_ids)))
