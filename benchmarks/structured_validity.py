"""Schema pass rate on a real model: each JSON schema shipped with folio (folio/bench/data/json_schemas.jsonl)
asked for through the chat template, greedy and sampled, every output checked with `jsonschema`.

An output the grammar completed must validate; one cut by max_tokens must say so (finish_reason "length").

    .venv/bin/python benchmarks/structured_validity.py             # the default model, 34 schemas x 2
"""

from __future__ import annotations

import argparse
import json

import jsonschema

from folio import LLM, SamplingParams, StructuredOutputsParams
from folio.bench.structured import load_schemas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    llm = LLM(args.model)
    schemas = load_schemas()
    conversations = [[{"role": "user", "content": f"Reply with a JSON value for this schema:\n{json.dumps(s.schema)}"}]
                     for s in schemas]
    counts = {"valid": 0, "invalid": 0, "length": 0}
    for sampling in (dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=0)):
        params = [SamplingParams(max_tokens=args.max_tokens, structured_outputs=StructuredOutputsParams(json=s.schema),
                                 **sampling) for s in schemas]
        for schema, out in zip(schemas, llm.chat(conversations, params, use_tqdm=False)):
            completion = out.outputs[0]
            if completion.finish_reason == "length":
                counts["length"] += 1
                continue
            validator = jsonschema.Draft202012Validator(schema.schema,
                                                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
            try:
                validator.validate(json.loads(completion.text))
                counts["valid"] += 1
            except (ValueError, jsonschema.ValidationError) as e:
                counts["invalid"] += 1
                print(f"INVALID {schema.name}: {completion.text!r}: {e}")
    completed = counts["valid"] + counts["invalid"]
    print(f"{len(schemas)} schemas x 2 samplings: {counts['valid']}/{completed} completed outputs validate "
          f"({100 * counts['valid'] / max(completed, 1):.1f} %), {counts['length']} cut by max_tokens={args.max_tokens} "
          "(finish_reason length)")


if __name__ == "__main__":
    main()
