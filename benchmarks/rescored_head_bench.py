"""The int4 schemes' rescored lm_head (folio.models.rescored_head) against the int8 head it replaced, on a model
whose head is tied to its embedding.

Speed (default): three engines resident in one process, bf16, `int4` as it is, and `int4` with the int8 head
(the chooser patched as before this head), each generation's median decode step measured in turn, the order
reversed every other round; prints each round and the median over rounds of the speed ratio to bf16.

    python benchmarks/rescored_head_bench.py --model M [--rounds 6] [--num-prompts 2 --input-len 32
        --output-len 128 --max-num-seqs 1]

--perplexity K [K ...]: the shipped text's perplexity (as `folio bench perplexity --dtype bfloat16
--quantization int4`) with the head rescoring its top K logits per row; K = 0 is the int8 head.

    python benchmarks/rescored_head_bench.py --perplexity 0 32 128 512 [--model M] [--group 32]

--group G: the head's int4 groups (rescored_head.GROUP, default 64) in both modes.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from pathlib import Path
from typing import Optional

from folio import LLM, SamplingParams
from folio.bench.perplexity import DEFAULT_TEXT, measure
from folio.config import EngineConfig
from folio.engine.llm_engine import LLMEngine
from folio.models import rescored_head
from step_overhead_bench import median_decode_step_ms  # the sibling script's timer


def with_head(top_k: Optional[int], build):
    """build() with the int4 schemes' head rescoring top_k logits a row (None: the int8 head)."""
    serves, default = rescored_head.serves, rescored_head.TOP_K
    if top_k is None:
        rescored_head.serves = lambda layer: False
    else:
        rescored_head.TOP_K = top_k  # read by the quantization chooser, as GROUP is
    try:
        return build()
    finally:
        rescored_head.serves, rescored_head.TOP_K = serves, default


def speed(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    options = {"max_num_seqs": args.max_num_seqs, "kv_cache_memory": 1 << 28, "enable_prefix_caching": False}
    llms = {"bfloat16": LLM(args.model, dtype="bfloat16", **options),
            "int4": LLM(args.model, dtype="bfloat16", quantization="int4", **options),
            "int4, int8 head": with_head(None, lambda: LLM(args.model, dtype="bfloat16", quantization="int4",
                                                          **options))}
    head = type(llms["int4"].llm_engine.runner.model.lm_head.method).__name__
    print(f"{args.model}: int4's head {head}")
    for llm in llms.values():
        llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)
    steps: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(args.rounds):
        for name in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
            steps[name].append(median_decode_step_ms(llms[name], prompts, params))
        print(f"round {r + 1}: " + ", ".join(f"{name} {ms[-1]:.2f} ms" for name, ms in steps.items()), flush=True)
    for name, ms in steps.items():
        ratios = [base / own for base, own in zip(steps["bfloat16"], ms)]
        print(f"  {name:<16} median step {statistics.median(ms):6.2f} ms   speed x{statistics.median(ratios):.2f} "
              f"bf16 (rounds {min(ratios):.2f}-{max(ratios):.2f})")


def perplexity(args: argparse.Namespace) -> None:
    text = Path(DEFAULT_TEXT).read_text(encoding="utf-8")
    for k in args.perplexity:
        config = EngineConfig.from_kwargs(**({"model": args.model} if args.model else {}), dtype="bfloat16",
                                          quantization="int4")
        engine = with_head(k or None, lambda: LLMEngine(config))
        _, scored, nll = measure(engine, text, 512)
        print(f"top k {k or '- (int8 head)'}: perplexity {math.exp(nll / scored):.4f}", flush=True)
        del engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model with a tied head (default: folio's default model)")
    parser.add_argument("--perplexity", type=int, nargs="+", default=None, metavar="K")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=1)
    parser.add_argument("--group", type=int, default=rescored_head.GROUP)
    args = parser.parse_args()
    rescored_head.GROUP = args.group
    if args.perplexity is not None:
        perplexity(args)
    elif args.model is None:
        parser.error("speed needs --model (a model with a tied head, e.g. folio bench make-model --arch qwen2-0.5b)")
    else:
        speed(args)


if __name__ == "__main__":
    main()
