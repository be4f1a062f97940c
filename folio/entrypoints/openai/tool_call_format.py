"""ToolCallFormat: how a model family writes tool calls (`folio serve --tool-call-parser`, vLLM's flag and names):
the grammar that makes the model write them as tool_choice asks, and the reader that finds them in its text.
Chat completions and the Responses API take both from the server's format; a new format is one module that
provides the two, and one entry here. A format whose markers are special tokens (Mistral's [TOOL_CALLS]) says so,
and the requests whose calls it reads keep special tokens in their text; one whose grammar depends on the model's
tokenizer (a marker's token id, the tokenizer's version) says what it needs of it, which the server reads once at
start (resolve)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Collection, Optional

from folio.entrypoints.openai.protocol import ChatTool
from folio.entrypoints.openai.tool_deepseek import DeepSeekTokens, DeepSeekToolCallReader, deepseek_constraint
from folio.entrypoints.openai.tool_glm45 import Glm45ToolCallReader, glm45_constraint
from folio.entrypoints.openai.tool_grammar import ToolChoice, hermes_constraint
from folio.entrypoints.openai.tool_harmony import HarmonyToolCallReader, harmony_constraint
from folio.entrypoints.openai.tool_llama3_json import Llama3JsonToolCallReader, llama3_json_constraint
from folio.entrypoints.openai.tool_mistral import MistralTokens, MistralToolCallReader, mistral_constraint
from folio.entrypoints.openai.tool_pythonic import PythonicToolCallReader, pythonic_constraint
from folio.entrypoints.openai.tool_parser import HermesToolCallReader, ToolCallReader
from folio.entrypoints.openai.tool_qwen3_coder import Qwen3CoderToolCallReader, qwen3_coder_constraint
from folio.harmony_split import HarmonyTokens
from folio.sampling_params import SamplingParams
from folio.structured_output.params import StructuredOutputsParams
from folio.tokenizer import Tokenizer

# (tools, tool_choice resolved, parallel_tool_calls, the JSON a message must be with "auto") -> the grammar
ConstraintBuilder = Callable[[list[ChatTool], ToolChoice, bool, Optional[dict]], Optional[StructuredOutputsParams]]
ReaderFactory = Callable[[list[ChatTool]], ToolCallReader]  # the request's tools -> a reader of one choice's calls


def by_names(reader: Callable[[Collection[str]], ToolCallReader]) -> ReaderFactory:
    """A reader that needs only the names of the request's functions (every format's but Qwen3-Coder's and
    GLM-4.5's, whose raw values are read by their schemas)."""
    return lambda tools: reader([tool.function.name for tool in tools])


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    constraint: ConstraintBuilder
    reader: ReaderFactory
    # The markers are special tokens, which decoding leaves out of the text unless told to keep them.
    keeps_special_tokens: bool = False
    # What the grammar needs of the model's tokenizer, passed to `constraint` as `tokens` once resolve() read it.
    tokens_of: Optional[Callable[[Tokenizer], Any]] = None
    # The format is the structure of the whole output (harmony's channels), not only of its calls: its reader reads
    # every chat-shaped output, calls only where tool_choice allows them (reads), and `constraint` also frames a
    # JSON format for the message under tool_choice "none", where another format leaves it to the format alone.
    whole_output: bool = False

    def reads(self, tool_choice: ToolChoice) -> bool:
        """Whether a request with this resolved tool_choice has its output read by this format's reader."""
        return self.whole_output or tool_choice != "none"

    def reader_for(self, tools: list[ChatTool], tool_choice: ToolChoice) -> ToolCallReader:
        """The reader of one choice of a request that reads(): its calls may be of the request's tools, of none
        under tool_choice "none"."""
        return self.reader([] if tool_choice == "none" else tools)

    def resolve(self, tokenizer: Tokenizer) -> "ToolCallFormat":
        """The format for this model (the server's, at start); ValueError where the tokenizer cannot write it."""
        if self.tokens_of is None:
            return self
        return replace(self, constraint=partial(self.constraint, tokens=self.tokens_of(tokenizer)), tokens_of=None)

    def reading(self, params: SamplingParams) -> SamplingParams:
        """The SamplingParams of a request whose output this format reads (reads()): special tokens
        kept in the text where the markers are some (as vLLM's parsers' adjust_request). The stop token's text
        stays out of the output all the same (folio.detokenizer)."""
        return replace(params, skip_special_tokens=False) if self.keeps_special_tokens else params


# The names are ServerOptions.tool_call_parser's choices (server_options.TOOL_CALL_PARSERS).
TOOL_CALL_FORMATS = {tool_format.name: tool_format for tool_format in (
    ToolCallFormat("deepseek_v3", partial(deepseek_constraint, fenced=True),
                   by_names(partial(DeepSeekToolCallReader, fenced=True)), keeps_special_tokens=True,
                   tokens_of=DeepSeekTokens.of),  # DeepSeek V3, R1: type, name and fenced JSON between markers
    ToolCallFormat("deepseek_v31", partial(deepseek_constraint, fenced=False), by_names(DeepSeekToolCallReader),
                   keeps_special_tokens=True, tokens_of=DeepSeekTokens.of),  # DeepSeek V3.1: name and JSON
    ToolCallFormat("glm45", glm45_constraint, Glm45ToolCallReader),  # GLM-4.5, 4.6: <arg_key>/<arg_value> pairs
    ToolCallFormat("hermes", hermes_constraint, by_names(HermesToolCallReader)),  # Qwen2.5, Qwen3: <tool_call> JSON
    ToolCallFormat("llama3_json", llama3_json_constraint, by_names(Llama3JsonToolCallReader)),  # Llama 3.1-3.3
    ToolCallFormat("mistral", mistral_constraint, by_names(MistralToolCallReader), keeps_special_tokens=True,
                   tokens_of=MistralTokens.of),  # Mistral: [TOOL_CALLS] and calls, as special tokens mark them
    ToolCallFormat("openai", harmony_constraint, by_names(HarmonyToolCallReader), keeps_special_tokens=True,
                   tokens_of=HarmonyTokens.of, whole_output=True),  # GPT-OSS: harmony messages to functions.NAME
    ToolCallFormat("pythonic", pythonic_constraint, by_names(PythonicToolCallReader)),  # Llama 3.2, Llama 4: [f(x=1)]
    ToolCallFormat("qwen3_coder", qwen3_coder_constraint, Qwen3CoderToolCallReader),  # Qwen3-Coder: <function=...>
)}
