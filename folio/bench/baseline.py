"""folio against Hugging Face Transformers on the same model, the same requests and the same threads, in one
run (so that machine noise hits both alike), as the performance study measured its baselines:

* sequential `generate()`: a few requests one at a time, the whole workload's time extrapolated from them;
* static batching: `generate()` on left-padded batches of each size in --hf-batch-sizes, the whole workload at
  each size; the best size is the baseline to beat (a batch runs as long as its longest request, and only the
  tokens each request asked for count);
* folio: `bench throughput` on the workload.

Greedy, EOS held back (`min_new_tokens`), so every system generates exactly the requested tokens. A GGUF model
is dequantised by Transformers to the same dtype folio computes in. Transformers is a development dependency,
imported only here, never by the engine.

    folio bench baseline --model MODEL --dtype bfloat16 --num-prompts 64 --input-len 256 --output-len 128
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from folio.bench import throughput
from folio.bench.noise import NOISY_CORES, OtherLoad, note
from folio.bench.report import write_json
from folio.bench.throughput import ThroughputResult
from folio.bench.workload import BenchRequest, add_workload_arguments, describe
from folio.config import EngineConfig
from folio.loader.default_model import default_model_path


@dataclass
class BaselineRun:
    mode: str  # "sequential" (one request at a time, extrapolated) or "static" (left-padded batches)
    batch: int
    measured_prompts: int  # prompts actually run
    output_tokens: int  # of the whole workload
    elapsed_s: float  # for the whole workload; extrapolated in sequential mode
    output_tokens_per_s: float
    folio_speedup: float  # folio's output tokens/s over this run's
    other_cores: float  # CPU other processes used meanwhile (folio.bench.noise)

    @property
    def label(self) -> str:
        if self.mode == "sequential":
            return f"sequential generate ({self.measured_prompts} prompts, extrapolated)"
        return f"static batch {self.batch}"


@dataclass
class BaselineResult:
    model: str
    dtype: str
    workload: str
    threads: int
    transformers_version: str
    sequential: Optional[BaselineRun]
    static: list[BaselineRun]
    best_static: Optional[BaselineRun]
    folio: ThroughputResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    group = parser.add_argument_group("transformers")
    group.add_argument("--hf-sequential-prompts", type=int, default=4,
                       help="requests run one at a time; the workload's time is extrapolated from them "
                            "(default: 4; 0 = skip)")
    group.add_argument("--hf-batch-sizes", default="8,16,32,64",
                       help="static batch sizes to try, comma-separated; sizes above --num-prompts are dropped, "
                            "and --num-prompts is used when none is left (default: 8,16,32,64; '' = skip)")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")


def _batch_sizes(text: str, num_prompts: int) -> list[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"--hf-batch-sizes takes comma-separated integers, got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise ValueError("--hf-batch-sizes must be >= 1")
    fitting = [s for s in sizes if s <= num_prompts]
    return fitting or ([num_prompts] if sizes else [])


def load_transformers_model(model: Optional[str], dtype: torch.dtype) -> torch.nn.Module:
    """The model folio would load, through Transformers: a folder, or a GGUF file dequantised to dtype."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isdir(path):
        net = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        net = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path) or ".", gguf_file=os.path.basename(path), dtype=dtype,
            quantization_config=transformers.GgufConfig(dequantize=True))
    return net.eval()


class TransformersRunner:
    """Greedy fixed-length `generate()` on left-padded batches of token ids."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        gen = model.generation_config
        self.eos = gen.eos_token_id
        first_eos = self.eos[0] if isinstance(self.eos, list) else self.eos
        self.pad_id = next((i for i in (gen.pad_token_id, first_eos) if i is not None), 0)

    @torch.inference_mode()
    def generate(self, requests: list[BenchRequest], output_len: Optional[int] = None) -> float:
        """Seconds to generate the batch: as many tokens as its longest request asks for (or output_len)."""
        from transformers import GenerationConfig

        prompts = [r.prompt_token_ids for r in requests]
        new_tokens = output_len or max(r.output_len for r in requests)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=self.pad_id, eos_token_id=self.eos)
        start = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        elapsed = time.perf_counter() - start
        if out.shape[1] != width + new_tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, not {new_tokens}")
        return elapsed


def time_transformers(model: torch.nn.Module, requests: list[BenchRequest], sequential_prompts: int,
                      batch_sizes: list[int]) -> list[tuple[str, int, int, float, float]]:
    """(mode, batch, prompts run, seconds for the whole workload, other cores) of each Transformers run."""
    runner = TransformersRunner(model)
    runner.generate(requests[:2], output_len=throughput.WARMUP_OUTPUT_LEN)
    timings = []
    measured = min(sequential_prompts, len(requests))
    if measured > 0:
        load = OtherLoad()
        seconds = sum(runner.generate([r]) for r in requests[:measured]) * len(requests) / measured
        timings.append(("sequential", 1, measured, seconds, load.cores()))
    for batch in batch_sizes:
        load = OtherLoad()
        seconds = sum(runner.generate(requests[i:i + batch]) for i in range(0, len(requests), batch))
        timings.append(("static", batch, len(requests), seconds, load.cores()))
    return timings


def main(args: argparse.Namespace, config: EngineConfig) -> int:
    import transformers

    sizes = _batch_sizes(args.hf_batch_sizes, args.num_prompts)
    engine, requests = throughput.prepare(args, config)  # also sets the thread count both systems use
    timings = time_transformers(load_transformers_model(config.model.model, config.model.torch_dtype), requests,
                                args.hf_sequential_prompts, sizes)  # the model is freed before folio runs
    throughput.warm_up(engine, requests, throughput.DEFAULT_WARMUP_PROMPTS)
    folio = throughput.measure(engine, requests, describe(args), breakdown=False)
    output_tokens = sum(r.output_len for r in requests)
    runs = [BaselineRun(mode, batch, prompts, output_tokens, seconds, output_tokens / seconds,
                        folio.output_tokens_per_s * seconds / output_tokens, cores)
            for mode, batch, prompts, seconds, cores in timings]
    static = [r for r in runs if r.mode == "static"]
    result = BaselineResult(throughput.model_name(config), folio.dtype, describe(args), torch.get_num_threads(),
                            transformers.__version__, next((r for r in runs if r.mode == "sequential"), None),
                            static, max(static, key=lambda r: r.output_tokens_per_s, default=None), folio)
    print_result(result)
    if args.json:
        write_json(args.json, result)
    return 0


def print_result(result: BaselineResult) -> None:
    print(f"folio bench baseline: {result.model} ({result.dtype}), {result.workload}, {result.threads} threads, "
          f"transformers {result.transformers_version}")
    print(f"  {'system':<14}{'mode':<46}{'output tok/s':>13}{'workload s':>12}{'folio is':>10}{'other cores':>13}")
    rows = ([result.sequential] if result.sequential else []) + result.static
    for run in rows:
        best = " (best)" if run is result.best_static else ""
        print(f"  {'transformers':<14}{run.label + best:<46}{run.output_tokens_per_s:>13.1f}{run.elapsed_s:>12.1f}"
              f"{f'x{run.folio_speedup:.2f}':>10}{run.other_cores:>13.2f}")
    print(f"  {'folio':<14}{'continuous batching':<46}{result.folio.output_tokens_per_s:>13.1f}"
          f"{result.folio.elapsed_s:>12.1f}{'':>10}{result.folio.other_cores:>13.2f}")
    worst = max([r.other_cores for r in rows] + [result.folio.other_cores])
    if worst >= NOISY_CORES:
        print(f"  {note(worst)}")
