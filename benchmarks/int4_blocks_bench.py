"""Weight-only int4 matmuls at decode batch sizes, side by side in one process: the column-block kernel
(folio.models.int4_blocks), the row-major weight-only kernel (quant_kernels.weight_only_linear) and the dense
GEMM on the weight dequantised from the blocks (what batches past int4_blocks.MAX_ROWS run), with bf16's
small-batch kernel on the same shapes for reference. Every linear layer of the 0.5B Qwen2 but the lm_head, 24
copies of each, so the weights come from memory as a decode step reads them; random weights quantised in
groups of 32, bf16 activations. The calls alternate round by round; the best round is reported, with GB/s of
each format's bytes (int4 blocks 0.625 bytes a weight, row-major 0.75, bf16 2).

    python benchmarks/int4_blocks_bench.py [--rows 1,2,3,4,8,16,64] [--rounds 3]
    python benchmarks/int4_blocks_bench.py --prefill [--prefill-rows 1852]

--prefill times instead what a prefill-sized batch runs, one layer of each shape (the GEMM is compute-bound):
oneDNN's GEMM on the weight dequantised into the packed scratch (folio.models.packed_scratch), int4 and int8
(weight-only), against F.linear on the plain dequantised weight (what ran before) and bf16's prepacked weight.

Needs AVX512-BF16 (the block kernel and bf16's small-batch kernel).
"""

from __future__ import annotations

import argparse

import torch
from int8_gemm_bench import timed  # the sibling script's timer: seconds per call over a round

from folio.models import int4_blocks, packed_scratch, quant_kernels, small_batch_gemm
from folio.models.quant_reference import quantize_int4, quantize_int8

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # qkv, o, gate_up, down
COPIES = 24


def prefill(rows: int, rounds: int, round_s: float) -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {rows} rows, ms per call, best of {rounds}")
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.02
        x = torch.randn(rows, k).bfloat16()
        blocks = int4_blocks.pack(*quantize_int4(w, 32))
        q8, s8 = quantize_int8(w, 32)
        bf16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64)

        def int8_scratch():
            return packed_scratch.linear(x, n, lambda blocks: quant_kernels.dequantize_packed(q8, s8, None, blocks),
                                         lambda: quant_kernels.dequantize(q8, s8, None, torch.bfloat16), None)

        runs = {
            "bf16 prepacked": lambda: torch.ops.mkldnn._linear_pointwise(x, bf16, None, "none", [], ""),
            "int4 scratch": lambda: int4_blocks.dense_linear(x, blocks, None),
            "int4 F.linear": lambda: torch.nn.functional.linear(x, int4_blocks.dequantize(blocks)),
            "int8 scratch": int8_scratch,
            "int8 F.linear": lambda: torch.nn.functional.linear(x, quant_kernels.dequantize(q8, s8, None,
                                                                                            torch.bfloat16)),
        }
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(rounds):
            for name, fn in runs.items():
                best[name] = min(best[name], timed(fn, round_s))
        print(f"{n:>5} x {k:<5} " + "   ".join(f"{name} {t * 1e3:7.2f}" for name, t in best.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,3,4,8,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--round-s", type=float, default=0.5)
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--prefill-rows", type=int, default=1852)
    args = parser.parse_args()
    if not (int4_blocks.available() and small_batch_gemm.available(torch.bfloat16)):
        raise SystemExit("needs AVX512-BF16: the int4 block kernel or bf16's small-batch kernel is unavailable here")
    torch.manual_seed(0)
    if args.prefill:
        if packed_scratch.for_shape(*SHAPES[0]) is None:
            raise SystemExit("oneDNN's packed bf16 layout is not one folio recognises here: no packed scratch")
        return prefill(args.prefill_rows, args.rounds, args.round_s)
    layers = []
    for n, k in SHAPES:
        for _ in range(COPIES):
            w = torch.randn(n, k) * 0.02
            packed, scales, offsets = quantize_int4(w, 32)
            bf16 = w.bfloat16()
            plain = small_batch_gemm.packed_blocks(torch.ops.mkldnn._reorder_linear_weight(bf16, 64), bf16)
            layers.append((k, (packed, scales, offsets), int4_blocks.pack(packed, scales, offsets), plain))
    weights = sum(n * k for n, k in SHAPES) * COPIES
    gb = {"blocks": weights * 0.625 / 1e9, "row-major": weights * 0.75 / 1e9, "bf16": weights * 2 / 1e9}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(layers)} layers, "
          f"{weights / 1e6:.0f}M weights; ms per pass over all of them, best of {args.rounds} rounds (GB/s)")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES}
        runs = {
            "blocks": lambda: [int4_blocks.linear(xs[k], b, None) for k, _, b, _ in layers],
            "row-major": lambda: [quant_kernels.weight_only_linear(xs[k], *q, None) for k, q, _, _ in layers],
            "dequantised GEMM": lambda: [torch.nn.functional.linear(xs[k], int4_blocks.dequantize(b))
                                         for k, _, b, _ in layers],
            "bf16": lambda: [small_batch_gemm.linear(xs[k], p, None) for k, _, _, p in layers],
        }
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.rounds):
            for name, fn in runs.items():
                best[name] = min(best[name], timed(fn, args.round_s))
        cells = [f"{name} {t * 1e3:7.2f}" + (f" ({gb[name] / t:4.1f})" if name in gb else "")
                 for name, t in best.items()]
        print(f"M={rows:<3} " + "   ".join(cells) + f"   blocks vs row-major {best['row-major'] / best['blocks']:.2f}x,"
              f" vs bf16 {best['bf16'] / best['blocks']:.2f}x")


if __name__ == "__main__":
    main()
