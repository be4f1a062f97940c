"""Weight schemes side by side in one process: the same workload on each, output tokens/s and the ratio to
the first. Engines are built one after the other (one resident at a time), each warmed up first.

    # batch-1 decode of the 0.5B Qwen2 architecture
    python benchmarks/quant_speed_bench.py --model M --runs bfloat16 float32 float32:int8 float32:int4 \\
        --max-num-seqs 1 --num-prompts 2 --input-len 32 --output-len 64
    # W1
    python benchmarks/quant_speed_bench.py --model M --runs bfloat16 bfloat16:int8 bfloat16:int8 bfloat16

A run is DTYPE[:QUANTIZATION[:KV_CACHE_DTYPE]], e.g. bfloat16:int4:int8.

--rounds N (N > 1) keeps every run's engine resident and measures them in turn N times, the order reversed
every other round (A B C, C B A, ...), so that a shared machine's drift (its bandwidth moved 24-41 GB/s
within minutes on the machines measured) weighs on every run alike; it reports each run's passes and the
median over rounds of its ratio to the first run of the same round. Beside output tokens/s (prompts
included) it reports decode tokens/s, one over the mean time per output token after the first (TPOT): the
measure of batch-1 decode speed (issue 13's targets), without the prefill that a short run weighs in.

--decode-steps N keeps every run's engine resident too, but alternates them step by step: each takes one engine
step in turn (A B C, C B A, ...) N times, starting its workload again whenever it has finished. A run's decode
tokens/s is the tokens of its median decode step (a step that schedules no prompt tokens: one per running
request) over that step's time; beside the ratio of those it reports the median of the ratios of each step to
the first run's step of the same turn. Drift then weighs alike on steps tens of milliseconds apart, where
--rounds compares passes seconds apart: on the Zen 4 machine measured, whose bandwidth moved 22-42 GB/s between
reads half a second apart, --rounds 5 put batch-1 int8 at 1.20-1.66x bf16 by round, and --decode-steps at
1.72-1.78x in two runs of 600 and 800 steps.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from folio.bench.noise import OtherLoad, note
from folio.bench.throughput import GREEDY, measure, prepare, submit, warm_up
from folio.bench.workload import BenchRequest, add_workload_arguments, describe
from folio.config import EngineConfig
from folio.engine.llm_engine import LLMEngine


def config_of(run: str, args: argparse.Namespace) -> EngineConfig:
    dtype, quantization, kv = (run.split(":") + [None, None])[:3]
    options = {"model": args.model, "dtype": dtype, "max_num_seqs": args.max_num_seqs,
               "kv_cache_memory": args.kv_cache_memory, "quantization": quantization or None}
    return EngineConfig.from_kwargs(**options, kv_cache_dtype=kv or "auto")


def one_at_a_time(args: argparse.Namespace) -> None:
    results = []
    for run in args.runs:
        engine, requests = prepare(args, config_of(run, args))
        warm_up(engine, requests, 1)
        result = measure(engine, requests, describe(args), breakdown=False)
        results.append((run, result))
        print(f"{run:<24} {result.output_tokens_per_s:8.2f} output tok/s  ({note(result.other_cores)})", flush=True)
        del engine
        gc.collect()
    base = results[0][1].output_tokens_per_s
    print(f"\n{describe(args)}, max_num_seqs {args.max_num_seqs}")
    for run, result in results:
        print(f"  {run:<24} {result.output_tokens_per_s:8.2f} tok/s  x{result.output_tokens_per_s / base:.2f}")


def resident_engines(args: argparse.Namespace) -> dict[str, tuple[LLMEngine, list[BenchRequest]]]:
    """Every run's engine and requests, built and warmed up one after the other, all kept resident."""
    engines = {}
    for run in args.runs:
        engines[run] = prepare(args, config_of(run, args))
        warm_up(*engines[run], 1)
    return engines


def interleaved(args: argparse.Namespace) -> None:
    engines = resident_engines(args)
    rates: dict[str, list[float]] = {run: [] for run in args.runs}
    decode_rates: dict[str, list[float]] = {run: [] for run in args.runs}
    for r in range(args.rounds):
        order = args.runs if r % 2 == 0 else args.runs[::-1]
        for run in order:
            engine, requests = engines[run]
            engine.reset_prefix_cache()  # the same prompts again must not find their KV cached
            result = measure(engine, requests, describe(args), breakdown=False)
            rates[run].append(result.output_tokens_per_s)
            decode_rates[run].append(1 / result.tpot.mean if result.tpot else float("nan"))
            print(f"round {r + 1} {run:<24} {result.output_tokens_per_s:8.2f} output tok/s, "
                  f"{decode_rates[run][-1]:8.2f} decode tok/s  ({note(result.other_cores)})", flush=True)
    print(f"\n{describe(args)}, max_num_seqs {args.max_num_seqs}, {args.rounds} rounds interleaved")
    for label, measured in (("output", rates), ("decode", decode_rates)):
        for run in args.runs:
            ratios = [own / base for own, base in zip(measured[run], measured[args.runs[0]])]
            passes = " ".join(f"{rate:.2f}" for rate in measured[run])
            print(f"  {label} {run:<24} tok/s {passes}   x{statistics.median(ratios):.2f} "
                  f"(rounds {min(ratios):.2f}-{max(ratios):.2f})")


def decoding_requests(engine: LLMEngine) -> int:
    """How many requests the engine's next step decodes, or 0 if that step schedules prompt tokens (a prefill
    or a chunk of one) or waits on requests it has not admitted."""
    scheduler = engine.scheduler
    if len(scheduler.waiting) or any(r.num_tokens - r.num_computed_tokens != 1 for r in scheduler.running):
        return 0
    return len(scheduler.running)


def step_interleaved(args: argparse.Namespace) -> None:
    engines = resident_engines(args)
    steps: dict[str, list[tuple[float, int]]] = {run: [] for run in args.runs}  # per turn: (seconds, tokens)
    load = OtherLoad()
    for turn in range(args.decode_steps):
        for run in (args.runs if turn % 2 == 0 else args.runs[::-1]):
            engine, requests = engines[run]
            restarted = False
            while not (tokens := decoding_requests(engine)):  # prompts are not what this measures
                if not engine.has_unfinished_requests():
                    if restarted:
                        raise SystemExit("the workload has no decode steps (an output of one token?)")
                    engine.reset_prefix_cache()  # the same prompts again must not find their KV cached
                    submit(engine, requests, GREEDY)
                    restarted = True
                engine.step()
            start = time.perf_counter()
            engine.step()
            steps[run].append((time.perf_counter() - start, tokens))
    other_cores = load.cores()
    base = steps[args.runs[0]]
    base_median = statistics.median(seconds / tokens for seconds, tokens in base)
    print(f"\n{describe(args)}, max_num_seqs {args.max_num_seqs}, {args.decode_steps} decode steps each, interleaved"
          f" ({note(other_cores)})")
    for run in args.runs:
        own = steps[run]
        median_step = statistics.median(seconds / tokens for seconds, tokens in own)
        paired = statistics.median((b / bt) / (o / ot) for (b, bt), (o, ot) in zip(base, own))
        ratio = base_median / median_step
        print(f"  {run:<24} decode {1 / median_step:8.2f} tok/s (median step per token {median_step * 1e3:6.2f} ms)"
              f"   x{ratio:.2f} (paired steps x{paired:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--runs", nargs="+", required=True, help="DTYPE[:QUANTIZATION[:KV_CACHE_DTYPE]] ...")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--rounds", type=int, default=1, help="> 1: every engine resident, measured in turn")
    parser.add_argument("--decode-steps", type=int, default=0,
                        help="> 0: every engine resident, decode measured this many steps each, step by step in turn")
    add_workload_arguments(parser)
    args = parser.parse_args()
    if len(set(args.runs)) != len(args.runs) and (args.rounds > 1 or args.decode_steps):
        raise SystemExit("--rounds and --decode-steps measure each run in turn: list each run once")
    if args.decode_steps:
        step_interleaved(args)
    else:
        (interleaved if args.rounds > 1 else one_at_a_time)(args)


if __name__ == "__main__":
    main()
