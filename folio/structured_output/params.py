"""StructuredOutputsParams: what a request's output must match, in vLLM's shape (`SamplingParams.structured_outputs`).

Plain data, checked here for shape only (exactly one kind, the right types), so that it can travel in the step
messages. Whether a schema, regex or grammar is valid is the grammar backend's to say
(StructuredOutputManager.validate), when the request is added and before it is queued.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

KINDS = ("json", "regex", "choice", "grammar", "json_object")
DESCRIPTIONS = {"json": "JSON schema", "regex": "regular expression", "choice": "list of choices",
                "grammar": "grammar (Lark or GBNF)", "json_object": "JSON object constraint"}


@dataclass
class StructuredOutputsParams:
    """Exactly one of: a JSON schema (a dict or its JSON text), a regular expression, a list of strings to choose
    from, a context-free grammar (Lark, or GBNF/EBNF with `::=` rules), or json_object=True (any JSON object)."""

    json: Union[str, dict, None] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
        self._check()

    def _check(self) -> None:
        def check(ok: bool, kind: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"structured_outputs.{kind} {rule}, got {getattr(self, kind)!r}"[:500])

        kind = self.kind
        if kind == "json":
            check(isinstance(self.json, dict), kind, "must be a JSON schema object (a dict or its JSON text)")
        elif kind == "choice":
            check(isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                  and all(isinstance(c, str) and c for c in self.choice), kind, "must be a list of non-empty strings")
            self.choice = list(self.choice)
        elif kind == "json_object":
            check(self.json_object is True, kind, "must be true")
        else:
            check(isinstance(getattr(self, kind), str) and getattr(self, kind) != "", kind, "must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> Any:
        """The constraint itself: the schema, the regex, the choices, the grammar text, or True."""
        return getattr(self, self.kind)

    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached under: equal keys compile to equal grammars."""
        return self.kind, json.dumps(self.spec, sort_keys=True)
