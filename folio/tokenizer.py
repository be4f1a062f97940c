"""Tokenizer: a `tokenizers.Tokenizer` plus the facts of tokenizer_config.json and the chat template.

transformers is not used at runtime: importing it costs seconds and hundreds of MB. The tokenizer.json pipeline
(normalizer, pre-tokenizer, model, post-processor, decoder) runs in Rust, and the chat template is rendered the way
transformers renders it (sandboxed jinja2, same options and helpers), so text and ids match transformers'.
"""

from __future__ import annotations

import functools

import json
import os
import re
from datetime import datetime
from typing import Any, Optional

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

# The named special tokens a tokenizer_config.json may define; chat templates see them as variables.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")

# A template that loops over a message's content expects OpenAI-style lists of parts; any other template expects a
# string. The same test vLLM makes (on the template's source rather than its AST; it covers the templates in use).
_LOOPS_OVER_CONTENT = re.compile(r"\bfor\s+\w+\s+in\s+[\w.\[\]'\"]*content\b")


def _token_text(value: Any) -> Optional[str]:
    """A special token as written in tokenizer_config.json: a string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _default_template(template: Any) -> Optional[str]:
    """tokenizer_config's chat_template is a string, or a list of named templates of which "default" is the one."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' tojson: jinja's own escapes HTML characters, which would corrupt tool schemas in prompts."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    """The sandbox chat templates run in, with Transformers' options and helpers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    """A chat template compiled in the sandbox (on first use: a model with a broken template still serves
    completions; a few callers' own templates are kept)."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template does not compile: {e}") from e


@functools.lru_cache(maxsize=16)
def _variables(template: str) -> frozenset[str]:
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template does not compile: {e}") from e


def check_chat_template(template: str) -> None:
    """ValueError if the template does not compile (a server checks its --chat-template before it loads a model)."""
    _compiled(template)


def _ending_inside_the_last_message(text: str, messages: list[dict]) -> str:
    """The rendered text cut right after the last message's content, where the template closes the turn after it
    (Transformers' continue_final_message: where the template trimmed the content's edges, after the trimmed
    content)."""
    content = messages[-1]["content"] if messages else ""
    if isinstance(content, list):
        content = _text_of(content)
    core = content.strip()
    where = text.rfind(core) if core else -1
    if where == -1:
        raise ValueError("continue_final_message: the last message's content does not appear in the rendered chat "
                         "(the template rewrites it), so it cannot be continued")
    kept = content.lstrip()
    return text[:where + len(kept)] if text.startswith(kept, where) else text[:where + len(core)]


def _text_of(content: list) -> str:
    """Join OpenAI-style text parts for a template that expects a string (vLLM joins them with newlines)."""
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"this model's chat template takes text only, got a content part of type {kind!r}")
    return "\n".join(texts)


def _with_parsed_arguments(call: Any) -> Any:
    """A tool call whose function arguments are a JSON object string, with them as a dict; anything else as is."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return call  # the template shows what the model wrote
    return {**call, "function": {**function, "arguments": parsed}} if isinstance(parsed, dict) else call


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` (no transformers at runtime) plus tokenizer_config facts and the chat template."""

    def __init__(self, backend: BackendTokenizer, config: dict, chat_template: Optional[str] = None) -> None:
        self.backend = backend
        self.config = config
        self.chat_template = chat_template
        self.special_tokens = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: Optional[int] = self._id_of("bos_token")
        # Only tokenizer_config.json's eos_token: the ids that end a request are the model loader's
        # (folio.loader.model_loader.eos_token_ids), which adds generation_config.json's.
        self.eos_token_id: Optional[int] = self._id_of("eos_token")
        added = backend.get_added_tokens_decoder()
        named = {i for k in self.special_tokens if (i := self._id_of(k)) is not None}
        self.all_special_ids: set[int] = {i for i, t in added.items() if t.special} | named
        self._set_post_processor()

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """Load tokenizer.json and tokenizer_config.json, and the chat template, from a model folder."""
        tok_path = os.path.join(path, "tokenizer.json")
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        if not os.path.isfile(tok_path) or config is None:
            raise ValueError(f"{path!r} needs tokenizer.json and tokenizer_config.json "
                             "(only fast tokenizers are supported)")
        template_path = os.path.join(path, "chat_template.jinja")  # where transformers 5 saves it; it takes priority
        if os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                template = f.read()
        else:
            template = _default_template(config.get("chat_template"))
        return cls(BackendTokenizer.from_file(tok_path), config, template)

    @classmethod
    def from_parts(cls, tokenizer_json: str, tokenizer_config: dict) -> "Tokenizer":
        """Build from a tokenizer.json string and a config dict (what the GGUF loader reconstructs from metadata)."""
        backend = BackendTokenizer.from_str(tokenizer_json)
        return cls(backend, tokenizer_config, _default_template(tokenizer_config.get("chat_template")))

    def _id_of(self, key: str) -> Optional[int]:
        token = self.special_tokens.get(key)
        return None if token is None else self.backend.token_to_id(token)

    def _set_post_processor(self) -> None:
        """Decide which special tokens encode() adds, as transformers does.

        A config that states add_bos_token/add_eos_token (or a tokenizer.json without a post-processor) gets a
        template adding exactly those; otherwise tokenizer.json's own post-processor rules (Llama 3 adds BOS there).
        """
        if "add_bos_token" not in self.config and "add_eos_token" not in self.config \
                and self.backend.post_processor is not None:
            return
        ends = {key: [self.special_tokens[key]] if self.config.get(f"add_{key}") and self._id_of(key) is not None
                else [] for key in ("bos_token", "eos_token")}

        def part(seq: str, type_id: int) -> list[str]:
            return [f"{t}:{type_id}" for t in [*ends["bos_token"], f"${seq}", *ends["eos_token"]]]

        special = [(t, self.backend.token_to_id(t)) for t in {*ends["bos_token"], *ends["eos_token"]}]
        self.backend.post_processor = processors.TemplateProcessing(
            single=" ".join(part("A", 0)), pair=" ".join(part("A", 0) + part("B", 1)), special_tokens=special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """Text of one token for logprobs' decoded_token, special tokens included. The decoder maps byte-level
        symbols to text; a token holding part of a character's UTF-8 bytes gives '\ufffd' rather than an error."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def _normalize(self, messages: list[dict], template: str) -> list[dict]:
        """OpenAI-shaped messages in the shape templates are written for, as vLLM passes them:
          * None values dropped, and a missing content made empty (clients send content=None next to tool_calls;
            templates would print "None" or fail on it);
          * text parts joined for templates that expect a string;
          * `developer` (OpenAI's newer name for `system`) renamed `system` unless the template knows it;
          * tool call arguments, a JSON string in the API, parsed into the dict templates serialise."""
        wants_parts = _LOOPS_OVER_CONTENT.search(template) is not None
        knows_developer = "developer" in template
        out = []
        for message in messages:
            if not isinstance(message, dict):
                raise ValueError(f"chat messages must be dicts, got {type(message).__name__}")
            message = {k: v for k, v in message.items() if v is not None}
            message.setdefault("content", [] if wants_parts else "")
            if isinstance(message["content"], list) and not wants_parts:
                message["content"] = _text_of(message["content"])
            if message.get("role") == "developer" and not knows_developer:
                message["role"] = "system"
            if message.get("tool_calls"):
                message["tool_calls"] = [_with_parsed_arguments(call) for call in message["tool_calls"]]
            out.append(message)
        return out

    def replace_chat_template(self, template: str) -> None:
        """Render with `template` from now on (a server's --chat-template); ValueError if it does not compile."""
        check_chat_template(template)
        self.chat_template = template

    def chat_template_variables(self) -> frozenset[str]:
        """The variables the chat template reads from its caller (a request's switches, such as enable_thinking,
        are honoured only where the template reads them); empty without a template."""
        return frozenset() if self.chat_template is None else _variables(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False,
                            continue_final_message: bool = False, chat_template: Optional[str] = None,
                            **kwargs: Any) -> str | list[int]:
        """Render the conversation; kwargs (tools, documents, enable_thinking, ...) reach the template as variables.

        continue_final_message: the text ends inside the last message (an assistant turn to be continued, a
        "prefill"), as Transformers renders it; chat_template: a template of the caller's instead of the model's.
        The ids are encoded without special tokens: the template already wrote BOS where the model wants one.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first "
                             "continues the last message, the second starts a new one")
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ValueError("this model has no chat template; use the completions API or pass a chat template")
        normalized = self._normalize(messages, source)
        variables = {**self.special_tokens, **kwargs}
        try:
            text = _compiled(source).render(messages=normalized, add_generation_prompt=add_generation_prompt,
                                            **variables)
        except (jinja2.TemplateError, TypeError) as e:
            raise ValueError(f"chat template error: {e}") from e
        if continue_final_message:
            text = _ending_inside_the_last_message(text, normalized)
        return self.encode(text, add_special_tokens=False) if tokenize else text
