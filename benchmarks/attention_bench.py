"""Attention backends side by side: TorchSDPABackend (gathers the context) vs CPUPagedAttentionBackend (in place).

Times one layer's `forward` (KV write + attention) for decode steps of B requests with the same context
length, for model attention shapes, in one process: the two backends alternate round by round and the
median over rounds is reported, with the ratio and the effective KV read rate (K and V bytes of the whole
context / time per call). Every "layer" has its own cache and the calls cycle through enough layers that
the KV touched (>= --cold-mib) does not stay in the CPU caches, as in a real model; --hot reuses one layer.

    .venv/bin/python benchmarks/attention_bench.py                     # decode, B = 1, 16, 64, context 384
    .venv/bin/python benchmarks/attention_bench.py --prefill           # also prefill / chunked-prefill cases
    .venv/bin/python benchmarks/attention_bench.py --dtype float32 --threads 1
    .venv/bin/python benchmarks/attention_bench.py --long-queries      # long-query paths vs the paged kernel alone
    .venv/bin/python benchmarks/attention_bench.py --long-queries --versus-sdpa  # ... vs PyTorch's flash attention
    .venv/bin/python benchmarks/attention_bench.py --long-queries --query-lens 16,32,64  # where the path starts to win
    .venv/bin/python benchmarks/attention_bench.py --versus-kernel HEAD~1  # the kernel against an older build of it
    .venv/bin/python benchmarks/attention_bench.py --long-queries --versus-kernel HEAD~1  # both kernels, prefill cases
    .venv/bin/python benchmarks/attention_bench.py --kv-cache-dtype int8   # an 8-bit cache (int8 or fp8)
    .venv/bin/python benchmarks/attention_bench.py --engine      # whole engine, default model, both backends
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from folio.attention.backend import BatchLayout
from folio.attention.cpu_paged import CPUPagedAttentionBackend
from folio.attention.flash_prefill import FlashPrefill
from folio.attention.kv_quant import KV_QUANTIZATIONS
from folio.attention.sdpa_prefill import SdpaPrefill
from folio.attention.torch_sdpa import TorchSDPABackend
from folio.csrc_build import CppKernel

SHAPES = {  # name: (num_heads, num_kv_heads, head_dim)
    "SmolLM2-135M": (9, 3, 64),
    "Qwen2-0.5B": (14, 2, 64),
    "Qwen3-0.6B": (16, 8, 128),
    "Llama-3-8B": (32, 8, 128),
    "Qwen2.5-7B": (28, 4, 128),
    "DeepSeek-V2-Lite": (16, 1, 576),  # latent attention: one 512 + 64 row a token (folio.models.mla)
}


def row_bytes(d, dtype, kv_cache_dtype):
    """Bytes of one (token, kv head) row of K or V in the cache."""
    return d * dtype.itemsize if kv_cache_dtype == "auto" else KV_QUANTIZATIONS[kv_cache_dtype].row_size(d)


def make_layers(specs, hkv, d, dtype, block_size, min_bytes, rng, kv_cache_dtype="auto"):
    """Per-layer caches (random, shuffled block ids) big enough for the batch, and the step's layout; an 8-bit
    kv_cache_dtype quantises each cache as the engine's is (folio.attention.kv_quant)."""
    need = [math.ceil(s / block_size) for _, s in specs]
    num_blocks = sum(need) + 8
    per_layer = 2 * num_blocks * block_size * hkv * row_bytes(d, dtype, kv_cache_dtype)
    n_layers = max(1, min(4096, math.ceil(min_bytes / per_layer)))
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, pos = [], 0
    for n in need:
        tables.append(ids[pos:pos + n])
        pos += n
    layout = BatchLayout.from_lists([q for q, _ in specs], [s for _, s in specs], tables, block_size)
    shape = (num_blocks, block_size, hkv, d)
    store = (lambda c: c.to(dtype)) if kv_cache_dtype == "auto" else KV_QUANTIZATIONS[kv_cache_dtype].quantize
    caches = [(store(torch.randn(shape)), store(torch.randn(shape))) for _ in range(n_layers)]
    return caches, layout


def qkv(num_tokens, hq, hkv, d, dtype):
    """q, k, v as the model passes them: views into one fused projection output."""
    x = torch.randn(num_tokens, (hq + 2 * hkv) * d).to(dtype)
    q, k, v = x.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.reshape(num_tokens, hq, d), k.reshape(num_tokens, hkv, d), v.reshape(num_tokens, hkv, d)


class Noise:
    """CPU used by processes other than this one while a region ran, in cores (from /proc; 0 if unreadable)."""

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @staticmethod
    def _read() -> tuple[int, int]:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
            return sum(v) - v[3] - v[4], int(own[11]) + int(own[12])  # busy ticks, our utime + stime
        except (OSError, ValueError, IndexError):
            return 0, 0

    def __enter__(self):
        self.t, (self.busy, self.own) = time.perf_counter(), self._read()
        return self

    def __exit__(self, *exc):
        busy, own = self._read()
        elapsed = time.perf_counter() - self.t
        self.other_cores = max(0.0, (busy - self.busy) - (own - self.own)) / self.TICK / elapsed


def time_calls(backend, meta, caches, q, k, v, calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        backend.forward(q, k, v, caches[i % len(caches)], meta)
    return (time.perf_counter() - start) / calls


def bench_case(name, specs, shape, dtype, args, rng, backends):
    hq, hkv, d = shape
    caches, layout = make_layers(specs, hkv, d, dtype, args.block_size, 0 if args.hot else args.cold_mib << 20, rng,
                                 args.kv_cache_dtype)
    q, k, v = qkv(sum(ql for ql, _ in specs), hq, hkv, d, dtype)
    kv_bytes = sum(s for _, s in specs) * 2 * hkv * row_bytes(d, dtype, args.kv_cache_dtype)
    metas, meta_ms, times = {}, {}, {n: [] for n in backends}
    for bname, backend in backends.items():
        t0 = time.perf_counter()
        metas[bname] = backend.build_metadata(layout)
        meta_ms[bname] = (time.perf_counter() - t0) * 1e3
    with torch.inference_mode():
        for bname, backend in backends.items():  # warm-up; also sizes the number of calls per round
            t = time_calls(backend, metas[bname], caches, q, k, v, 2)
        calls = max(3, min(len(caches), int(args.round_s / max(t, 1e-6))))
        noise = []
        for _ in range(args.rounds):
            with Noise() as n:
                for bname, backend in backends.items():
                    times[bname].append(time_calls(backend, metas[bname], caches, q, k, v, calls))
            noise.append(n.other_cores)
    # medians over the quiet rounds (other processes using < 0.1 core) when there are at least 3 of them
    quiet = [i for i, x in enumerate(noise) if x < 0.1]
    keep = quiet if len(quiet) >= 3 else list(range(len(noise)))
    med = {b: statistics.median(ts[i] for i in keep) for b, ts in times.items()}
    ref, new = med["baseline"], med["cpu_paged"]
    flag = "" if len(quiet) >= 3 else f" [noisy: other processes used {statistics.median(noise):.2f} cores]"
    print(f"{name:<44} {ref * 1e3:10.3f} {new * 1e3:10.3f} {ref / new:7.2f}x "
          f"{kv_bytes / ref / 1e9:9.2f} {kv_bytes / new / 1e9:9.2f}   "
          f"{meta_ms['baseline']:6.2f} {meta_ms['cpu_paged']:6.2f}  "
          f"({len(caches)} layers, {calls} calls x {len(keep)}/{args.rounds} rounds){flag}", flush=True)


def built_at(revision: str, source_name: str, ext_name: str, what: str):
    """folio/csrc/<source_name> and the headers it includes as they were at a git revision, built under a name of
    its own."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).resolve().parent)
        if done.returncode:
            raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    folder = Path(tempfile.mkdtemp())
    headers = [name for name in git("ls-tree", "--full-tree", "--name-only", f"{revision}:folio/csrc").split() if name.endswith(".h")]
    for name in headers:  # the headers it includes, as they were then
        (folder / name).write_text(git("show", f"{revision}:folio/csrc/{name}"))
    source = git("show", f"{revision}:folio/csrc/{source_name}")
    path = folder / source_name
    path.write_text(source)
    digest = hashlib.sha1("".join([source] + [(folder / n).read_text() for n in headers]).encode()).hexdigest()[:12]
    ext = CppKernel(f"{ext_name}_{digest}", path, what=f"{what} at {revision}", fallback="no comparison").load()
    if ext is None:
        raise SystemExit(f"the {what} at {revision} did not build")
    return ext


def kernel_at(revision: str, long_queries: bool = False) -> CPUPagedAttentionBackend:
    """The paged backend on the kernel as it was at a git revision; with long_queries its long-query paths on the
    prefill kernel of that revision too (else as now)."""
    backend = CPUPagedAttentionBackend()
    backend.ext = built_at(revision, "cpu_paged_attention.cpp", "folio_cpu_paged_attention", "paged attention kernel")
    if long_queries:
        flash = built_at(revision, "cpu_flash_prefill.cpp", "folio_cpu_flash_prefill", "prefill attention kernel")
        for dtype in (torch.bfloat16, *(quant.storage_dtype for quant in KV_QUANTIZATIONS.values())):
            path = backend.long_query_path(dtype)
            if isinstance(path, FlashPrefill):
                path.ext = flash
    return backend


def engine_bench(args) -> None:
    """Greedy generation through the whole engine (default model unless --model) with each backend."""
    from folio import LLM, SamplingParams

    results = {}
    for name in ("torch_sdpa", "cpu_paged"):
        rng = random.Random(0)  # the same prompts for both
        llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=1 << 30, attention_backend=name)
        backend = type(llm.llm_engine.runner.backend).__name__
        vocab = llm.llm_engine.model_config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(16)]}] * 2, params,
                     use_tqdm=False)  # warm-up
        prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.prompt_len)]}
                   for _ in range(args.requests)]
        with Noise() as noise:
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results[name] = [o.outputs[0].token_ids for o in outs]
        print(f"{name:<11} ({backend}): {args.requests} requests x ({args.prompt_len} prompt + {args.output_len} "
              f"output): {wall:6.2f} s, {tokens / wall:7.1f} output tok/s  "
              f"(other processes: {noise.other_cores:.2f} cores)", flush=True)
        del llm
    prefix = []
    for a, b in zip(results["torch_sdpa"], results["cpu_paged"]):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix.append(n)
    print(f"identical greedy outputs: {sum(a == b for a, b in zip(*results.values()))}/{args.requests} requests, "
          f"mean common prefix {statistics.mean(prefix):.1f} tokens (bf16: both backends sit at the bf16 rounding "
          f"floor, and a greedy path flips at the first near-tie; float32 paths should be identical)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_QUANTIZATIONS],
                        help="the cache's format: the model's dtype, or 8-bit rows with a scale each")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--context", type=int, default=384)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--round-s", type=float, default=0.15, help="target seconds per backend per round")
    parser.add_argument("--cold-mib", type=int, default=256, help="KV bytes cycled through (per backend)")
    parser.add_argument("--hot", action="store_true", help="one layer: the KV stays in the CPU caches")
    parser.add_argument("--versus-kernel", metavar="REV",
                        help="compare with the paged kernel of git revision REV (built once) instead of SDPA; with "
                             "--long-queries, with both attention kernels of REV")
    parser.add_argument("--prefill", action="store_true", help="also time prefill and chunked-prefill steps")
    parser.add_argument("--versus-sdpa", action="store_true",
                        help="--long-queries: against PyTorch's flash attention (sdpa_prefill) taking the same long "
                             "queries, rather than the kernel alone")
    parser.add_argument("--long-queries", action="store_true",
                        help="prefill cases only, against the paged kernel without its long-query paths "
                             "(folio.attention.long_query) instead of torch SDPA")
    parser.add_argument("--query-lens", metavar="N,N,...",
                        help="--long-queries: instead of its cases, a prompt of N tokens and a chunk of N after 1000 "
                             "for each N, the path taking every query (its rule lowered to 1 token): where it starts "
                             "to beat the kernel")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--engine", action="store_true", help="time whole-engine generation instead")
    parser.add_argument("--model", default=None, help="--engine: model (default: the embedded default model)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.engine:
        return engine_bench(args)
    dtype = getattr(torch, args.dtype)
    rng = random.Random(0)
    torch.manual_seed(0)
    if args.long_queries and args.versus_sdpa:  # the same rule as this CPU's own path, for the cache's dtype
        cache_dtype = dtype if args.kv_cache_dtype == "auto" else KV_QUANTIZATIONS[args.kv_cache_dtype].storage_dtype
        own = CPUPagedAttentionBackend().long_query_path(cache_dtype)
        if own is None:
            raise SystemExit(f"this CPU keeps long queries on {cache_dtype} caches on the kernel")
        sdpa = SdpaPrefill(own.min_query_len, own.min_query_key_pairs)
        baseline, base = CPUPagedAttentionBackend(long_queries={cache_dtype: lambda: sdpa}), "sdpa"
    elif args.versus_kernel:
        baseline, base = kernel_at(args.versus_kernel, long_queries=args.long_queries), "old"
    elif args.long_queries:
        baseline, base = CPUPagedAttentionBackend(long_queries={}), "kernel"
    else:
        baseline, base = TorchSDPABackend(), "sdpa"
    paged = CPUPagedAttentionBackend()
    if args.query_lens:  # this CPU's path for the cache's dtype taking every query, the baseline's too if it has one
        cache_dtype = dtype if args.kv_cache_dtype == "auto" else KV_QUANTIZATIONS[args.kv_cache_dtype].storage_dtype
        if paged.long_query_path(cache_dtype) is None:
            raise SystemExit(f"this CPU keeps long queries on {cache_dtype} caches on the kernel")
        for backend in (baseline, paged):
            path = backend.long_query_path(cache_dtype) if isinstance(backend, CPUPagedAttentionBackend) else None
            if path is not None:
                path.min_query_len, path.min_query_key_pairs = 1, 0
    backends = {"baseline": baseline, "cpu_paged": paged}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{'' if args.kv_cache_dtype == 'auto' else f'{args.kv_cache_dtype} cache, '}block_size {args.block_size}, "
          f"{'hot (one layer)' if args.hot else f'cold (>= {args.cold_mib} MiB of KV cycled)'}; "
          f"time per layer call (KV write + attention), median over the quiet rounds")
    print(f"{'case':<44} {base + ' ms':>10} {'paged ms':>10} {'speedup':>8} {base + ' GB/s':>9} {'paged GB/s':>9}   "
          f"{f'meta ms ({base}, paged)':>13}")
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        if args.query_lens:
            for n in (int(x) for x in args.query_lens.split(",")):
                for label, specs in ((f"prefill 1x{n}", [(n, n)]), (f"chunk {n} after 1000", [(n, 1000 + n)])):
                    bench_case(f"{shape_name} {label}", specs, shape, dtype, args, rng, backends)
            continue
        if args.long_queries:
            for label, specs in (("prefill 1x1852", [(1852, 1852)]), ("prefill 7x256", [(256, 256)] * 7),
                                 ("chunk 256 after 1000", [(256, 1256)]),
                                 ("prefill 1x64", [(64, 64)]), ("chunk 16 after 1000 + 15 decodes",
                                                                [(16, 1016)] + [(1, args.context)] * 15)):
                bench_case(f"{shape_name} {label}", specs, shape, dtype, args, rng, backends)
            continue
        for b in (int(x) for x in args.batches.split(",")):
            bench_case(f"{shape_name} decode B={b} ctx={args.context}", [(1, args.context)] * b, shape, dtype, args,
                       rng, backends)
        if args.prefill:
            for label, specs in (("prefill 1x256", [(256, 256)]),
                                 ("prefill 4x512", [(512, 512)] * 4),
                                 ("chunk 1x64 after 512", [(64, 576)]),
                                 ("chunk 256 after 768 + 15 decodes", [(256, 1024)] + [(1, args.context)] * 15),
                                 ("chunk 8 after 1000 + 31 decodes", [(8, 1008)] + [(1, args.context)] * 31)):
                bench_case(f"{shape_name} {label}", specs, shape, dtype, args, rng, backends)


if __name__ == "__main__":
    main()
