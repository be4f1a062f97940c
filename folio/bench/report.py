"""How benchmark results are reported: one summary of a distribution (mean and percentiles) for every latency
any benchmark records, and JSON files that hold the same fields as the printed report."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch


@dataclass
class Summary:
    """A distribution in the units it was measured in (seconds for latencies)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    def line(self, scale: float = 1.0, unit: str = "") -> str:
        """'mean 12.3 p50 11.0 p90 15.2 p99 20.1 ms' with values multiplied by scale."""
        parts = (f"{name} {getattr(self, name) * scale:.1f}" for name in ("mean", "p50", "p90", "p99"))
        return " ".join(parts) + (f" {unit}" if unit else "")


def summarize(values: Sequence[float]) -> Optional[Summary]:
    """Mean and percentiles (linear interpolation, as numpy and vLLM's bench do); None for no values, so that a
    report says 'no data' instead of inventing zeros."""
    if len(values) == 0:
        return None
    array = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return Summary(len(array), float(array.mean()), float(p50), float(p90), float(p99), float(array.min()),
                   float(array.max()))


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the name the --dtype flag takes."""
    return str(dtype).removeprefix("torch.")


def write_json(path: str, result: Any) -> None:
    """A dataclass result (nested dataclasses, dicts, lists) as indented JSON; torch dtypes and the like as str."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(result), f, indent=2, default=str)
        f.write("\n")
