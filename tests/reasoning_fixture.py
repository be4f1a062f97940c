"""A tiny reasoning model: the tiny random Qwen3 with `<think>` and `</think>` as added tokens (as Qwen3's and
DeepSeek-R1's tokenizers have them) and a Qwen3-style chat template: the model opens its think block itself,
`enable_thinking: false` writes an empty block into the prompt, and an assistant turn's reasoning_content is
rendered inside its block (tools and tool turns are not rendered: the tests read calls, not the model's view).

Its Magistral-style twin (`build_magistral_model`) has `[THINK]`, `[/THINK]`, `[INST]` and `[/INST]` as special
tokens instead, and a template in Magistral's shape: nothing opens the block in the prompt (the model writes
`[THINK]` when it thinks), and an assistant turn's reasoning_content is rendered between the tags."""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer

from conftest import VOCAB, build_tiny_model

QWEN3_STYLE_TEMPLATE = """{%- for message in messages %}
{%- if message.role in ('system', 'user') %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or '' }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


MAGISTRAL_STYLE_TEMPLATE = """{%- for message in messages %}
{%- if message.role == 'system' %}<|im_start|>{{ message.content }}<|im_end|>
{%- elif message.role == 'user' %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' %}{% if message.reasoning_content %}[THINK]{{ message.reasoning_content }}[/THINK]
{%- endif %}{{ message.content or '' }}{% if not loop.last %}<|im_end|>{% endif %}
{%- endif %}
{%- endfor %}"""


def build_reasoning_model(folder: str, tags: tuple[str, ...] = ("<think>", "</think>"), special: bool = False,
                          chat_template: str = QWEN3_STYLE_TEMPLATE) -> str:
    """The tiny Qwen3 with `tags` as tokens VOCAB, VOCAB + 1, ... (within its vocab size), and `chat_template`."""
    build_tiny_model(folder, "qwen3", vocab_size=VOCAB + 8, max_position_embeddings=2048)
    path = os.path.join(folder, "tokenizer.json")
    tokenizer = Tokenizer.from_file(path)
    (tokenizer.add_special_tokens if special else tokenizer.add_tokens)(
        [AddedToken(tag, special=special, normalized=False) for tag in tags])
    assert max(tokenizer.token_to_id(tag) for tag in tags) < VOCAB + 8
    tokenizer.save(path)
    config_path = os.path.join(folder, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "chat_template": chat_template}, f)
    return folder


def build_magistral_model(folder: str) -> str:
    """The Magistral-style twin: Mistral's think and instruction tags as special tokens, and the template above."""
    return build_reasoning_model(folder, ("[THINK]", "[/THINK]", "[INST]", "[/INST]"), True, MAGISTRAL_STYLE_TEMPLATE)


def token_id(folder: str, token: str) -> int:
    return Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).token_to_id(token)


def end_tag_id(folder: str) -> int:
    return token_id(folder, "</think>")
