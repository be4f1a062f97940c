"""What a decode step costs besides its linear layers: the same engine's median decode step with its linear
layers as they are, then with every Linear.forward returning a zero tensor of its output's shape (norms, rotary,
attention, sampling and the Python between them still run). The second figure is the step's fixed cost with warm
caches; in the real step the weight streams evict those caches, so its non-linear part costs more than that.

    python benchmarks/step_overhead_bench.py [--model M] [--quantization int4] [--batch 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from folio import LLM, SamplingParams
from folio.engine.llm_engine import LLMEngine
from folio.models.layers import silu_and_mul
from folio.models.linear import Linear


def median_decode_step_ms(llm: LLM, prompts: list[dict], params: SamplingParams) -> float:
    """The median engine step of one generation, its first two (prefill, first decode) left out."""
    times: list[float] = []
    step = LLMEngine.step

    def timed(engine, *args, **kwargs):
        start = time.perf_counter()
        out = step(engine, *args, **kwargs)
        times.append(time.perf_counter() - start)
        return out

    LLMEngine.step = timed
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        LLMEngine.step = step
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=args.batch,
              kv_cache_memory=1 << 30, max_model_len=4096)
    prompts = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    zeros: dict[tuple[int, int], torch.Tensor] = {}

    def zero_forward(layer: Linear, x: torch.Tensor) -> torch.Tensor:
        key = (id(layer), x.shape[0])
        if key not in zeros:
            zeros[key] = torch.zeros(x.shape[0], layer.output_size, dtype=x.dtype)
        return silu_and_mul(zeros[key]) if layer.silu_and_mul else zeros[key]  # a gate/up's op still runs

    real, zeroed = [], []
    forward = Linear.forward
    for _ in range(args.rounds):
        real.append(median_decode_step_ms(llm, prompts, params))
        Linear.forward = zero_forward
        try:
            zeroed.append(median_decode_step_ms(llm, prompts, params))
        finally:
            Linear.forward = forward
    print(f"{args.model or 'default model'} ({args.dtype}, quantization {args.quantization or 'none'}), decode step "
          f"of {args.batch} requests, ms (best of {args.rounds}): real {min(real):.3f}, linear layers zeroed "
          f"{min(zeroed):.3f}")


if __name__ == "__main__":
    main()
