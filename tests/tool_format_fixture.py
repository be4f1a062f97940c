"""What the tool-call-format tests (tests/test_tool_*.py) share: a format's reader fed a text in pieces, a grammar
backend on a tiny model's tokenizer and whether a grammar takes a text whole, a copy of a tiny model with a format's
chat template and a server that reads that format's calls (`--tool-call-parser`), the check of a call's arguments
against its tool's schema, the check that a chat completion's calls stream as they are given whole, and a Responses
API request that must call a tool."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from typing import TYPE_CHECKING, Any, Callable, Iterator

import jsonschema
import openai
import pytest

from folio.entrypoints.openai.protocol import ToolCall
from folio.entrypoints.openai.server_options import ServerOptions
from folio.entrypoints.openai.tool_parser import CallEnd, Piece, ToolCallReader, join_tool_calls
from server_fixture import MODEL_NAME, RunningServer, running_server

if TYPE_CHECKING:
    from folio.structured_output.llguidance_backend import LLGuidanceBackend
    from folio.tokenizer import Tokenizer

EOS = 2  # the tiny models' end-of-sequence token


# the servers' chat requests: a question a tool answers, sampled (a random model writes what the grammars allow)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLING = dict(model=MODEL_NAME, temperature=1.0, max_tokens=120)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    """The openai client of the module's `server` fixture."""
    return server.openai()


def read_pieces(reader: ToolCallReader, pieces: list[str], cut: bool = False) -> tuple[str, list[ToolCall],
                                                                                   list[Piece]]:
    """The content and the whole calls a choice's pieces give `reader` (the last piece final), and every piece read;
    checks that each call has one end (but for the last where `cut`: the text ended inside it) and that the reader
    counted them."""
    out: list[Piece] = []
    for i, piece in enumerate(pieces):
        out += reader.pieces(piece, final=i == len(pieces) - 1)
    content = "".join(p for p in out if isinstance(p, str))
    calls = join_tool_calls([p for p in out if not isinstance(p, (str, CallEnd))])
    assert sum(isinstance(p, CallEnd) for p in out) == len(calls) - cut and len(calls) == reader.num_calls
    return content, calls, out


def cut(text: str, cuts: list[int]) -> list[str]:
    """`text` cut at the offsets `cuts` (one past its end cuts at its end)."""
    cuts = sorted({min(c, len(text)) for c in cuts})
    return [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]


def llguidance_backend(folder: str) -> tuple[Tokenizer, LLGuidanceBackend]:
    """The tokenizer of the model in `folder` and an LLGuidanceBackend on it (512 tokens, EOS the only stop)."""
    from folio.structured_output.llguidance_backend import LLGuidanceBackend
    from folio.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(folder)
    return tokenizer, LLGuidanceBackend(tokenizer, 512, frozenset({EOS}))


def accepts(backend: tuple[Tokenizer, LLGuidanceBackend], params: Any, text: str) -> bool:
    """Whether the grammar of `params` takes `text`'s tokens and then the end of sequence, and ends there."""
    tokenizer, grammar_backend = backend
    grammar = grammar_backend.compile(params)
    return grammar.accept_tokens(tokenizer.encode(text, add_special_tokens=False)) and \
        grammar.accept_tokens([EOS]) and grammar.is_terminated()


def styled_model(source: str, folder: str, chat_template: str) -> str:
    """A copy of the tiny model in `source` into `folder`, with room for 2048 positions and `chat_template`."""
    shutil.copytree(source, folder, dirs_exist_ok=True)
    for name, changes in (("config.json", {"max_position_embeddings": 2048}),
                          ("tokenizer_config.json", {"chat_template": chat_template})):
        with open(os.path.join(folder, name)) as f:
            content = json.load(f)
        with open(os.path.join(folder, name), "w") as f:
            json.dump({**content, **changes}, f)
    return folder


def tool_server(folder: str, parser: str) -> contextlib.AbstractContextManager[RunningServer]:
    """A server on the model in `folder` that reads its calls with `--tool-call-parser parser`."""
    return running_server(folder, options=ServerOptions(tool_call_parser=parser))


def tool_server_fixture(parser: str, chat_template: str, arch: str = "llama") -> Callable[..., Iterator[RunningServer]]:
    """A module's `server` fixture: tool_server on a styled_model copy of the tiny `arch` model."""

    @pytest.fixture(scope="module")
    def server(tiny_model_factory, tmp_path_factory) -> Iterator[RunningServer]:
        folder = styled_model(tiny_model_factory(arch), str(tmp_path_factory.mktemp(f"{parser}-style")), chat_template)
        with tool_server(folder, parser) as s:
            yield s

    return server


def assert_valid(call: Any, tools: list[dict]) -> None:
    """A call's arguments (JSON text) validate against the parameters of its tool among `tools` (chat's tools): a chat
    tool call's or a Responses function_call item's."""
    function = getattr(call, "function", call)  # (a function_call item holds its name and arguments itself)
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == function.name)
    jsonschema.validate(json.loads(function.arguments), schema)


def plain_calls(tool_calls: list) -> list[tuple[str, str]]:
    """A message's calls as (name, arguments) pairs."""
    return [(c.function.name, c.function.arguments) for c in tool_calls]


def assert_named_call(client: openai.OpenAI, name: str, **kwargs) -> Any:
    """The chat completion of `kwargs` with tool_choice naming `name`: one call of it, valid by its tool, no content
    beside it, and finish_reason "stop" (OpenAI's for a named function). Returns the call."""
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": name}}, **kwargs)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == name and named.choices[0].finish_reason == "stop"
    assert named.choices[0].message.content is None
    assert_valid(call, kwargs["tools"])
    return call


def assert_calls_stream_as_plain(client: openai.OpenAI, **kwargs) -> tuple[list, str]:
    """The chat completion of `kwargs` ends in calls, with no content beside them, each valid by its tool among
    kwargs["tools"]; streamed, it gives the same calls. Returns the calls and the streamed content."""
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert_valid(call, kwargs["tools"])
    content, calls = streamed(client, **kwargs)
    assert calls == plain_calls(choice.message.tool_calls)
    return choice.message.tool_calls, content


def assert_responses_call(client: openai.OpenAI, tools: list[dict], max_output_tokens: int) -> Any:
    """The one function_call item, completed and valid by its tool, of a Responses API request (seed 5) that must call
    one of `tools` (chat's, given to the Responses API as its own)."""
    response = client.responses.create(model=MODEL_NAME, input="Weather?", tool_choice="required",
                                       tools=[{"type": "function", **tool["function"]} for tool in tools],
                                       parallel_tool_calls=False, max_output_tokens=max_output_tokens, temperature=1.0,
                                       extra_body={"seed": 5})
    (item,) = response.output
    assert item.type == "function_call" and item.status == "completed" and response.status == "completed"
    assert_valid(item, tools)
    return item


def streamed(client: openai.OpenAI, **kwargs) -> tuple[str, list[tuple[str, str]]]:
    """The content and the calls, (name, arguments) in the order of their indexes, of a streamed chat completion."""
    calls: dict[int, dict] = {}
    content = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        content += chunk.choices[0].delta.content or ""
        for delta in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(delta.index, {"name": delta.function.name, "arguments": ""})
            entry["arguments"] += delta.function.arguments or ""
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def add_tokens(folder: str, tokens: list[str], special: bool = True) -> list[int]:
    """Adds `tokens` to the tokenizer of the model in `folder` (special or plain added tokens, within its config's
    vocab_size, which the trained tokenizer leaves room for): a format's markers as one token each. Returns their
    ids."""
    from tokenizers import AddedToken, Tokenizer as Backend

    path = os.path.join(folder, "tokenizer.json")
    backend = Backend.from_file(path)
    added = [AddedToken(t, special=special, normalized=False) for t in tokens]
    (backend.add_special_tokens if special else backend.add_tokens)(added)
    backend.save(path)
    ids = [backend.token_to_id(t) for t in tokens]
    with open(os.path.join(folder, "config.json")) as f:
        assert max(ids) < json.load(f)["vocab_size"]
    return ids


def random_output(backend: tuple[Tokenizer, LLGuidanceBackend], params: Any, rng: random.Random,
                  chunks: list[list[int]], steps: int = 120) -> list[int] | None:
    """A random output of a grammar: random allowed tokens (of the tiny vocabulary, but the end of sequence), and
    often a chunk of the format where it fits; None where it did not end within `steps`."""
    matcher = backend[1].compile(params).matcher
    ids: list[int] = []
    for _ in range(steps):
        if matcher.is_accepting() and rng.random() < 0.5:
            return ids
        fitting = [chunk for chunk in chunks if matcher.validate_tokens(chunk) == len(chunk)]
        if fitting and rng.random() < 0.7:
            chunk = rng.choice(fitting)
        else:
            mask = matcher.compute_bitmask()
            allowed = [t for t in range(512) if t != EOS and mask[t // 8] >> (t % 8) & 1]
            chunk = [rng.choice(allowed)] if allowed else []
        if not chunk:
            return ids if matcher.is_accepting() else None
        assert matcher.consume_tokens(chunk)
        ids += chunk
    return ids if matcher.is_accepting() else None
