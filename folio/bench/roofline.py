"""The fastest this machine could possibly run a workload, from two measured limits (the method of
shared/design/performance-study.md §2-3):

* memory bandwidth: a read-only sum over a buffer far larger than the last-level cache (with --run, read again
  after the run, since a shared machine's bandwidth moves within minutes; the bound uses the higher reading);
* matrix throughput: `F.linear` at the model's own shapes with a large M, in the engine's dtype and float32.

A decode step must stream every weight once, counted in the engine's dtype (the unquantised model's bound:
quantised layers, a GGUF file's by default, stream fewer bytes, and the report says so; a float32 run of a bf16
checkpoint holds its weights in bf16, and they are counted so: `held_weight_dtype`), plus the KV cache of
every request, and do 2 FLOPs per weight per request, so it takes at least
max(bytes / bandwidth, FLOPs / peak), peak being the best rate among the model's shapes. Prefill is bounded the
same way, with the lm_head counted only at the last prompt position (the only one that samples). The workload
bound adds prefill to ceil(N / batch) waves of (output_len - 1) decode steps at the mean context, batch being
the most requests the engine can hold at once. Measured rates are noisy on a shared machine, and differ between
machines of one kind (a CPU without AMX computes bf16 several times slower): that is why they are measured.

    folio bench roofline --model MODEL --dtype bfloat16                  # limits and the bound
    folio bench roofline --model MODEL --achieved-tok-s 205              # ... next to a measured figure
    folio bench roofline --model MODEL --run                             # ... next to `bench throughput`
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from folio.bench.noise import OtherLoad, note
from folio.bench.report import dtype_name, write_json
from folio.bench import throughput
from folio.bench.throughput import ThroughputResult
from folio.bench.workload import DEFAULT_OUTPUT_LEN, add_workload_arguments, describe
from folio.config import EngineConfig
from folio.loader.default_model import default_model_path
from folio.loader.gguf_loader import read_gguf
from folio.models.model_config import ModelConfig
from folio.platforms import current_platform
from folio.platforms.cpu_features import cpu_description
from folio.worker.kv_cache import KVCacheSpec


@dataclass
class MatmulRate:
    name: str  # which of the model's linear layers
    k: int  # input features
    n: int  # output features
    m: int  # rows (tokens)
    gflops: dict[str, float]  # per dtype, median


@dataclass
class MachineLimits:
    threads: int
    bandwidth_gb_s: float  # read-only: the highest reading (the bound is then the most optimistic one)
    bandwidth_buffer_mib: int
    bandwidth_readings: list[float]  # each the median of --reps sums: before the limits, and after a --run
    matmul: list[MatmulRate]
    peak_gflops: dict[str, float]  # per dtype: the best of the model's shapes
    other_cores: float  # CPU other processes used meanwhile (folio.bench.noise)
    cpu: str = ""  # folio.platforms.cpu_features.cpu_description()


@dataclass
class ModelCost:
    matmul_params: int  # weights every token goes through, lm_head included
    lm_head_params: int
    weight_bytes: int  # streamed by every decode step
    weight_dtype: str  # what they are counted in (`held_weight_dtype`)
    kv_bytes_per_token: int
    attention_flops_per_context_token: int  # per query token: QK^T and PV over each context token, all layers


@dataclass
class StepBound:
    batch: int
    context: float  # mean tokens of context per request
    bytes: float
    flops: float
    memory_ms: float
    compute_ms: float
    limited_by: str  # "memory" or "compute"
    tokens_per_s: float  # batch / step time

    @property
    def seconds(self) -> float:
        return max(self.memory_ms, self.compute_ms) / 1e3


@dataclass
class WorkloadBound:
    batch: int  # requests decoding together
    waves: int
    prefill_flops: float
    prefill_s: float
    decode_steps: int
    decode_s: float
    total_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    decode_step: StepBound  # at the full batch
    decode_batch1: StepBound  # one request alone


@dataclass
class RooflineResult:
    model: str
    dtype: str
    workload: str
    limits: MachineLimits
    cost: ModelCost
    bound: WorkloadBound
    achieved_output_tokens_per_s: Optional[float]
    achieved_fraction: Optional[float]  # achieved / bound
    throughput: Optional[ThroughputResult]  # with --run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    group = parser.add_argument_group("measurement")
    group.add_argument("--bandwidth-mib", type=int, default=2048,
                       help="buffer of the bandwidth test; keep it far above the L3 (default: 2048)")
    group.add_argument("--matmul-m", type=int, default=512, help="rows of the matmul test (default: 512)")
    group.add_argument("--reps", type=int, default=5, help="repetitions of each test; the median counts (default: 5)")
    parser.add_argument("--achieved-tok-s", type=float, help="an output tokens/s figure to set against the bound")
    parser.add_argument("--run", action="store_true", dest="run_throughput",
                        help="run `bench throughput` on the same workload and set its figure against the bound")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")


def read_model_config(model: Optional[str]) -> ModelConfig:
    """The architecture alone, without loading weights."""
    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return ModelConfig.from_hf_dict(json.load(f))
    return ModelConfig.from_hf_dict(read_gguf(path).hf_config)


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each distinct linear layer, with q/k/v and gate/up fused as an engine fuses them."""
    h, d = cfg.hidden_size, cfg.head_dim
    return {"qkv": (h, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d),
            "o": (cfg.num_attention_heads * d, h),
            "gate_up": (h, 2 * cfg.intermediate_size),
            "down": (cfg.intermediate_size, h),
            "lm_head": (h, cfg.vocab_size)}


def held_weight_dtype(cfg: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """The dtype a run in `dtype` holds the unquantised weights in: a float32 run of a checkpoint stored in bf16
    keeps them in bf16 (folio.models.bf16_valued: the same values in half the bytes), so its decode streams 2
    bytes a weight; any other run, `dtype`."""
    stored = cfg.hf_config.get("torch_dtype") or cfg.hf_config.get("dtype")
    return torch.bfloat16 if dtype == torch.float32 and stored == "bfloat16" else dtype


def model_cost(cfg: ModelConfig, dtype: torch.dtype) -> ModelCost:
    shapes = linear_shapes(cfg)
    per_layer = sum(k * n for name, (k, n) in shapes.items() if name != "lm_head")
    lm_head = cfg.hidden_size * cfg.vocab_size
    matmul = cfg.num_hidden_layers * per_layer + lm_head
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    kv_bytes_per_token = KVCacheSpec.for_model(cfg, 1, dtype).bytes_per_token
    held = held_weight_dtype(cfg, dtype)
    return ModelCost(matmul, lm_head, matmul * held.itemsize, dtype_name(held), kv_bytes_per_token, attention)


def _median_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: first-call set-up is not the rate
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def measure_bandwidth(bandwidth_mib: int, reps: int) -> float:
    """Read bandwidth in GB/s: the median time of a float32 sum over a buffer far larger than the caches."""
    buffer = torch.ones(bandwidth_mib * 2**20 // 4, dtype=torch.float32)  # ones, not empty: pages are touched
    return buffer.numel() * 4 / _median_seconds(buffer.sum, reps) / 1e9


@torch.inference_mode()
def measure_limits(cfg: ModelConfig, dtypes: list[torch.dtype], bandwidth_mib: int, m: int,
                   reps: int) -> MachineLimits:
    load = OtherLoad()
    bandwidth = measure_bandwidth(bandwidth_mib, reps)
    rates = []
    for name, (k, n) in linear_shapes(cfg).items():
        gflops = {}
        for dtype in dtypes:
            x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
            gflops[dtype_name(dtype)] = 2 * m * n * k / _median_seconds(lambda: F.linear(x, w), reps) / 1e9
        rates.append(MatmulRate(name, k, n, m, gflops))
    peaks = {d: max(r.gflops[d] for r in rates) for d in rates[0].gflops}
    return MachineLimits(torch.get_num_threads(), bandwidth, bandwidth_mib, [bandwidth], rates, peaks, load.cores(),
                         cpu_description())


def decode_step_bound(cost: ModelCost, batch: int, context: float, bandwidth_gb_s: float,
                      peak_gflops: float) -> StepBound:
    nbytes = cost.weight_bytes + batch * context * cost.kv_bytes_per_token
    flops = batch * (2 * cost.matmul_params + cost.attention_flops_per_context_token * context)
    memory_ms, compute_ms = nbytes / bandwidth_gb_s / 1e6, flops / peak_gflops / 1e6
    return StepBound(batch, context, nbytes, flops, memory_ms, compute_ms,
                     "memory" if memory_ms >= compute_ms else "compute", batch / max(memory_ms, compute_ms) * 1e3)


def workload_bound(cost: ModelCost, num_prompts: int, input_len: int, output_len: int, batch: int,
                   max_num_batched_tokens: int, bandwidth_gb_s: float, peak_gflops: float) -> WorkloadBound:
    prompt_tokens = num_prompts * input_len
    # each prompt position attends to itself and every earlier one; only the last position needs the lm_head
    attention = cost.attention_flops_per_context_token * input_len * (input_len + 1) / 2
    prefill_flops = num_prompts * (2 * (cost.matmul_params - cost.lm_head_params) * input_len
                                   + 2 * cost.lm_head_params + attention)
    prefill_bytes = (math.ceil(prompt_tokens / max_num_batched_tokens) * cost.weight_bytes
                     + prompt_tokens * cost.kv_bytes_per_token)
    prefill_s = max(prefill_bytes / bandwidth_gb_s, prefill_flops / peak_gflops) / 1e9
    context = input_len + output_len / 2
    steps = output_len - 1  # the first output token comes out of prefill
    waves = [batch] * (num_prompts // batch) + ([num_prompts % batch] if num_prompts % batch else [])
    decode_s = sum(steps * decode_step_bound(cost, b, context, bandwidth_gb_s, peak_gflops).seconds for b in waves)
    total = prefill_s + decode_s
    return WorkloadBound(batch, len(waves), prefill_flops, prefill_s, steps * len(waves), decode_s, total,
                         num_prompts * output_len / total, num_prompts * (input_len + output_len) / total,
                         decode_step_bound(cost, batch, context, bandwidth_gb_s, peak_gflops),
                         decode_step_bound(cost, 1, context, bandwidth_gb_s, peak_gflops))


def max_batch(config: EngineConfig, cost: ModelCost, num_prompts: int, request_tokens: int) -> int:
    """Requests the engine can decode together: bounded by max_num_seqs and by the KV cache."""
    kv_capacity = current_platform().kv_cache_budget(config.cache.kv_cache_memory) // cost.kv_bytes_per_token
    return max(1, min(num_prompts, config.scheduler.max_num_seqs, kv_capacity // request_tokens))


def print_result(result: RooflineResult) -> None:
    limits, cost, bound = result.limits, result.cost, result.bound
    peak = limits.peak_gflops[result.dtype]
    print(f"folio bench roofline: {result.model} ({result.dtype}), {result.workload}, threads {limits.threads}")
    if limits.cpu:
        print(f"  cpu: {limits.cpu}")
    readings = ""
    if len(limits.bandwidth_readings) > 1:
        readings = (f"; before / after the run: {' / '.join(f'{b:.1f}' for b in limits.bandwidth_readings)}, "
                    f"the bound uses the highest")
    print(f"  read bandwidth {limits.bandwidth_gb_s:.1f} GB/s (sum over {limits.bandwidth_buffer_mib} MiB{readings})")
    print(f"  F.linear GFLOP/s at M={limits.matmul[0].m}:")
    print(f"    {'layer':<10}{'in -> out':>16}" + "".join(f"{d:>12}" for d in limits.peak_gflops))
    for r in limits.matmul:
        print(f"    {r.name:<10}{f'{r.k} -> {r.n}':>16}" + "".join(f"{g:>12.0f}" for g in r.gflops.values()))
    print(f"  limits measured while {note(limits.other_cores)}")
    print(f"  model: {cost.matmul_params / 1e6:.1f}M matmul weights per token "
          f"(lm_head {cost.lm_head_params / 1e6:.1f}M), {cost.weight_bytes / 1e9:.3f} GB per decode step"
          + (f" (held in {cost.weight_dtype}, as the checkpoint stores them)" if cost.weight_dtype != result.dtype
             else "") + f", KV {cost.kv_bytes_per_token / 1024:.1f} KiB per token")
    print(f"  bound at {limits.bandwidth_gb_s:.1f} GB/s and {peak:.0f} GFLOP/s (the best {result.dtype} shape above):")
    for label, step in (("decode step", bound.decode_step), ("decode alone", bound.decode_batch1)):
        print(f"    {label}, batch {step.batch}, context {step.context:.0f}: {step.bytes / 1e9:.3f} GB, "
              f"{step.flops / 1e9:.1f} GFLOP -> memory {step.memory_ms:.1f} ms, compute {step.compute_ms:.1f} ms "
              f"({step.limited_by}-bound): <= {step.tokens_per_s:.1f} tokens/s")
    print(f"    workload: prefill {bound.prefill_flops / 1e12:.2f} TFLOP -> {bound.prefill_s:.2f} s; decode "
          f"{bound.decode_steps} steps in {bound.waves} wave(s) of <= {bound.batch} -> {bound.decode_s:.2f} s; "
          f"total {bound.total_s:.2f} s")
    print(f"    => at most {bound.output_tokens_per_s:.1f} output tokens/s "
          f"({bound.total_tokens_per_s:.1f} total tokens/s)")
    if result.achieved_output_tokens_per_s is not None:
        print(f"  achieved {result.achieved_output_tokens_per_s:.1f} output tokens/s = "
              f"{100 * result.achieved_fraction:.0f}% of the bound")
    decode = result.throughput.breakdown.decode if result.throughput and result.throughput.breakdown else None
    if decode and decode.num_steps:
        step = decode_step_bound(cost, round(decode.mean_requests), bound.decode_step.context,
                                 limits.bandwidth_gb_s, peak)
        print(f"  decode-only steps: {decode.mean_ms:.1f} ms at {decode.mean_requests:.1f} requests; the bound is "
              f"{step.seconds * 1e3:.1f} ms ({100 * step.seconds * 1e3 / decode.mean_ms:.0f}% of the measured step)")


def main(args: argparse.Namespace, config: EngineConfig) -> int:
    if args.dataset != "random":
        raise ValueError("the roofline needs fixed lengths: use the random dataset (--input-len, --output-len)")
    if args.bandwidth_mib < 1 or args.matmul_m < 1 or args.reps < 1:
        raise ValueError("--bandwidth-mib, --matmul-m and --reps must be >= 1")
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    current_platform().prepare_process(config.parallel.num_threads)  # as the engine will
    cfg, dtype = read_model_config(config.model.model), config.model.torch_dtype
    cost = model_cost(cfg, dtype)
    limits = measure_limits(cfg, list(dict.fromkeys([dtype, torch.float32])), args.bandwidth_mib, args.matmul_m,
                            args.reps)
    run = None
    achieved = args.achieved_tok_s
    if args.run_throughput:
        engine, requests = throughput.prepare(args, config)
        throughput.warm_up(engine, requests, throughput.DEFAULT_WARMUP_PROMPTS)
        run = throughput.measure(engine, requests, describe(args), breakdown=True)
        throughput.print_result(run)
        achieved = run.output_tokens_per_s
        # a shared machine's bandwidth moves by tens of percent within minutes: read it again after the run
        limits.bandwidth_readings.append(measure_bandwidth(args.bandwidth_mib, args.reps))
        limits.bandwidth_gb_s = max(limits.bandwidth_readings)
    batch = max_batch(config, cost, args.num_prompts, args.input_len + output_len)
    bound = workload_bound(cost, args.num_prompts, args.input_len, output_len, batch,
                           config.scheduler.max_num_batched_tokens, limits.bandwidth_gb_s,
                           limits.peak_gflops[dtype_name(dtype)])
    result = RooflineResult(throughput.model_name(config), dtype_name(dtype), describe(args), limits, cost, bound,
                            achieved, None if achieved is None else achieved / bound.output_tokens_per_s, run)
    print_result(result)
    if config.model.weight_scheme or config.model.gguf_as_stored:
        print(f"  (weights counted in {dtype_name(dtype)}: this engine's quantised layers stream fewer bytes, so its "
              f"decode can beat this bound; --quantization none runs the model as counted)")
    if args.json:
        write_json(args.json, result)
    return 0
