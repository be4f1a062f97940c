"""One layer's matmul at decode and prefill batch sizes, side by side in one process: the dense bf16 GEMM (oneDNN
on the prepacked weight, as the dense linear method runs it), folio's row-major W8A8 kernel, its kernel on
oneDNN's packed weight (VNNI) and oneDNN's int8 GEMM (folio.models.onednn_int8), each as the int8 scheme runs it
(rotated activations, the quantisation of the rows and the scaling of the result included), and that packed weight
on the tiles (folio's AMX tile loop with AMX-INT8: the path of batches of 4 to 128 rows there; brgemm's
elsewhere); then the int8
weight with int16 activations (the int4 schemes' lm_head: the packed kernel, oneDNN's two GEMMs) and a `w8a16`
layer (weight-only: its kernel, or from quantized_linear.dequantize_min_rows rows the dense GEMM on the weight
dequantised for the call). The calls alternate round by round; the median over rounds is reported, with the ratios to bf16.
It picks onednn_int8.MIN_ROWS_VNNI, MIN_ROWS_VNNI_PACKED, MIN_ROWS_AMX and TILE_ROWS_AMX.

    python benchmarks/int8_gemm_bench.py                   # Qwen2-0.5B's gate/up and down shapes
    python benchmarks/int8_gemm_bench.py --rows 1,16,64 --shapes 4864x896
    python benchmarks/int8_gemm_bench.py --rows 1,2,4,8,16,32,64 --shapes 151936x896 --rounds 3   # its lm_head
    # the weights from memory, as decode reads them: all linear layers of the 0.5B Qwen2, 24 copies of each
    python benchmarks/int8_gemm_bench.py --shapes 1152x896,896x896,9728x896,896x4864 --copies 24 --rows 1,4,8,16

Without VNNI or AMX, oneDNN's int8 sums saturate for 8-bit weights (its timing still stands).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Optional

import torch

from folio.memory import keep_freed_memory
from folio.models import onednn_int8, quant_kernels
from folio.models.dense_linear import DenseLinearMethod
from folio.models.int8_linear import Int8LinearMethod
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
    parser.add_argument("--copies", type=int, default=1,
                        help="distinct copies of each layer, called in turn: with enough of them the weights come "
                             "from memory rather than cache; times are then per call of every copy of every shape")
    args = parser.parse_args()
    keep_freed_memory()  # as the engine does: a 1852-row result (36 MB at 9728 columns) is not faulted in every call
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call, median of {args.rounds} "
          f"rounds; oneDNN's int8 GEMM used here: {onednn_int8.usable()}")
    layers = [layer(*(int(v) for v in shape.split("x"))) for shape in args.shapes.split(",")
              for _ in range(args.copies)]
    groups = [layers] if args.copies > 1 else [[one] for one in layers]
    for group in groups:
        name = f"{len(group)} layers" if len(group) > 1 else f"{group[0].n}x{group[0].k}"
        print(f"{name:>11}: from {group[0].packed.min_rows if group[0].packed else '-'} rows in oneDNN here")
        for rows in (int(v) for v in args.rows.split(",")):
            for one in group:
                one.x16 = torch.randn(rows, one.k).bfloat16()
            calls = {"bf16": lambda: [one.dense(one.x16) for one in group],
                     "kernel": lambda: [quant_kernels.w8a8_linear(one.x16, one.codes, one.scales, None, True)
                                        for one in group]}
            if all(one.packed is not None and one.packed.blocks is not None for one in group):
                calls["packed"] = lambda: [quant_kernels.w8a8_packed_linear(
                    one.x16, one.packed.blocks, one.packed.column_sums, one.scales, None, True) for one in group]
            if "packed" in calls and quant_kernels.has_w8a8_tiles():
                calls["tiles"] = lambda: [quant_kernels.w8a8_packed_linear(
                    one.x16, one.packed.blocks, one.packed.column_sums, one.scales, None, True, True) for one in group]
            if all(one.packed is not None for one in group):
                calls["onednn"] = lambda: [onednn_int8.linear(one.x16, one.onednn_only, None, True) for one in group]
            if "packed" in calls:
                calls["int16 packed"] = lambda: [quant_kernels.w8_int16_packed_linear(
                    one.x16, one.packed.blocks, one.packed.column_sums, one.scales, None) for one in group]
            if "tiles" in calls:
                calls["int16 tiles"] = lambda: [quant_kernels.w8_int16_packed_linear(
                    one.x16, one.packed.blocks, one.packed.column_sums, one.scales, None, True) for one in group]
            if "onednn" in calls:
                calls["int16 onednn"] = lambda: [onednn_int8.linear_int16(one.x16, one.onednn_only, None)
                                                 for one in group]
            calls["w8a16"] = lambda: [one.w8a16(one.x16) for one in group]
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.rounds):
                for call, fn in calls.items():
                    times[call].append(timed(fn, args.round_s) * 1e3)
            ms = {call: statistics.median(t) for call, t in times.items()}
            print(f"{name:>11} {rows:>5} rows: " + "  ".join(
                f"{call} {t:.3f}" + ("" if call == "bf16" else f" ({ms['bf16'] / t:.2f}x)") for call, t in ms.items()),
                flush=True)



@dataclasses.dataclass
class Layer:
    """One N x K layer in bf16 (the dense method) and in int8 (folio's own copy, oneDNN's packed one)."""

    n: int
    k: int
    dense: Linear
    w8a16: Linear
    codes: torch.Tensor
    scales: torch.Tensor
    packed: Optional[onednn_int8.PackedInt8Weight]
    onednn_only: Optional[onednn_int8.PackedInt8Weight]  # the packed weight without its blocks: oneDNN at any size
    x16: Optional[torch.Tensor] = None


def layer(n: int, k: int) -> Layer:
    weight = torch.randn(n, k) * 0.05
    dense = Linear(k, n, params_dtype=torch.bfloat16)
    method = DenseLinearMethod()
    dense.bind(method)
    dense.weight.data.copy_(weight)
    method.process_weights_after_loading(dense)
    w8a16 = Linear(k, n, params_dtype=torch.bfloat16)
    weight_only = Int8LinearMethod()
    w8a16.bind(weight_only)
    w8a16.weight.weight_loader(w8a16.weight, weight, None)
    weight_only.process_weights_after_loading(w8a16)
    codes, scales = quantize_int8(weight, k)
    scales = scales.view(-1)
    packed = onednn_int8.prepack(codes, scales) if onednn_int8.available() else None
    onednn_only = None if packed is None else dataclasses.replace(packed, blocks=None, min_rows=0, tile_rows=0)
    return Layer(n, k, dense, w8a16, codes, scales, packed, onednn_only)


if __name__ == "__main__":
    main()
