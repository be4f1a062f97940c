"""Per-layer time of a decoder layer's elementwise ops: the reference torch code (folio.models.fused_ops.ref_*) vs the
fused bf16 kernels (folio.models.fused_ops), side by side.

One layer = 2 x (add + RMSNorm) + rotary embedding of q and k + SiLU-and-mul, on bf16 tensors.

    python benchmarks/fused_ops_bench.py [--tokens 64 512] [--threads N] [--iters 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from folio.models import fused_ops as F
from folio.models.layers import RMSNorm, RotaryEmbedding

MODELS = {  # hidden, heads, kv heads, head_dim, intermediate
    "SmolLM2-135M": (576, 9, 3, 64, 1536),
    "Qwen2-0.5B": (896, 14, 2, 64, 4864),
}


def timeit(fn, iters: int) -> float:
    for _ in range(max(3, iters // 10)):
        fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples) * 1e6  # us


def bench(model: str, t: int, iters: int) -> None:
    hidden, hq, hkv, d, inter = MODELS[model]
    dt = torch.bfloat16
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = (torch.rand(hidden) + 0.5).to(dt)
    rot = RotaryEmbedding(d, 8192, 10000.0, None)
    x = torch.randn(t, hidden).to(dt)
    res = torch.randn(t, hidden).to(dt)
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dt)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(-1, hq, d), k.view(-1, hkv, d)
    pos = torch.randint(0, 8192, (t,))
    gate_up = torch.randn(t, 2 * inter).to(dt)
    w, eps = norm.weight, norm.eps

    ops = {
        "add+rms_norm": (lambda: F.ref_rms_norm(x, w, eps, res), lambda: F.fused_add_rms_norm(x, res, w, eps)),
        "rotary": (lambda: F.ref_rotary(pos, q, k, rot.cos, rot.sin), lambda: F.rotary_embedding_(pos, q, k, rot.cos, rot.sin)),
        "silu_and_mul": (lambda: F.ref_silu_and_mul(gate_up), lambda: F.silu_and_mul(gate_up)),
    }
    per_layer = {"add+rms_norm": 2, "rotary": 1, "silu_and_mul": 1}
    tot_ref = tot_fused = 0.0
    for name, (ref, fused) in ops.items():
        r, f = timeit(ref, iters), timeit(fused, iters)
        n = per_layer[name]
        tot_ref += n * r
        tot_fused += n * f
        print(f"  {model:13s} T={t:<4d} {name:14s} x{n}  ref {r:8.1f} us   fused {f:8.1f} us   {r / f:5.1f}x")
    print(f"  {model:13s} T={t:<4d} {'per layer':14s}     ref {tot_ref:8.1f} us   fused {tot_fused:8.1f} us   "
          f"{tot_ref / tot_fused:5.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if F.load_extension() is None:
        raise SystemExit(f"fused kernel unavailable: {F.extension_error()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16")
    for model in args.models:
        for t in args.tokens:
            bench(model, t, max(10, args.iters * 64 // t))


if __name__ == "__main__":
    main()
