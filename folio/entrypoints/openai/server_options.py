"""ServerOptions: what `folio serve` bounds and how it stops, beside the engine's own options.

These are not engine options (folio.config): the offline `LLM` runs the prompts it is given and has no
clients to protect itself from. They are defined once here, with the same `option()` as the engine's, so
that `folio serve`'s flags are made from these definitions (folio.cli) and their defaults live here alone.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from folio.config import option
from folio.engine.admission import AdmissionPolicy
from folio.tokenizer import check_chat_template


# folio.entrypoints.openai.tool_call_format
TOOL_CALL_PARSERS = ("deepseek_v3", "deepseek_v31", "glm45", "hermes", "llama3_json", "mistral", "openai", "pythonic",
                     "qwen3_coder")


@dataclass(frozen=True)
class ServerOptions:
    # What one request may ask for: each is checked before any tokenizing, with a 400 naming the field.
    max_prompts_per_request: int = option(64, "most prompts (completions) or inputs (embeddings) in one request; "
                                              "n is capped at 16 apart from this")
    max_stop_strings: int = option(64, "most stop strings (and most bad_words) in one request")
    max_stop_string_chars: int = option(1024, "longest stop string (and bad word), in characters")
    max_logit_bias: int = option(300, "most logit_bias entries in one request (OpenAI's limit)")
    max_tools: int = option(128, "most tools in one chat request (OpenAI's limit)")
    # How chat requests are rendered and how their tool calls are read (vLLM's flags).
    chat_template: Optional[str] = option(
        None, "the chat template of every chat request (chat completions, responses, /tokenize) instead of the "
              "model's: a file's path, or the template itself", default_means="the model's")
    enable_auto_tool_choice: bool = option(
        True, "serve tool_choice 'auto', the default beside tools (vLLM leaves it off unless this flag is given; "
              "off, 'auto' is a 400 and clients must ask for 'required', a named function or 'none')")
    tool_call_parser: Optional[str] = option(
        None, "the format the model writes tool calls in, which the tool grammars make it write and the server reads "
              "back: deepseek_v3 (DeepSeek V3, R1) or deepseek_v31 (DeepSeek V3.1: calls between DeepSeek's "
              "tool-call tokens), glm45 (GLM-4.5, GLM-4.6: <tool_call> blocks of <arg_key>/<arg_value> pairs), "
              "hermes (Qwen2.5, Qwen3, Hermes: <tool_call> blocks of JSON), llama3_json (Llama 3.1-3.3: a JSON "
              "object of name and parameters), mistral ([TOOL_CALLS] and the calls), openai (GPT-OSS: harmony "
              "messages to functions.NAME), pythonic (Llama 3.2, Llama 4: [f(x=1)]) or qwen3_coder (Qwen3-Coder: "
              "<function=...> blocks)", default_means="hermes; openai under --reasoning-parser openai_gptoss",
        choices=TOOL_CALL_PARSERS)
    # Backpressure and deadlines (folio.engine.admission).
    max_waiting_requests: int = option(
        1024, "refuse new requests with 503 and Retry-After while this many sequences wait for the batch "
              "(0: no bound)")
    max_waiting_tokens: int = option(
        1 << 20, "refuse new requests with 503 and Retry-After while the waiting sequences hold this many "
                 "prompt tokens (0: no bound)")
    request_timeout: Optional[float] = option(
        None, "seconds from arrival after which a request still unfinished is aborted with a 504 error "
              "(its KV blocks freed)", default_means="none")
    # Connections.
    max_connections: int = option(1024, "open connections and requests in progress beyond which uvicorn answers "
                                        "503 at once")
    header_timeout: float = option(10.0, "seconds a connection gets to send a request's headers before it is "
                                         "closed (slow or stalled clients)")
    # Stopping.
    shutdown_timeout: float = option(30.0, "on SIGINT/SIGTERM, seconds requests in flight get to finish before "
                                           "they end with finish_reason 'abort'")
    exit_on_engine_death: bool = option(True, "exit with status 1 when the engine dies, failing its requests, so "
                                              "that a supervisor restarts the server")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        if self.chat_template is not None:
            check_chat_template(read_chat_template(self.chat_template))
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")

    def admission(self) -> AdmissionPolicy:
        return AdmissionPolicy(self.max_waiting_requests or None, self.max_waiting_tokens or None,
                               self.request_timeout)


def read_chat_template(option: str) -> str:
    """The chat_template option's template: the file it names, or the option itself where it is a template (as
    vLLM's --chat-template reads it); ValueError where it is neither."""
    if os.path.isfile(option):
        with open(option, encoding="utf-8") as f:
            return f.read()
    if "{{" in option or "{%" in option:
        return option
    raise ValueError(f"chat_template: {option!r} is neither a file nor a template")
