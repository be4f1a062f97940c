"""The small-batch kernel (folio.models.small_batch_gemm) against the library GEMM, side by side: oneDNN's GEMM
on the same packed weights, in bf16 or float32 (there also the kernel on the same weights kept as bf16 blocks:
folio.models.bf16_valued; the weights hold bf16 values, as a bf16 checkpoint's do).

1. Every linear layer of a model (random weights, more bytes than the caches hold, so each pass reads them
   from memory as a decode step does; a large L3 may hold SmolLM2's) multiplied by M rows up to MAX_ROWS:
   ms per pass, GB/s, ratio. All read the same packed weights, and in bf16 where the CPU has AMX the kernel's
   tile loop (`amx_linear`: the path of batches past MAX_ROWS there, up to AMX_ROWS) runs too.
2. End to end: single-sequence decode of the default model with the kernel on and off, alternating, the
   median of each (ms per output token).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/small_batch_gemm_bench.py [--dtype float32] [--rounds 3]
        [--skip-engine]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from folio.bench.noise import OtherLoad, note
from folio.models import bf16_valued, small_batch_gemm

MODELS = {  # hidden, q + 2 kv width, intermediate, layers
    "SmolLM2-135M": (576, 960, 1536, 30),
    "Qwen2-0.5B": (896, 1152, 4864, 24),
}


def layer_pass(model: str, m: int, rounds: int, dtype: torch.dtype) -> tuple[dict[str, float], float]:
    """ms per pass of each path ("library", "kernel", and in bf16 with AMX "amx"), and the weights' bytes."""
    hidden, qkv, inter, layers = MODELS[model]
    shapes = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * layers
    # bf16 values, as a bf16 checkpoint's weights are, so that in float32 they can also be kept in bf16
    weights = [torch.randn(n, k).to(torch.bfloat16).to(dtype) for n, k in shapes]
    xs = {k: torch.randn(m, k).to(dtype) for _, k in shapes}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    served = [small_batch_gemm.packed_blocks(p, w) for p, w in zip(packed, weights)]
    narrow = [bf16_valued.narrowed(w) for w in weights] if dtype == torch.float32 else []
    if None in narrow:  # a shape oneDNN lays out in a way folio does not read: no bf16 blocks
        narrow = []

    def library():
        for w, p in zip(weights, packed):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

    def kernel():
        for w, s in zip(weights, served):
            if dtype == torch.bfloat16:
                small_batch_gemm.vector_linear(xs[w.shape[1]], s, None)
            else:
                small_batch_gemm.linear(xs[w.shape[1]], s, None)

    def amx():
        for w, s in zip(weights, served):
            small_batch_gemm.amx_linear(xs[w.shape[1]], s, None)

    def bf16_blocks():
        for w, s in zip(weights, narrow):
            small_batch_gemm.linear(xs[w.shape[1]], s, None)

    paths = {"library": library, "kernel": kernel}
    if narrow:
        paths["kernel on bf16 blocks"] = bf16_blocks
    if dtype == torch.bfloat16 and small_batch_gemm.amx_available():
        paths["amx"] = amx
    times: dict[str, list[float]] = {name: [] for name in paths}
    for f in paths.values():
        f()
    for _ in range(rounds * 3):
        for name, f in paths.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return {name: statistics.median(ts) for name, ts in times.items()}, nbytes


def engine_decode(rounds: int, dtype: torch.dtype, library: str) -> None:
    from folio.entrypoints.llm import LLM
    from folio.sampling_params import SamplingParams

    llm = LLM(dtype=str(dtype).removeprefix("torch."), max_num_seqs=1)
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    prompt = {"prompt_token_ids": list(range(1000, 1032))}
    on = small_batch_gemm.MAX_ROWS[dtype]
    results: dict[str, list[float]] = {"kernel": [], library: []}
    llm.generate(prompt, params, use_tqdm=False)
    for _ in range(rounds):
        for name, rows in (("kernel", on), (library, 0)):
            small_batch_gemm.MAX_ROWS[dtype] = rows
            out = llm.generate(prompt, params, use_tqdm=False)[0]
            m = out.metrics
            results[name].append((m.last_token_time - m.first_token_time) / (len(out.outputs[0].token_ids) - 1))
    small_batch_gemm.MAX_ROWS[dtype] = on
    k, o = statistics.median(results["kernel"]), statistics.median(results[library])
    print(f"  default model, batch-1 decode: {library} {o * 1e3:.2f} ms/token, kernel {k * 1e3:.2f} ms/token "
          f"({o / k:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--skip-engine", action="store_true", help="only the per-layer comparison")
    ap.add_argument("--rows", type=int, nargs="+", help="the row counts to compare (default: up to MAX_ROWS), "
                    "e.g. beyond MAX_ROWS to find where the library overtakes the kernel (bf16; the float32 "
                    "kernel takes up to MAX_ROWS)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if not small_batch_gemm.available(dtype):
        needs = "AVX512-BF16" if dtype == torch.bfloat16 else "AVX2+FMA or AVX-512F"
        raise SystemExit(f"small-batch kernel unavailable here: {small_batch_gemm.KERNEL.error or 'needs ' + needs}")
    library = "oneDNN"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    load = OtherLoad()
    for model in MODELS:
        limit = small_batch_gemm.MAX_ROWS[dtype]
        for m in args.rows or sorted({m for m in (1, 2, 3, 4, 6, 8, 16, 32, 64) if m < limit} | {limit}):
            times, nbytes = layer_pass(model, m, args.rounds, dtype)
            o = times.pop("library")
            line = f"  {model:13s} M={m}  all linear layers ({nbytes / 1e6:.0f} MB): {library} {o * 1e3:6.2f} ms " \
                   f"({nbytes / o / 1e9:4.1f} GB/s)"
            for name, t in times.items():
                line += f"   {name} {t * 1e3:6.2f} ms ({nbytes / t / 1e9:4.1f} GB/s) {o / t:4.2f}x"
            print(line)
    if not args.skip_engine:
        engine_decode(args.rounds, dtype, library)
    print(f"  {note(load.cores())}")


if __name__ == "__main__":
    main()
