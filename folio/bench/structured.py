"""The structured-output workload of `folio bench throughput --structured json`: the same requests, each
constrained by one of the JSON schemas shipped in folio/bench/data/json_schemas.jsonl (34 schemas of varied
shape: nested objects and arrays, $ref/$defs, enums, anyOf, patterns, formats; the tests validate against them).

Each schema is used as the items of an array of at least output_len items, which no output of output_len tokens
can complete: every constrained request generates exactly as many tokens as its unconstrained twin (EOS is
ignored there), its grammar stays busy the whole time, and the two runs compare like for like.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from folio.bench.workload import BenchRequest
from folio.structured_output.params import StructuredOutputsParams

SCHEMAS_FILE = os.path.join(os.path.dirname(__file__), "data", "json_schemas.jsonl")


@dataclass
class NamedSchema:
    name: str
    schema: dict


def load_schemas() -> list[NamedSchema]:
    with open(SCHEMAS_FILE, encoding="utf-8") as f:
        return [NamedSchema(**json.loads(line)) for line in f if line.strip()]


def array_of(schema: dict, min_items: int) -> dict:
    """An array of at least min_items instances of schema; its $defs move to the root, where "#/$defs/..."
    references point."""
    items = {k: v for k, v in schema.items() if k != "$defs"}
    return {"type": "array", "items": items, "minItems": min_items,
            **({"$defs": schema["$defs"]} if "$defs" in schema else {})}


def constrain(requests: list[BenchRequest]) -> list[BenchRequest]:
    """The requests with the schemas in turn, each as the items of an array longer than the output can be."""
    schemas = load_schemas()
    return [dataclasses.replace(request, structured_outputs=StructuredOutputsParams(
        json=array_of(schemas[i % len(schemas)].schema, request.output_len))) for i, request in enumerate(requests)]
