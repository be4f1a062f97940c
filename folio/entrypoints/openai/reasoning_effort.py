"""reasoning_effort (chat completions) and reasoning.effort (the Responses API): how much a reasoning model thinks.
Open models take such a switch only through their chat template, so the effort becomes a template variable, and
only where the template reads one:

  * `reasoning_effort` (gpt-oss's template, and templates that take a level): the effort as given;
  * `enable_thinking` (Qwen3, SmolLM3, GLM-4.5 and most open reasoning models: thinking on or off): "none" turns
    thinking off; any other effort turns it on, since these models think at one level.

A template that reads neither has no reasoning control, and the field is a 400 rather than a request that silently
does less. So is a request whose chat_template_kwargs set the same variable to another value: the two contradict.
"""

from __future__ import annotations

from typing import Any, Optional

from folio.tokenizer import Tokenizer

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's values


def effort_template_kwargs(tokenizer: Tokenizer, effort: Any, field: str,
                           template_kwargs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """template_kwargs with the effort's template variable added (as they are for no effort); ValueError naming
    `field` where the model's template cannot take it."""
    kwargs = dict(template_kwargs or {})
    if effort is None:
        return kwargs
    if effort not in EFFORTS:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, EFFORTS))}, got {effort!r}")
    variables = tokenizer.chat_template_variables()
    if "reasoning_effort" in variables:
        name, value = "reasoning_effort", effort
    elif "enable_thinking" in variables:
        name, value = "enable_thinking", effort != "none"
    else:
        raise ValueError(f"{field} is not supported: this model's chat template has no reasoning control (it reads "
                         "neither reasoning_effort nor enable_thinking)")
    if name in kwargs and kwargs[name] != value:
        raise ValueError(f"{field} {effort!r} sets the chat template's {name} to {value!r}, and "
                         f"chat_template_kwargs sets it to {kwargs[name]!r}")
    return {**kwargs, name: value}
