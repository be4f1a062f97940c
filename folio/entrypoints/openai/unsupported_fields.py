"""The OpenAI request fields folio declares but cannot honour, and why: a request that sets one (to a value that asks
for something the server lacks) is a 400 naming the field, never a request that silently does less. The request
models declare these fields, so that their tables here can name them (protocol.RequestBody.refuse_unsupported)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel


@dataclass(frozen=True)
class Unsupported:
    """A field (a dotted path into the request) that a request may send only as `allowed` (by default absent or
    null: a value that asks for nothing this server lacks), and why not otherwise."""

    name: str
    why: str
    allowed: Callable[[Any], bool] = lambda value: value is None

    def check(self, request: BaseModel) -> None:
        value: Any = request
        for part in self.name.split("."):
            value = getattr(value, part, None)  # (a test checks every name is a field of its request)
        if not self.allowed(value):
            raise ValueError(f"{self.name} {self.why}")


NO_BUILT_IN_TOOLS = "is not supported: this server runs no built-in tools"
NO_MODERATION = "is not supported: this server runs no moderation model"
NO_SUMMARY = "is not supported: no summary is written (the reasoning item holds the reasoning's text)"
TEXT_ONLY = "is not supported: this server generates text only"
NO_VERBOSITY = "other than 'medium' is not supported: folio runs models without verbosity controls"
LOGPROBS = "message.output_text.logprobs"  # the Responses API's `include` value for the message's token logprobs


def _medium(value: Any) -> bool:
    return value in (None, "medium")


# Completions, chat and responses alike: vLLM's extras that folio does not implement.
SAMPLING_UNSUPPORTED = (
    Unsupported("guided_whitespace_pattern", "is not supported: JSON is written with ', ' and ': ' separators and "
                                             "no free whitespace"),
    Unsupported("logits_processors", "is not supported: a request cannot load code here"),
    Unsupported("kv_transfer_params", "is not supported: this server has no disaggregated prefill"),
    Unsupported("vllm_xargs", "is not supported"),
)

CHAT_UNSUPPORTED = SAMPLING_UNSUPPORTED + (
    Unsupported("functions", "(legacy function calling) is not supported: use tools", lambda value: not value),
    Unsupported("function_call", "(legacy function calling) is not supported: use tool_choice",
                lambda value: value in (None, "none")),
    Unsupported("audio", TEXT_ONLY),
    Unsupported("modalities", TEXT_ONLY, lambda value: value in (None, ["text"])),
    Unsupported("prediction", "(predicted outputs) is not supported"),
    Unsupported("web_search_options", NO_BUILT_IN_TOOLS),
    Unsupported("verbosity", NO_VERBOSITY, _medium),
    Unsupported("store", "is not supported: chat completions are not stored (the Responses API stores responses)",
                lambda value: not value),
    Unsupported("moderation", NO_MODERATION),
    Unsupported("echo", "is not supported on chat (completions has it)", lambda value: not value),
    Unsupported("documents", "is not supported as a field: chat_template_kwargs={'documents': [...]} gives them to "
                             "the template"),
    Unsupported("add_special_tokens", "is not supported: the chat template writes the special tokens the model "
                                      "wants", lambda value: not value),
    Unsupported("use_beam_search", "is not supported on chat (completions has it)", lambda value: not value),
    Unsupported("best_of", "is not supported on chat (completions has it, with use_beam_search)"),
    Unsupported("length_penalty", "is not supported on chat (completions has it, with use_beam_search)"),
    Unsupported("chat_template", "is not supported per request: the server renders with the model's template"),
    Unsupported("mm_processor_kwargs", TEXT_ONLY),
)

RESPONSES_UNSUPPORTED = SAMPLING_UNSUPPORTED + (
    Unsupported("n", "is not a field of the Responses API: a response has one output",
                lambda value: value in (None, 1)),
    Unsupported("max_tokens", "is not a field of the Responses API: use max_output_tokens"),
    Unsupported("truncate_prompt_tokens", "is not supported on responses: truncation 'auto' drops the oldest "
                                          "messages to fit"),
    Unsupported("prompt_logprobs", "is not supported on responses (completions and chat have it)"),
    Unsupported("return_token_ids", "is not supported on responses (completions and chat have it)",
                lambda value: not value),
    Unsupported("return_tokens_as_token_ids", "is not supported on responses (completions and chat have it)",
                lambda value: not value),
    Unsupported("text.verbosity", NO_VERBOSITY, _medium),
    Unsupported("reasoning.summary", NO_SUMMARY),
    Unsupported("reasoning.generate_summary", NO_SUMMARY),
    Unsupported("background", "is not supported: a response runs while its request is open", lambda value: not value),
    Unsupported("background_options", "is not supported: a response runs while its request is open"),
    Unsupported("include", f"is supported for {LOGPROBS!r} only: a response holds its output text, reasoning and calls",
                lambda value: not value or set(value) <= {LOGPROBS}),
    Unsupported("conversation", "is not supported: continue a conversation with previous_response_id"),
    Unsupported("prompt", "(a stored prompt template) is not supported: send instructions and input"),
    Unsupported("context_management", "is not supported: truncation 'auto' drops the oldest messages to fit"),
    Unsupported("image", TEXT_ONLY),
    Unsupported("access_programs", NO_BUILT_IN_TOOLS),
    Unsupported("moderation", NO_MODERATION),
)
