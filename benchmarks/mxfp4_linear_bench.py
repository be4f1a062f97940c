"""GPT-OSS's MXFP4 expert layers at decode batch sizes, side by side in one process: folio's MXFP4 kernel
(folio.models.mxfp4_linear, float32 and bf16 activations), the dequantise-then-GEMM path it takes from
mxfp4_linear.GEMM_MIN_ROWS rows, and F.linear on the same weights dequantised to float32 and to bf16 (what the
experts ran before: dequantised at load). gpt-oss-20b's expert shapes: gate/up 5760 x 2880, down 2880 x 2880
(N x K); random codes, scales around 1. The calls alternate round by round; the best round is reported, with the
GB/s of MXFP4's bytes (17 per 32 weights) the kernel reads.

    python benchmarks/mxfp4_linear_bench.py [--rows 1,16,64,256] [--rounds 5]
"""

from __future__ import annotations

import argparse

import torch
from int8_gemm_bench import timed  # the sibling script's timer: seconds per call over a round
from torch.nn import functional as F

from folio.models import mxfp4, mxfp4_linear

SHAPES = [(5760, 2880), (2880, 2880)]  # gate_up, down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-s", type=float, default=0.2)
    args = parser.parse_args()
    if not mxfp4_linear.available():
        raise SystemExit("the MXFP4 kernel does not build here")
    print(f"threads {torch.get_num_threads()}, instruction sets compiled {mxfp4_linear.isas()}")
    torch.manual_seed(0)
    for n, k in SHAPES:
        blocks = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8)
        scales = torch.randint(120, 128, (n, k // 32), dtype=torch.uint8)
        w32 = mxfp4.dequantize(blocks, scales).float()
        w16, bias = w32.bfloat16(), torch.randn(n)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            xb = x.bfloat16()
            calls = {"mxfp4 kernel": lambda: mxfp4_linear.linear(x, blocks, scales, bias),
                     "mxfp4 kernel, bf16 x": lambda: mxfp4_linear.linear(xb, blocks, scales, bias),
                     "dequantise + GEMM": lambda: F.linear(x, mxfp4_linear.dequantize(blocks, scales), bias),
                     "F.linear float32": lambda: F.linear(x, w32, bias),
                     "F.linear bf16": lambda: F.linear(xb, w16, bias.bfloat16())}
            best = {name: float("inf") for name in calls}
            for _ in range(args.rounds):
                for name, fn in calls.items():
                    best[name] = min(best[name], timed(fn, args.round_s))
            gb_s = (blocks.numel() + scales.numel()) / best["mxfp4 kernel"] / 1e9
            print(f"{n} x {k}, {m:4d} rows: " + ", ".join(f"{name} {t * 1e3:.3f} ms" for name, t in best.items())
                  + f" (kernel: {gb_s:.1f} GB/s of MXFP4)")


if __name__ == "__main__":
    main()
