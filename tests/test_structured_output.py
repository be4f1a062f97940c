"""Structured outputs in the engine: every kind of constraint, enforced token by token, through the engine's paths
(n > 1, preemption, stop strings, streaming, logprobs), with grammars compiled off the step loop.

The model is a tiny random one, so its outputs are whatever the grammar lets a random model write: if they
validate, the grammar did it. The JSON schemas are the benchmark's (folio/bench/data/json_schemas.jsonl).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import threading
import time

import jsonschema
import numpy as np
import pytest
import torch

from folio import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from folio.bench.structured import load_schemas
from folio.core.step_contract import ScheduledRequestData, SchedulerOutput
from folio.engine.output_processor import OutputKind
from folio.structured_output.token_mask import apply_token_bitmask

ENGINE = dict(dtype="float32", kv_cache_memory=1 << 23, num_threads=1)
SCHEMAS = load_schemas()


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, **ENGINE)


def constrained(seed: int = 0, max_tokens: int = 300, **kind) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kind))


def validate(schema: dict, text: str) -> None:
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    validator.validate(json.loads(text))


def test_every_schema_output_validates(llm):
    assert len(SCHEMAS) >= 30
    outputs = llm.generate(["Reply in JSON:"] * len(SCHEMAS),
                           [constrained(i, json=s.schema) for i, s in enumerate(SCHEMAS)], use_tqdm=False)
    for schema, out in zip(SCHEMAS, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema.name, completion.text)
        validate(schema.schema, completion.text)


def test_outputs_cut_by_max_tokens_report_length(llm):
    """A cut output is not passed off as complete: "stop" only when the grammar accepted the end."""
    outputs = llm.generate(["Reply in JSON:"] * len(SCHEMAS),
                           [constrained(i, max_tokens=5, json=s.schema) for i, s in enumerate(SCHEMAS)], use_tqdm=False)
    reasons = [o.outputs[0].finish_reason for o in outputs]
    assert reasons.count("length") >= len(SCHEMAS) - 6
    for schema, out in zip(SCHEMAS, outputs):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            validate(schema.schema, completion.text)
        else:
            assert completion.finish_reason == "length" and len(completion.token_ids) == 5


@pytest.mark.parametrize("kind, check", [
    ({"regex": r"[a-c]{3}-\d{2,4}"}, lambda t: re.fullmatch(r"[a-c]{3}-\d{2,4}", t)),
    ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'}, lambda t: re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", t)),
    ({"grammar": 'root ::= "ok" | "not " word\nword ::= [a-z] [a-z]?'}, lambda t: re.fullmatch(r"ok|not [a-z]{1,2}", t)),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
])
def test_each_kind_of_constraint(llm, kind, check):
    params = [constrained(seed, **kind) for seed in range(4)]
    if "json_object" in kind:  # free keys and values: a random model needs a push to close them
        closers = llm.get_tokenizer().encode('"}', add_special_tokens=False)
        params = [dataclasses.replace(p, logit_bias={t: 4.0 for t in closers}) for p in params]
    outputs = llm.generate(["Say:"] * 4, params, use_tqdm=False)
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text


@pytest.mark.parametrize("kind, message", [
    ({"json": {"type": "foo"}}, "structured_outputs.json is not a valid JSON schema: Invalid type: foo"),
    ({"json": {"type": "array", "minItems": 3, "maxItems": 1}}, "structured_outputs.json is not a valid JSON schema"),
    ({"json": '{"type": '}, "structured_outputs.json is not valid JSON"),
    ({"json": [1]}, "structured_outputs.json must be a JSON schema object"),
    ({"regex": "(ab"}, "(?s)structured_outputs.regex is not a valid regular expression: .*unclosed group"),
    ({"grammar": "start: foo"}, "structured_outputs.grammar is not a valid grammar"),
    ({"grammar": 'root ::= foo'}, "structured_outputs.grammar is not a valid grammar"),
    ({"choice": []}, "structured_outputs.choice must be a list of non-empty strings"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs must set exactly one of"),
    ({}, "structured_outputs must set exactly one of"),
])
def test_invalid_constraints_fail_before_queueing(llama_dir, kind, message):
    engine = LLMEngine.from_kwargs(llama_dir, **ENGINE)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", "hi", SamplingParams(structured_outputs=StructuredOutputsParams(**kind)))
    assert not engine.has_unfinished_requests() and not engine.output_processor.states


def test_a_constraint_is_validated_once_on_its_way_in(llama_dir):
    """The server validates (naming its field), then the engine as the request is added: the backend sees each
    valid constraint once; an invalid one fails every time."""
    engine = LLMEngine.from_kwargs(llama_dir, **ENGINE)
    manager = engine.structured_output
    seen = []
    backend_validate = manager.backend.validate
    manager.backend.validate = lambda params: seen.append(params.key()) or backend_validate(params)
    schema = SCHEMAS[0].schema
    manager.validate(StructuredOutputsParams(json=schema), "response_format.json_schema.schema")
    for i in range(3):
        engine.add_request(f"r{i}", "hi", constrained(json=dict(schema)))
    assert seen == [StructuredOutputsParams(json=schema).key()]
    for _ in range(2):
        with pytest.raises(ValueError, match="tools is not a valid JSON schema"):
            manager.validate(StructuredOutputsParams(json={"type": "foo"}), "tools")
    assert len(seen) == 3


def test_a_compiling_grammar_does_not_hold_up_the_queue(llama_dir):
    engine = LLMEngine.from_kwargs(llama_dir, **ENGINE)
    release = threading.Event()
    compile_grammar = engine.structured_output.backend.compile
    engine.structured_output.backend.compile = lambda params: release.wait(30) and compile_grammar(params)
    engine.add_request("constrained", "hi", constrained(choice=["yes", "no"]), output_kind=OutputKind.FINAL_ONLY)
    engine.add_request("free", "hi", SamplingParams(temperature=0, max_tokens=3), output_kind=OutputKind.FINAL_ONLY)
    finished = {}
    for _ in range(5):
        finished.update({o.request_id: o for o in engine.step()})
    assert "free" in finished and engine.scheduler.requests["constrained"].num_computed_tokens == 0
    release.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step()})
    assert finished["constrained"].outputs[0].text in ("yes", "no")


def test_unconstrained_neighbours_are_untouched(llm):
    """Greedy requests give the same tokens alone and beside constrained ones, and stay on the argmax path."""
    free = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2
    alone = llm.generate(["a", "bb"], free, use_tqdm=False)
    mixed = llm.generate(["a", "x", "bb"], [free[0], constrained(json=SCHEMAS[0].schema), free[1]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids]


def test_n_samples_share_one_compile(llm):
    stats = llm.llm_engine.structured_output.stats
    compiles = stats.num_compiles
    params = dataclasses.replace(constrained(seed=3, choice=["alpha", "beta", "gamma", "delta"]), n=4)
    out = llm.generate("Pick:", params, use_tqdm=False)
    assert all(c.text in ("alpha", "beta", "gamma", "delta") and c.finish_reason == "stop" for c in out[0].outputs)
    assert stats.num_compiles == compiles + 1


def test_preemption_keeps_each_matcher_in_step(llama_dir):
    """Matchers live with the core's requests, which keep their tokens across a preemption: seeded constrained
    requests give the same outputs whether or not they were preempted."""
    tight = dict(ENGINE, block_size=4, max_num_batched_tokens=24, max_num_seqs=6, kv_cache_memory=24 * 2 * 2 * 2 * 16 * 4 * 4)
    params = [constrained(i, max_tokens=60, json=s.schema) for i, s in enumerate(SCHEMAS[:6])]
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 3 for j in range(14 + 3 * i)]} for i in range(6)]
    preempted = LLM(llama_dir, **tight)
    got = preempted.generate(prompts, params, use_tqdm=False)
    assert preempted.llm_engine.scheduler.num_preemptions > 0
    expected = LLM(llama_dir, **ENGINE).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_stop_strings_streaming_and_logprobs(llama_dir):
    engine = LLMEngine.from_kwargs(llama_dir, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2, stop=["-"],
                            structured_outputs=StructuredOutputsParams(regex=r"[a-c]{4}-[0-9]{3}"))
    engine.add_request("r", "hi", params, output_kind=OutputKind.DELTA)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.outputs[0] for o in engine.step()]
    assert re.fullmatch(r"[a-c]{4}", "".join(d.text for d in deltas))
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "-"
    logprobs = [entry for d in deltas for entry in d.logprobs]
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(logprobs) == len(tokens) and all(t in entry for t, entry in zip(tokens, logprobs))


def test_ignore_eos_still_ends_with_the_grammar(llm):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate("Answer:", params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_the_runner_needs_only_the_messages(llama_dir):
    """The bitmask travels in the SchedulerOutput as plain data: a runner fed pickled copies gives the same."""
    params = [constrained(i, max_tokens=40, json=s.schema) for i, s in enumerate(SCHEMAS[:4])]
    expected = LLM(llama_dir, **ENGINE).generate(["x"] * 4, params, use_tqdm=False)
    llm = LLM(llama_dir, **ENGINE)
    execute = llm.llm_engine.runner.execute
    carried = []

    def remote(message: SchedulerOutput):
        carried.append(message.grammar_bitmask is not None)
        return pickle.loads(pickle.dumps(execute(pickle.loads(pickle.dumps(message)))))

    llm.llm_engine.runner.execute = remote
    got = llm.generate(["x"] * 4, params, use_tqdm=False)
    assert any(carried) and [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def _allowed(row: np.ndarray, vocab_size: int) -> set[int]:
    return {t for t in range(vocab_size) if (int(row[t // 32]) >> (t % 32)) & 1}


def test_matchers_roll_back_and_fill_one_row_per_draft(llama_dir):
    engine = LLMEngine.from_kwargs(llama_dir, **ENGINE)
    tokenizer, manager = engine.get_tokenizer(), engine.structured_output
    engine.add_request("r", "hi", constrained(regex="ab(cd)+"))
    request = engine.scheduler.requests["r"]
    while not request.structured_output.ready:
        time.sleep(0.001)
    grammar = request.structured_output.grammar
    vocab = engine.model_config.vocab_size
    a, b, c, d = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abcd")
    assert grammar.accept_tokens([a, b, c])
    grammar.rollback(2)
    assert grammar.accept_tokens([b]) and not grammar.is_terminated()
    step = SchedulerOutput(scheduled=[ScheduledRequestData("r", 0, request.num_tokens, draft_token_ids=[c, d])])
    mask = manager.grammar_bitmask(step, engine.scheduler.requests)
    rows = [_allowed(mask.bitmask[mask.rows["r"] + i], vocab) for i in range(3)]
    assert c in rows[0] and d not in rows[0] and d in rows[1] and c in rows[2] and 2 in rows[2]  # 2: EOS
    assert [_allowed(r, vocab) for r in mask.rows_of("r", 3)] == rows  # the matcher is back where it was
    assert grammar.accept_tokens([c, d, 2]) and grammar.is_terminated()


@pytest.mark.parametrize("vocab_size", [31, 100, 512])
def test_bitmask_kernel_equals_the_reference(vocab_size, monkeypatch):
    from folio.structured_output import token_mask

    rng = np.random.default_rng(vocab_size)
    bitmask = rng.integers(-2**31, 2**31, size=(3, (vocab_size + 31) // 32), dtype=np.int64).astype(np.int32)
    bitmask[0, :] = -1
    bitmask[1, 0] = 0
    logits = torch.randn(5, vocab_size)
    expected = logits.clone()
    monkeypatch.setattr(token_mask.KERNEL, "load", lambda: None)
    apply_token_bitmask(expected, [0, 2, 4], bitmask)
    monkeypatch.undo()
    got = logits.clone()
    apply_token_bitmask(got, [0, 2, 4], bitmask)
    assert torch.equal(got, expected) and torch.equal(got[[1, 3]], logits[[1, 3]])
    allowed = _allowed(bitmask[1], vocab_size)
    assert {t for t in range(vocab_size) if got[2, t] != -torch.inf} == allowed


def test_min_tokens_is_refused_with_a_grammar():
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=3, structured_outputs=StructuredOutputsParams(choice=["a"]))


def test_bench_throughput_structured_compares_both_runs(llama_dir, tmp_path):
    from folio.cli import main

    out = str(tmp_path / "structured.json")
    assert main(["bench", "throughput", "--model", llama_dir, "--dtype", "float32", "--kv-cache-memory", "4MiB",
                 "--num-threads", "1", "--num-prompts", "4", "--input-len", "8", "--output-len", "6",
                 "--warmup-prompts", "1", "--structured", "json", "--json", out]) == 0
    with open(out) as f:
        report = json.load(f)
    free, bound = report["unconstrained"], report["constrained"]
    assert len(free) == len(bound) == 2 and [r["output_tokens"] for r in free + bound] == [24] * 4
    rate = sum(r["output_tokens"] for r in bound) / sum(r["elapsed_s"] for r in bound)
    assert report["constrained_tokens_per_s"] == pytest.approx(rate)
    assert report["throughput_ratio"] == pytest.approx(rate / report["unconstrained_tokens_per_s"])
    assert report["mask_ms_per_step"] > 0 and report["num_schemas"] == len(SCHEMAS) and report["num_compiles"] == 3
    assert all(r["breakdown"]["phases"]["grammar mask apply"]["total_s"] == 0 for r in free)
