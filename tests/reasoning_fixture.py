"""A tiny reasoning model: the tiny random Qwen3 with `<think>` and `</think>` as added tokens (as Qwen3's and
DeepSeek-R1's tokenizers have them) and a Qwen3-style chat template: the model opens its think block itself,
`enable_thinking: false` writes an empty block into the prompt, and an assistant turn's reasoning_content is
rendered inside its block (tools and tool turns are not rendered: the tests read calls, not the model's view)."""

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


def build_reasoning_model(folder: str) -> str:
    """The tiny Qwen3 with the think tags as tokens VOCAB and VOCAB + 1, and the template above."""
    build_tiny_model(folder, "qwen3", vocab_size=VOCAB + 8, max_position_embeddings=2048)
    path = os.path.join(folder, "tokenizer.json")
    tokenizer = Tokenizer.from_file(path)
    tokenizer.add_tokens([AddedToken("<think>", special=False, normalized=False),
                          AddedToken("</think>", special=False, normalized=False)])
    assert tokenizer.token_to_id("</think>") < VOCAB + 8
    tokenizer.save(path)
    config_path = os.path.join(folder, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "chat_template": QWEN3_STYLE_TEMPLATE}, f)
    return folder


def end_tag_id(folder: str) -> int:
    return Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).token_to_id("</think>")
