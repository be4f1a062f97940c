"""Offline throughput: every request of the workload arrives at once (as in vLLM's `bench throughput`), the engine
runs until all are done, and the report gives requests/s, output and total tokens/s and where each step's time
went (see folio.bench.step_profile). Greedy sampling with EOS ignored, so every request generates exactly its
output length and runs compare like for like.

    folio bench throughput --model MODEL --dtype bfloat16 --num-prompts 64 --input-len 256 --output-len 128
    folio bench throughput --dataset chat --json out.json
    folio bench throughput --structured json   # the same requests constrained by JSON schemas, side by side
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Optional

from folio.bench import structured
from folio.bench.noise import OtherLoad, note
from folio.bench.report import Summary, dtype_name, summarize, write_json
from folio.bench.step_profile import PHASES, StepBreakdown, profile_steps
from folio.bench.workload import BenchRequest, add_workload_arguments, describe, engine_requests
from folio.config import EngineConfig, SpeculativeOptions
from folio.engine.llm_engine import LLMEngine
from folio.engine.output_processor import OutputKind
from folio.memory import peak_resident_bytes
from folio.outputs import RequestOutput
from folio.platforms.cpu_features import cpu_description
from folio.sampling_params import SamplingParams
from folio.spec_decode.stats import SpecDecodingStats

WARMUP_OUTPUT_LEN = 8
DEFAULT_WARMUP_PROMPTS = 4


@dataclass
class ThroughputResult:
    workload: str
    model: str
    dtype: str
    engine_config: dict
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft: Optional[Summary]  # seconds from arrival (all at t=0) to the first token
    tpot: Optional[Summary]  # seconds per output token after the first, per request
    e2e_latency: Optional[Summary]
    breakdown: Optional[StepBreakdown]
    other_cores: float  # CPU other processes used meanwhile (folio.bench.noise); >= 0.1: not a clean figure
    peak_rss_bytes: int  # peak resident memory at the end of the run (workers' included), engine start included
    spec_decoding: Optional[SpecDecodingStats] = None  # over the measured run, when speculation is on
    cpu: str = ""  # folio.platforms.cpu_features.cpu_description(): the figures depend on it


@dataclass
class SpeculationComparison:
    """The same workload with speculative decoding and without it, two engines in one process, measured in the
    order A B B A (A: without) so that a machine getting slower or faster over the run weighs on both alike."""

    speculative: list[ThroughputResult]
    no_speculation: list[ThroughputResult]
    speedup: float  # output tokens/s with speculation / without, over both runs of each


@dataclass
class StructuredComparison:
    """`--structured`: the workload unconstrained (A) and constrained (B, folio.bench.structured) in one run, in
    the order A B B A so that a machine getting slower or faster over the run weighs on both alike."""

    kind: str
    num_schemas: int
    unconstrained: list[ThroughputResult]
    constrained: list[ThroughputResult]
    unconstrained_tokens_per_s: float  # over both runs
    constrained_tokens_per_s: float
    throughput_ratio: float  # constrained / unconstrained
    mask_ms_per_step: Optional[float]  # constrained runs: filling the bitmask + applying it, per step (breakdown)
    num_compiles: int  # grammars compiled on the compile thread during the constrained runs
    compile_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--warmup-prompts", type=int, default=DEFAULT_WARMUP_PROMPTS,
                        help=f"run this many of the prompts ({WARMUP_OUTPUT_LEN} output tokens each) before measuring, "
                             "then empty the prefix cache, so one-time kernel set-up is not counted "
                             f"(default: {DEFAULT_WARMUP_PROMPTS}; 0 = none)")
    parser.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                        help="time the phases of each step (default: on; off runs the engine without wrappers)")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    parser.add_argument("--versus-no-speculation", action="store_true",
                        help="with --speculative-config: also run the workload without speculation, in the same "
                             "process, passes interleaved (A B B A), and report the speed-up")
    sampling = parser.add_argument_group("sampling (default: greedy)")
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--structured", choices=("json",),
                        help="run the workload twice, unconstrained and with every output constrained by one of the "
                             "JSON schemas shipped with folio (folio/bench/data/json_schemas.jsonl), and report both "
                             "side by side with the time token masks take per step")


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The workload's sampling settings (EOS ignored: every request generates exactly its output length)."""
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, ignore_eos=True)


def describe_sampling(params: SamplingParams) -> str:
    if params.is_greedy:
        return "greedy"
    return f"temperature {params.temperature:g}, top_p {params.top_p:g}, top_k {params.top_k}"


def model_name(config: EngineConfig) -> str:
    return config.model.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)"


def submit(engine: LLMEngine, requests: list[BenchRequest], sampling: SamplingParams,
           output_len: Optional[int] = None) -> list[str]:
    """Add the requests to the engine (their final outputs only); output_len overrides each request's own. Their ids."""
    ids = []
    for request in requests:
        params = dataclasses.replace(sampling, max_tokens=output_len or request.output_len,
                                     structured_outputs=request.structured_outputs)
        rid = engine.next_request_id()
        engine.add_request(rid, {"prompt_token_ids": request.prompt_token_ids}, params,
                           output_kind=OutputKind.FINAL_ONLY)
        ids.append(rid)
    return ids


def _generate(engine: LLMEngine, requests: list[BenchRequest], sampling: SamplingParams,
              output_len: Optional[int] = None) -> list[RequestOutput]:
    """Run requests to completion; output_len overrides each request's own (for warm-up)."""
    ids = submit(engine, requests, sampling, output_len)
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[i] for i in ids]


def warm_up(engine: LLMEngine, requests: list[BenchRequest], num_prompts: int,
            sampling: SamplingParams = GREEDY) -> None:
    """First calls of each kernel shape pay for set-up (oneDNN primitives, allocator growth); keep that out of
    the measurement, and leave no cached prefix behind that the measured run could hit."""
    if num_prompts > 0:
        _generate(engine, requests[:num_prompts], sampling, WARMUP_OUTPUT_LEN)
        engine.reset_prefix_cache()


def measure(engine: LLMEngine, requests: list[BenchRequest], workload: str, breakdown: bool,
            sampling: SamplingParams = GREEDY) -> ThroughputResult:
    """Run the workload once, all requests arriving together, and report throughput and latencies."""
    spec_before = engine.get_stats().spec_decoding
    with profile_steps(engine) if breakdown else contextlib.nullcontext() as profile:
        load = OtherLoad()
        start = time.perf_counter()
        outputs = _generate(engine, requests, sampling)
        elapsed = time.perf_counter() - start
        other_cores = load.cores()
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    if generated != [r.output_len for r in requests]:
        raise RuntimeError("the engine did not generate exactly output_len tokens per request (ignore_eos)")
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(generated)
    metrics = [o.metrics for o in outputs]
    config = engine.config
    return ThroughputResult(
        workload=workload, model=model_name(config), dtype=dtype_name(config.model.torch_dtype),
        engine_config=dataclasses.asdict(config), num_requests=len(requests), prompt_tokens=prompt_tokens,
        output_tokens=output_tokens, elapsed_s=elapsed, requests_per_s=len(requests) / elapsed,
        output_tokens_per_s=output_tokens / elapsed, total_tokens_per_s=(prompt_tokens + output_tokens) / elapsed,
        ttft=summarize([m.first_token_time - m.arrival_time for m in metrics]),
        tpot=summarize([(m.last_token_time - m.first_token_time) / (n - 1) for m, n in zip(metrics, generated)
                        if n > 1]),
        e2e_latency=summarize([m.finished_time - m.arrival_time for m in metrics]),
        breakdown=profile.breakdown() if profile else None, other_cores=other_cores,
        peak_rss_bytes=peak_resident_bytes(),
        spec_decoding=(engine.get_stats().spec_decoding.since(spec_before)
                       if config.speculative.speculative_config else None),
        cpu=cpu_description())


def a_b_b_a(setup: Callable[[bool], tuple[LLMEngine, list[BenchRequest], str]], breakdown: bool,
            sampling: SamplingParams) -> dict[bool, list[ThroughputResult]]:
    """Measure A (False) and B (True) in the order A B B A, so that a machine getting slower or faster over the
    run weighs on both alike; `setup` gives each side's engine, requests and workload name. The runs of each."""
    runs: dict[bool, list[ThroughputResult]] = {False: [], True: []}
    for side in (False, True, True, False):
        engine, requests, workload = setup(side)
        engine.reset_prefix_cache()  # the second run of the same prompts must not find them cached
        runs[side].append(measure(engine, requests, workload, breakdown, sampling))
    return runs


def rate(results: list[ThroughputResult]) -> float:
    """Output tokens per second over several runs together."""
    return sum(r.output_tokens for r in results) / sum(r.elapsed_s for r in results)


def print_result(result: ThroughputResult) -> None:
    print(f"folio bench throughput: {result.model} ({result.dtype}), {result.workload}")
    if result.cpu:
        print(f"  cpu: {result.cpu}")
    print(f"  {result.num_requests} requests, {result.prompt_tokens} prompt + {result.output_tokens} output tokens "
          f"in {result.elapsed_s:.2f} s")
    print(f"  throughput: {result.requests_per_s:.2f} requests/s, {result.output_tokens_per_s:.1f} output tokens/s, "
          f"{result.total_tokens_per_s:.1f} total tokens/s")
    print(f"  TTFT {result.ttft.line(1e3, 'ms')}")
    if result.tpot:
        print(f"  TPOT {result.tpot.line(1e3, 'ms')}")
    print(f"  E2E  {result.e2e_latency.line(1e3, 'ms')}")
    print(f"  peak resident memory {result.peak_rss_bytes / 1e9:.2f} GB (the process so far and its workers', engine "
          f"start included)")
    print(f"  {note(result.other_cores)}")
    spec = result.spec_decoding
    if spec is not None:
        print(f"  speculative decoding: {spec.num_draft_tokens} draft tokens in {spec.num_drafts} verifications, "
              f"acceptance rate {spec.acceptance_rate:.2f}, mean acceptance length {spec.mean_acceptance_length:.2f}, "
              f"accepted per position {spec.num_accepted_tokens_per_pos}")
    b = result.breakdown
    if b is None:
        return
    print(f"  step breakdown: {b.num_steps} steps, mean {b.step_mean_ms:.2f} ms "
          f"(model forward with attention {b.model_forward_with_attention_ms:.2f} ms)")
    kinds = [(label, kind) for label, kind in (("decode-only", b.decode), ("with prefill", b.prefill))
             if kind.num_steps]
    print(f"    {'phase':<20}{'ms/step':>10}{'%':>8}" + "".join(f"{label + ' ms':>17}" for label, _ in kinds))
    for name in PHASES:
        phase = b.phases[name]
        print(f"    {name:<20}{phase.per_step_ms:>10.2f}{phase.percent:>8.1f}"
              + "".join(f"{kind.phase_ms[name]:>17.2f}" for _, kind in kinds))
    for label, kind in kinds:
        print(f"    steps {label}: {kind.num_steps}, mean {kind.mean_ms:.2f} ms, {kind.mean_requests:.1f} requests, "
              f"{kind.mean_tokens:.1f} tokens")
        if kind.mean_expert_runs is not None:
            print(f"      experts run per step: {kind.mean_expert_runs:.1f} (over all layers), "
                  f"each at most {kind.max_runs_per_expert}x")


def compare_structured(engine: LLMEngine, requests: list[BenchRequest], args: argparse.Namespace,
                       sampling: SamplingParams) -> StructuredComparison:
    """The workload without and with constrained outputs, A B B A, each run from an empty prefix cache. Grammar
    compiles happen during the first constrained run (the warm-up compiles only the schemas its prompts use)."""
    constrained = structured.constrain(requests)
    warm_up(engine, constrained, args.warmup_prompts, sampling)
    workload = f"{describe(args)}, {describe_sampling(sampling)}"
    stats = engine.structured_output.stats
    compiles, compile_s = stats.num_compiles, stats.compile_s
    runs = a_b_b_a(lambda bound: (engine, constrained if bound else requests,
                                  f"{workload}{', constrained by JSON schemas' if bound else ''}"),
                   args.breakdown, sampling)
    mask = None
    if args.breakdown:
        steps = [r.breakdown for r in runs[True]]
        mask = sum(b.phases[p].total_s for b in steps for p in ("grammar bitmask", "grammar mask apply")) * 1e3 \
            / sum(b.num_steps for b in steps)
    return StructuredComparison(args.structured, len(structured.load_schemas()), runs[False], runs[True],
                                rate(runs[False]), rate(runs[True]), rate(runs[True]) / rate(runs[False]), mask,
                                stats.num_compiles - compiles, stats.compile_s - compile_s)


def print_comparison(result: StructuredComparison) -> None:
    for free, bound in zip(result.unconstrained, result.constrained):
        print_result(free)
        print_result(bound)
    print(f"structured outputs ({result.kind}, {result.num_schemas} schemas in turn), same requests, same run "
          "(A B B A):")
    print(f"  output tokens/s: {result.constrained_tokens_per_s:.1f} constrained vs "
          f"{result.unconstrained_tokens_per_s:.1f} unconstrained = {100 * result.throughput_ratio:.1f} %")
    if result.mask_ms_per_step is not None:
        steps = {bound: sum(r.breakdown.step_total_s for r in results) * 1e3 / sum(r.breakdown.num_steps
                                                                                   for r in results)
                 for bound, results in ((True, result.constrained), (False, result.unconstrained))}
        print(f"  token masks: {result.mask_ms_per_step:.2f} ms per step, filling + applying (steps "
              f"{steps[True]:.1f} ms constrained, {steps[False]:.1f} ms unconstrained)")
    print(f"  grammars compiled meanwhile, off the step loop: {result.num_compiles} in {result.compile_s:.2f} s")


def prepare(args: argparse.Namespace, config: EngineConfig) -> tuple[LLMEngine, list[BenchRequest]]:
    """The engine and the workload's requests as token ids (chat prompts through the model's template)."""
    engine = LLMEngine(config)
    requests = engine_requests(args, engine.model_config.vocab_size, engine.get_tokenizer(), engine.max_model_len)
    return engine, requests


def main(args: argparse.Namespace, config: EngineConfig) -> int:
    if args.versus_no_speculation and config.speculative.speculative_config is None:
        raise ValueError("--versus-no-speculation needs --speculative-config")
    sampling = sampling_params(args)
    if args.breakdown and config.parallel.distributed_executor_backend != "uni":
        print("step breakdown: off: the model runs in worker processes")
        args.breakdown = False
    if args.structured:
        if args.versus_no_speculation:
            raise ValueError("--structured and --versus-no-speculation are two different comparisons: give one")
        engine, requests = prepare(args, config)
        warm_up(engine, requests, args.warmup_prompts, sampling)
        result = compare_structured(engine, requests, args, sampling)
        print_comparison(result)
    else:
        workload = f"{describe(args)}, {describe_sampling(sampling)}"
        if args.versus_no_speculation:
            result = compare_speculation(args, config, sampling, workload)
            for plain, speculative in zip(result.no_speculation, result.speculative):
                print_result(plain)
                print_result(speculative)
            print(f"speculative decoding: {result.speedup:.2f}x the output tokens/s without it (A B B A, both "
                  "engines in this process)")
        else:
            result = _run(args, config, sampling, workload)
            print_result(result)
    if args.json:
        write_json(args.json, result)
    return 0


def compare_speculation(args: argparse.Namespace, config: EngineConfig, sampling: SamplingParams,
                        workload: str) -> SpeculationComparison:
    """The workload without speculation (A) and with it (B), A B B A. Each engine is warmed up first; the
    speculative one keeps what it learned (step costs) from run to run, as a serving engine would."""
    engines = {False: prepare(args, dataclasses.replace(config, speculative=SpeculativeOptions())),
               True: prepare(args, config)}
    for engine, requests in engines.values():
        warm_up(engine, requests, args.warmup_prompts, sampling)
    runs = a_b_b_a(lambda speculative: (*engines[speculative], workload), args.breakdown, sampling)
    return SpeculationComparison(runs[True], runs[False], rate(runs[True]) / rate(runs[False]))


def _run(args: argparse.Namespace, config: EngineConfig, sampling: SamplingParams, workload: str) -> ThroughputResult:
    engine, requests = prepare(args, config)
    warm_up(engine, requests, args.warmup_prompts, sampling)
    return measure(engine, requests, workload, args.breakdown, sampling)
