"""folio bounds oneDNN's primitive caches as it is imported (folio.onednn_caches), so a linear layer on a packed
weight, asked for one batch size after another, stops growing resident memory; the user's own capacity stays."""

from __future__ import annotations

import os
import subprocess
import sys

from folio import onednn_caches

# Five packed float32 layers, each run at 400 row counts (2000 primitives), in a process of its own. With the
# caches' defaults (1024 entries each) resident memory grew about 600 MiB on a Zen 3 EPYC; bounded, about 50.
GROWTH_SCRIPT = """
import folio, psutil, torch
from folio.models.dense_linear import DenseLinearMethod
from folio.models.linear import Linear

torch.manual_seed(0)
layers = []
for n, k in ((192, 64), (64, 64), (256, 64), (64, 128), (500, 64)):
    layer = Linear(k, n, bias=False, params_dtype=torch.float32)
    method = DenseLinearMethod()
    layer.bind(method)
    layer.weight.data.copy_(torch.randn(n, k))
    method.process_weights_after_loading(layer)
    assert layer.packed is not None, "float32 weights are packed for oneDNN"
    layers.append(layer)
for layer in layers:
    layer(torch.randn(9, layer.input_size))
before = psutil.Process().memory_info().rss
for m in range(10, 410):
    for layer in layers:
        layer(torch.randn(m, layer.input_size))
print((psutil.Process().memory_info().rss - before) / 2**20)
"""
BOUND_MIB = 200


def _run(script: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in onednn_caches.VARIABLES}
    out = subprocess.run([sys.executable, "-c", script], env={**clean, **env}, capture_output=True, text=True,
                         timeout=600, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_importing_folio_bounds_both_caches_and_keeps_the_users_choice():
    show = "import folio, os; print([os.environ.get(n) for n in folio.onednn_caches.VARIABLES])"
    assert _run(show) == str([onednn_caches.CAPACITY] * 2)
    assert _run(show, LRU_CACHE_CAPACITY="7") == str([onednn_caches.CAPACITY, "7"])


def test_packed_layers_at_many_batch_sizes_stop_growing_memory():
    growth = float(_run(GROWTH_SCRIPT))
    assert growth < BOUND_MIB, f"resident memory grew {growth:.0f} MiB over 2000 primitives"
