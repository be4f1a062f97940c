"""Perplexity of a model over a text, through the engine: what quantised weights and an 8-bit KV cache cost in
accuracy. The text (by default folio/bench/data/perplexity.txt, shipped with folio) is tokenised once and cut
into windows of --window tokens; each window is one request that asks for its prompt logprobs, so every token
after a window's first is scored given the tokens before it in its window, with the engine's kernels, linear
methods and KV cache exactly as they serve. Perplexity = exp(mean negative log-likelihood).

    folio bench perplexity --model MODEL --dtype bfloat16
    folio bench perplexity --model MODEL --dtype bfloat16 --quantization int8 --kv-cache-dtype int8

Compare figures of the same model, text and window only.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

from folio.bench.report import dtype_name, write_json
from folio.bench.throughput import model_name
from folio.config import EngineConfig
from folio.engine.llm_engine import LLMEngine
from folio.engine.output_processor import OutputKind
from folio.sampling_params import SamplingParams

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"
DEFAULT_WINDOW = 512


@dataclass
class PerplexityResult:
    model: str
    dtype: str
    quantization: str
    kv_cache_dtype: str
    text: str
    window: int
    num_windows: int
    scored_tokens: int
    mean_nll: float
    perplexity: float
    elapsed_s: float
    engine_config: dict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text file (default: the one folio ships)")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                        help=f"tokens per scored window (default: {DEFAULT_WINDOW}, at most max_model_len)")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    """Consecutive windows; a last one shorter than 2 tokens scores nothing and is dropped."""
    return [token_ids[i:i + window] for i in range(0, len(token_ids), window) if len(token_ids) - i >= 2]


def measure(engine: LLMEngine, text: str, window: int) -> tuple[int, int, float]:
    """(windows, scored tokens, summed negative log-likelihood) of the text."""
    chunks = windows(engine.get_tokenizer().encode(text, add_special_tokens=False), window)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    for i, chunk in enumerate(chunks):
        engine.add_request(str(i), {"prompt_token_ids": chunk}, params, output_kind=OutputKind.FINAL_ONLY)
    logprobs = {}
    while engine.has_unfinished_requests():
        logprobs.update((out.request_id, out.prompt_logprobs) for out in engine.step() if out.finished)
    nll, scored = 0.0, 0
    for i, chunk in enumerate(chunks):
        for token, entry in zip(chunk[1:], logprobs[str(i)][1:]):
            nll -= entry[token].logprob
            scored += 1
    return len(chunks), scored, nll


def main(args: argparse.Namespace, config: EngineConfig) -> int:
    if args.window < 2:
        raise ValueError(f"--window must be at least 2, got {args.window}")
    text = Path(args.text).read_text(encoding="utf-8")
    engine = LLMEngine(config)
    window = min(args.window, engine.max_model_len)
    start = time.perf_counter()
    num_windows, scored, nll = measure(engine, text, window)
    result = PerplexityResult(
        model=model_name(config), dtype=dtype_name(config.model.torch_dtype),
        quantization=config.model.quantization or ("gguf" if config.model.gguf_as_stored else "none"),
        kv_cache_dtype=config.cache.kv_cache_dtype,
        text=args.text, window=window, num_windows=num_windows, scored_tokens=scored, mean_nll=nll / scored,
        perplexity=math.exp(nll / scored), elapsed_s=time.perf_counter() - start,
        engine_config=dataclasses.asdict(config))
    print(f"folio bench perplexity: {result.model} ({result.dtype}, quantization {result.quantization}, "
          f"KV cache {result.kv_cache_dtype})")
    print(f"  {result.text}: {scored} tokens scored in {num_windows} windows of {window}, {result.elapsed_s:.1f} s")
    print(f"  perplexity {result.perplexity:.4f} (mean NLL {result.mean_nll:.5f})")
    if args.json:
        write_json(args.json, result)
    return 0
