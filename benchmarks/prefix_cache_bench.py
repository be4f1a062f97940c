"""Prefix caching on vs off: N requests sharing a long prefix with distinct short suffixes.

Prints total prefill time (until every request has its first token) and mean time to first token, both
measured side by side in one run, and their ratios.

    .venv/bin/python benchmarks/prefix_cache_bench.py            # default model, 32 x (512 + 32) tokens
"""

from __future__ import annotations

import argparse
import random
import statistics

from folio import LLM, SamplingParams


def run(llm: LLM, prompts: list[list[int]]) -> tuple[float, float]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return max(ttfts), statistics.mean(ttfts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()

    rng = random.Random(0)
    results = {}
    for enable in (False, True):
        llm = LLM(args.model, enable_prefix_caching=enable)
        vocab = llm.llm_engine.model_config.vocab_size
        for rep in range(args.reps):
            prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_len)]  # fresh per rep: cold cache
            prompts = [prefix + [rng.randrange(100, vocab) for _ in range(args.suffix_len)]
                       for _ in range(args.requests)]
            results.setdefault(enable, []).append(run(llm, prompts))
        del llm
    print(f"{args.requests} requests x ({args.prefix_len} shared + {args.suffix_len} distinct) tokens, "
          f"best of {args.reps}")
    best = {k: min(v) for k, v in results.items()}
    for enable, (total, mean) in best.items():
        print(f"prefix caching {'on ' if enable else 'off'}: prefill {total:.2f} s, mean TTFT {mean:.2f} s")
    print(f"speed-up from caching: prefill x{best[False][0] / best[True][0]:.2f}, "
          f"mean TTFT x{best[False][1] / best[True][1]:.2f}")


if __name__ == "__main__":
    main()
