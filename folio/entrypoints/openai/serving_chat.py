"""POST /v1/chat/completions: messages and tools through the model's chat template, chat-shaped logprobs and
chunks."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel

from folio.entrypoints.openai.protocol import (AssistantMessage, ChatChoice, ChatChoiceLogProbs, ChatCompletionChunk,
                                               ChatCompletionRequest, ChatCompletionResponse, ChatLogProb, ChatMessage,
                                               ChatStreamChoice, ChatTool, DeltaMessage, TopLogProb, UsageInfo)
from folio.entrypoints.openai.serving import ChoiceDelta, OpenAIServing, Prompt, clamp_logprob
from folio.outputs import Logprob
from folio.tokenizer import Tokenizer

# Template variables a request may not override through chat_template_kwargs.
_RESERVED_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "tokenize", "tools"})


def _top_logprob(lp: Logprob) -> TopLogProb:
    token = lp.decoded_token or ""
    return TopLogProb(token=token, logprob=clamp_logprob(lp.logprob), bytes=list(token.encode("utf-8")))


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    tools: Optional[list[ChatTool]] = None,
                    template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
    """The conversation through the model's chat template, tools as Transformers passes them (a list of dicts in
    the API's shape); ValueError for what the template rejects."""
    kwargs = template_kwargs or {}
    reserved = _RESERVED_TEMPLATE_ARGS & kwargs.keys()
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    if tools:
        kwargs = {**kwargs, "tools": [t.model_dump(exclude_none=True) for t in tools]}
    return tokenizer.apply_chat_template([m.to_template_dict() for m in messages],
                                         add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)


class OpenAIServingChat(OpenAIServing):
    request_id_prefix = "chatcmpl"

    def prompts(self, request: ChatCompletionRequest) -> list[Prompt]:
        return [Prompt(None, chat_prompt_ids(self.tokenizer, request.messages, request.add_generation_prompt,
                                             request.tools, request.chat_template_kwargs))]

    def max_tokens(self, request: ChatCompletionRequest, longest_prompt: int) -> int:
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        return self.max_model_len - longest_prompt if requested is None else requested  # default: the rest of the context

    def logprob_counts(self, request: ChatCompletionRequest) -> tuple[Optional[int], Optional[int]]:
        return (request.top_logprobs or 0) if request.logprobs else None, None

    def opening_chunks(self, request_id: str, created: int, request: ChatCompletionRequest) -> list[BaseModel]:
        return [self.envelope(request_id, created, [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                                                   content=""))],
                              None, stream=True) for i in range(request.n or 1)]

    def choice(self, request: ChatCompletionRequest, delta: ChoiceDelta, stream: bool) -> BaseModel:
        logprobs = None if delta.logprobs is None else self._logprobs(delta, request.top_logprobs or 0)
        if stream:
            return ChatStreamChoice(index=delta.index, delta=DeltaMessage(content=delta.text), logprobs=logprobs,
                                    finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
        return ChatChoice(index=delta.index, message=AssistantMessage(content=delta.text), logprobs=logprobs,
                          finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)

    def envelope(self, request_id: str, created: int, choices: list[BaseModel], usage: Optional[UsageInfo],
                 stream: bool) -> BaseModel:
        if stream:
            return ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices,
                                       usage=usage)
        return ChatCompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                      usage=usage)

    @staticmethod
    def _logprobs(delta: ChoiceDelta, top_n: int) -> ChatChoiceLogProbs:
        content = []
        for token_id, position in zip(delta.token_ids, delta.logprobs):
            chosen = _top_logprob(position[token_id])
            top = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top_n),
                         key=lambda lp: lp.rank)
            content.append(ChatLogProb(**chosen.model_dump(), top_logprobs=[_top_logprob(lp) for lp in top]))
        return ChatChoiceLogProbs(content=content)
