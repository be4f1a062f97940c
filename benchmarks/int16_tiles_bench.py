"""The AVX2 block kernels at batch sizes where they take the tiles (csrc/int16_tiles.h, from 3 rows) against MKL's
float32 GEMM on the dequantised weight (what int4 batches of more than 191 rows ran before), side by side in one
process. The layers are the default model's (int4 qkv, o, gate_up and down in groups of 32, 30 copies of each
so that the weights come from memory, and its int8 49152 x 576 head); calls alternate round by round and the
median round is reported, in ms per pass over every copy.

    python benchmarks/int16_tiles_bench.py [--rows 3,8,16,32,64,256,1024] [--rounds 5] [--copies 30]

Needs AVX2 (the float32 kernels; on AVX-512 CPUs they run too, though layers there do not use them).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from folio.models import int4_blocks, int8_blocks
from folio.models.quant_reference import dequantize, quantize_int4, quantize_int8

INT4_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD = (49152, 576)


def timed(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call, best of reps calls after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="3,8,16,32,64,256,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--reps", type=int, default=2, help="calls per round (the best is kept)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per pass, median of {args.rounds} rounds")
    int4 = []
    for n, k in INT4_SHAPES:
        w = torch.randn(n, k) * 0.05
        quantized = quantize_int4(w, 32)
        dense = dequantize(*quantized)
        int4 += [(k, int4_blocks.pack(*quantized, torch.float32), dense) for _ in range(args.copies)]
    q, s = quantize_int8(torch.randn(*HEAD) * 0.05, 32)
    head = (int8_blocks.pack(q, s), dequantize(q, s, None))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        calls = {
            "int4 kernel": lambda: [int4_blocks.linear(xs[k], b, None) for k, b, _ in int4],
            "int4 F.linear": lambda: [torch.nn.functional.linear(xs[k], d) for k, _, d in int4],
            "head kernel": lambda: int8_blocks.linear(xs[576], head[0], None),
            "head F.linear": lambda: torch.nn.functional.linear(xs[576], head[1]),
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                times[name].append(timed(fn, args.reps) * 1e3)
        med = {name: statistics.median(t) for name, t in times.items()}
        line = []
        for what in ("int4", "head"):
            kernel = med[f"{what} kernel"]
            dense = med[f"{what} F.linear"]
            line.append(f"{what}: kernel {kernel:8.2f}, F.linear {dense:8.2f} ({dense / kernel:.2f}x)")
        print(f"{rows:>5} rows  " + "   ".join(line), flush=True)


if __name__ == "__main__":
    main()
