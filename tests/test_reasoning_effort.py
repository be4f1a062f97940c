"""reasoning_effort as a chat template variable: which variable the template reads decides what the effort becomes,
and a template without either is refused."""

from __future__ import annotations

import pytest

from folio.entrypoints.openai.reasoning_effort import effort_template_kwargs
from folio.tokenizer import Tokenizer

LEVELS = "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}{{ messages[0].content }}"
SWITCH = ("{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
          "{{ messages[0].content }}")
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def tokenizer(llama_dir) -> Tokenizer:
    return Tokenizer.from_dir(llama_dir)


def _rendered(tokenizer: Tokenizer, template: str, effort, **template_kwargs) -> str:
    tokenizer.replace_chat_template(template)
    kwargs = effort_template_kwargs(tokenizer, effort, "reasoning_effort", template_kwargs)
    return tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, **kwargs)


def test_a_template_with_levels_gets_the_effort(tokenizer):
    assert _rendered(tokenizer, LEVELS, "low") == "Reasoning: low\nHi"
    assert _rendered(tokenizer, LEVELS, None) == "Hi"
    assert _rendered(tokenizer, LEVELS, "high", reasoning_effort="high") == "Reasoning: high\nHi"


def test_a_template_with_a_switch_thinks_unless_none(tokenizer):
    assert _rendered(tokenizer, SWITCH, "none") == "<think></think>Hi"
    assert _rendered(tokenizer, SWITCH, "minimal") == _rendered(tokenizer, SWITCH, None) == "Hi"
    assert _rendered(tokenizer, SWITCH, "none", enable_thinking=False) == "<think></think>Hi"


@pytest.mark.parametrize("template, effort, kwargs, match", [
    ("{{ messages[0].content }}", "low", {}, "no reasoning control"),
    (LEVELS, "max", {}, "must be one of"),
    (LEVELS, 3, {}, "must be one of"),
    (LEVELS, "low", {"reasoning_effort": "high"}, "chat_template_kwargs sets it to 'high'"),
    (SWITCH, "none", {"enable_thinking": True}, "sets the chat template's enable_thinking to False"),
])
def test_refused(tokenizer, template, effort, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _rendered(tokenizer, template, effort, **kwargs)
