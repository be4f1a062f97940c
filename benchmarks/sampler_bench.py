"""The sampler on a [64, V] batch of bf16 logits, with the C++ sampling kernels and with the torch reference
ops (folio.sample.sampling_ops without its kernels), side by side, for the sampling settings servers see.

Random logits are flatter than a model's, so the top-p nucleus is wide: a pessimistic case for top_p.

    python benchmarks/sampler_bench.py [--batch 64] [--vocab 49152 151936] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from folio.memory import keep_freed_memory
from folio.sample import sampling_ops
from folio.sample.sampler import Sampler, SamplingRow
from folio.sampling_params import SamplingParams

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1.0": SamplingParams(temperature=1.0),
    "temperature 0.8, top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "temperature 0.8, top_k 50": SamplingParams(temperature=0.8, top_k=50),
    "seeded, temperature 0.8, top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9, seed=0),
}


def time_sampler(logits: torch.Tensor, params: SamplingParams, rounds: int) -> float:
    sampler = Sampler()
    rows = [SamplingRow(params, [1], [], None if params.seed is None else torch.Generator().manual_seed(i), set())
            for i in range(logits.shape[0])]
    sampler(logits, rows)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        sampler(logits, rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if sampling_ops.KERNEL.load() is None:
        raise SystemExit(f"sampling kernels unavailable: {sampling_ops.KERNEL.error}")
    keep_freed_memory()  # as the engine does: [64, 151936] float32 temporaries are not faulted in every call
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, ms per sampler call")
    for vocab in args.vocab:
        logits = (torch.randn(args.batch, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
        for name, params in SETTINGS.items():
            kernels = time_sampler(logits, params, args.rounds)
            with mock.patch.object(sampling_ops, "_kernel_for", lambda *a: None):
                reference = time_sampler(logits, params, args.rounds)
            print(f"  V={vocab:<7d} {name:36s} torch ops {reference * 1e3:8.1f}   kernels {kernels * 1e3:7.1f}   "
                  f"{reference / kernels:5.1f}x")


if __name__ == "__main__":
    main()
