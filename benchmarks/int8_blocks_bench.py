"""float32 weight-only int8 layers (`w8a16`, GGUF's Q8_0, the int8 lm_head of the int4 schemes and of a GGUF
file) with their weight in column blocks (folio.models.int8_blocks: x as 16-bit codes, integer products) against
the row-major weight-only kernel they ran before (float widening), side by side in one process. AVX2 CPUs without
AVX-512 keep the blocks; elsewhere this forces them in.

    python benchmarks/int8_blocks_bench.py [--shapes 49152x576] [--groups 576] [--rows 1,16,32,64] [--rounds 5]
    python benchmarks/int8_blocks_bench.py --engine [--model M] [--quantization w8a16] [--batches 1,16,32,64]

The first form times the layers (every shape, `--copies` of each called in turn so that the weights come from
memory; default: the default model's 49152 x 576 lm_head, one scale per channel); the median over rounds is
reported. --engine loads the model (float32) and switches its int8 layers between the two formats round by
round: the median decode step and its lm_head, for each batch size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from int8_gemm_bench import timed  # the sibling script's timer: seconds per call over a round
from step_overhead_bench import median_decode_step_ms

from folio import LLM, SamplingParams
from folio.models import int8_blocks, quant_kernels
from folio.models.linear import Linear
from folio.models.quant_reference import quantize_int8


def layers(args) -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call of every copy, median of "
          f"{args.rounds} rounds")
    weights = []
    for shape, group in zip(args.shapes.split(","), args.groups.split(",")):
        n, k = (int(v) for v in shape.split("x"))
        for _ in range(args.copies):
            q, s = quantize_int8(torch.randn(n, k) * 0.05, int(group))
            weights.append((k, q, s, int8_blocks.pack(q, s)))
    for rows in (int(v) for v in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k, *_ in weights}
        calls = {"row-major": lambda: [quant_kernels.weight_only_linear(xs[k], q, s, None, None) for k, q, s, _ in weights],
                 "blocks": lambda: [int8_blocks.linear(xs[k], b, None) for k, _, _, b in weights]}
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                times[name].append(timed(fn, args.round_s) * 1e3)
        old, new = statistics.median(times["row-major"]), statistics.median(times["blocks"])
        print(f"{rows:>5} rows: row-major {old:8.2f}  blocks {new:8.2f}  ({old / new:.2f}x)")


def engine(args) -> None:
    int8_blocks.available = lambda dtype: dtype == torch.float32  # forced in where the CPU has AVX-512
    llm = LLM(args.model, dtype="float32", quantization=args.quantization, max_num_seqs=max(args.batch_list),
              kv_cache_memory=1 << 29, max_model_len=2048)
    model = llm.llm_engine.runner.model
    int8 = [m for m in model.modules() if isinstance(m, Linear) and getattr(m, "int8_blocks", None) is not None]
    if not int8:
        raise SystemExit("no int8 layers in column blocks in this model (--quantization w8a16, or a GGUF file)")
    # the row-major twin of each layer's blocks: codes [NB, K / 2, 64, 2] -> [N, K], scales [NB, G, 64] -> [N, G]
    formats = []
    for layer in int8:
        blocks = layer.int8_blocks
        nb, pairs = blocks.codes.shape[:2]
        codes = blocks.codes.view(nb, pairs, 64, 2).permute(0, 2, 1, 3).reshape(nb * 64, -1)[:blocks.out_features]
        scales = blocks.scales.permute(0, 2, 1).reshape(nb * 64, -1)[:blocks.out_features]
        formats.append((blocks, torch.nn.Parameter(codes.contiguous(), requires_grad=False), scales.contiguous()))

    def use(blocks: bool) -> None:
        for layer, (b, codes, scales) in zip(int8, formats):
            layer.int8_blocks, layer.weight, layer.weight_scale = (b, None, None) if blocks else (None, codes, scales)

    head_times: list[float] = []
    compute_logits = model.compute_logits

    def timed_logits(hidden):
        start = time.perf_counter()
        out = compute_logits(hidden)
        head_times.append(time.perf_counter() - start)
        return out

    model.compute_logits = timed_logits
    print(f"{len(int8)} int8 layers in blocks; median decode step and its lm_head, ms, median of {args.rounds} rounds")
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0)
    for batch in args.batch_list:
        prompts = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(batch)]
        llm.generate(prompts, params, use_tqdm=False)
        steps, heads = {True: [], False: []}, {True: [], False: []}
        for r in range(args.rounds):
            for blocks in ((True, False) if r % 2 == 0 else (False, True)):
                use(blocks)
                head_times.clear()
                steps[blocks].append(median_decode_step_ms(llm, prompts, params))
                heads[blocks].append(statistics.median(head_times[2:]) * 1e3)
        use(True)
        ratio = statistics.median(old / new for old, new in zip(steps[False], steps[True]))
        print(f"batch {batch:>3}: step row-major {statistics.median(steps[False]):7.2f}  blocks "
              f"{statistics.median(steps[True]):7.2f}  ({ratio:.2f}x, median of the rounds' ratios); lm_head "
              f"{statistics.median(heads[False]):6.2f} -> {statistics.median(heads[True]):6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="49152x576", help="N x K of each layer")
    parser.add_argument("--groups", default="576", help="each shape's group size along K (K: one scale per row)")
    parser.add_argument("--rows", default="1,2,4,16,32,64,256")
    parser.add_argument("--copies", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-s", type=float, default=0.3)
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--batches", default="1,4,16,32,64")
    args = parser.parse_args()
    args.batch_list = [int(v) for v in args.batches.split(",")]
    if not int8_blocks.KERNEL.load() or not int8_blocks.KERNEL.load().has_kernel():
        raise SystemExit(f"the int8 block kernel is not available here: {int8_blocks.KERNEL.error or 'no AVX2'}")
    engine(args) if args.engine else layers(args)


if __name__ == "__main__":
    main()
