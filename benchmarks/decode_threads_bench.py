"""Batch-1 decode on the decode threads against OpenMP (folio.platforms.decode_threads), side by side in one process.

    python benchmarks/decode_threads_bench.py --model M --schemes none int4 int8 --rounds 60

Each scheme's engine stays resident with one request decoding (started again when it finishes). A round gives
each (scheme, threads) pair a block of --block consecutive engine steps, in order and reversed every other round,
and drops the first --drop of each block: steps alternating one by one would have each start with the other
kind's workers still spinning (OpenMP's ~5 ms after its last region, the decode threads' 2 ms), fighting for
the cores. Reports each pair's median step, the decode threads' speed-up, and each scheme's ratio to the first
on either threads.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from folio import SamplingParams
from folio.config import EngineConfig
from folio.engine.llm_engine import LLMEngine
from folio.platforms import decode_threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--schemes", nargs="+", default=["none", "int4", "int8"], help="quantization, or none")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--drop", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=400)
    args = parser.parse_args()
    if not 0 <= args.drop < args.block:
        parser.error("--drop must be below --block")

    engines = {scheme: LLMEngine(EngineConfig.from_kwargs(
        model=args.model, dtype=args.dtype, quantization=None if scheme == "none" else scheme, max_num_seqs=1,
        kv_cache_memory=1 << 28, enable_prefix_caching=False)) for scheme in args.schemes}
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(args.prompt_len)]}
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    pairs = [(scheme, threads) for scheme in args.schemes for threads in ("openmp", "decode")]
    times: dict[tuple[str, str], list[float]] = {pair: [] for pair in pairs}
    for r in range(args.rounds):
        for scheme, threads in pairs if r % 2 == 0 else pairs[::-1]:
            engine = engines[scheme]
            decode_threads.DECODE_TOKENS = 1 if threads == "decode" else 0
            for i in range(args.block):
                if not engine.has_unfinished_requests():
                    engine.add_request(engine.next_request_id(), prompt, params)
                    engine.step()  # the prompt
                start = time.perf_counter()
                engine.step()
                if i >= args.drop:
                    times[(scheme, threads)].append(time.perf_counter() - start)
    median = {pair: statistics.median(t) for pair, t in times.items()}
    first = args.schemes[0]
    print(f"{args.rounds} rounds of {args.block - args.drop} decode steps per scheme and threads")
    for scheme in args.schemes:
        omp, dec = median[(scheme, "openmp")], median[(scheme, "decode")]
        print(f"  {scheme:6} openmp {omp * 1e3:7.2f} ms  decode threads {dec * 1e3:7.2f} ms  x{omp / dec:.3f}"
              f"   vs {first}: openmp x{median[(first, 'openmp')] / omp:.2f}, "
              f"decode threads x{median[(first, 'decode')] / dec:.2f}")


if __name__ == "__main__":
    main()
