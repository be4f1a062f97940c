"""One layer's matmul at decode and prefill batch sizes, side by side in one process: the dense bf16 GEMM (oneDNN
on the prepacked weight, as the dense linear method runs it), folio's W8A8 kernel and oneDNN's int8 GEMM
(folio.models.onednn_int8), both as the int8 scheme runs them (rotated activations, the quantisation of the rows
and the scaling of the result included). The calls alternate round by round; the median over rounds is
reported, with the ratios to bf16. It picks onednn_int8.MIN_ROWS_VNNI and MIN_ROWS_AMX.

    python benchmarks/int8_gemm_bench.py                   # Qwen2-0.5B's gate/up and down shapes
    python benchmarks/int8_gemm_bench.py --rows 1,16,64 --shapes 4864x896

Without VNNI or AMX, oneDNN's int8 sums saturate for 8-bit weights (its timing still stands).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from folio.models import onednn_int8, quant_kernels
from folio.models.dense_linear import DenseLinearMethod
from folio.models.linear import Linear
from folio.models.quant_reference import quantize_int8


def timed(fn, round_s: float) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < round_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="9728x896,896x4864", help="N x K of each layer")
    parser.add_argument("--rows", default="1,4,16,64,256,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-s", type=float, default=0.2)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call, median of {args.rounds} "
          f"rounds; oneDNN's int8 GEMM used here: {onednn_int8.usable()}, from {onednn_int8.min_rows()} rows")
    print(f"{'N x K':>11} {'rows':>5} {'bf16':>9} {'w8a8 kernel':>12} {'oneDNN int8':>12}   {'ratios to bf16':>16}")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        weight = torch.randn(n, k) * 0.05
        dense = Linear(k, n, params_dtype=torch.bfloat16)
        method = DenseLinearMethod(keep_copies=False)
        dense.bind(method)
        dense.weight.data.copy_(weight)
        method.process_weights_after_loading(dense)
        codes, scales = quantize_int8(weight, k)
        scales = scales.view(-1)
        packed = onednn_int8.prepack(codes, scales) if onednn_int8.available() else None
        for rows in (int(v) for v in args.rows.split(",")):
            x = torch.randn(rows, k)
            x16 = x.bfloat16()
            calls = {"bf16": lambda: dense(x16),
                     "kernel": lambda: quant_kernels.w8a8_linear(x16, codes, scales, None, True)}
            if packed is not None:
                calls["onednn"] = lambda: onednn_int8.linear(x16, packed, None, True)
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, fn in calls.items():
                    times[name].append(timed(fn, args.round_s) * 1e3)
            ms = {name: statistics.median(t) for name, t in times.items()}
            onednn_ms = ms.get("onednn", float("nan"))
            print(f"{shape:>11} {rows:>5} {ms['bf16']:9.3f} {ms['kernel']:12.3f} {onednn_ms:12.3f}   "
                  f"{ms['bf16'] / ms['kernel']:7.2f} {ms['bf16'] / onednn_ms:7.2f}", flush=True)


if __name__ == "__main__":
    main()
