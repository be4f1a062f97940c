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
"""

from __future__ import annotations

import argparse
import gc
import statistics

from folio.bench.noise import note
from folio.bench.throughput import measure, prepare, warm_up
from folio.bench.workload import add_workload_arguments, describe
from folio.config import EngineConfig


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


def interleaved(args: argparse.Namespace) -> None:
    if len(set(args.runs)) != len(args.runs):
        raise SystemExit("--rounds measures each run every round: list each run once")
    engines = {}
    for run in args.runs:
        engines[run] = prepare(args, config_of(run, args))
        warm_up(*engines[run], 1)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--runs", nargs="+", required=True, help="DTYPE[:QUANTIZATION[:KV_CACHE_DTYPE]] ...")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--rounds", type=int, default=1, help="> 1: every engine resident, measured in turn")
    add_workload_arguments(parser)
    args = parser.parse_args()
    (interleaved if args.rounds > 1 else one_at_a_time)(args)


if __name__ == "__main__":
    main()
