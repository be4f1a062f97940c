"""RoPE scaling: the per-position rotation frequencies of each `rope_type` checkpoints use, computed with the same
float32 expressions as Transformers (transformers.modeling_rope_utils), so the cos/sin tables are bit-identical.

- linear: every frequency divided by `factor`.
- llama3: low frequencies divided by `factor`, high ones kept, a smooth ramp between (Llama 3.1+).
- yarn: NTK-by-parts interpolation between the original and the `factor`-interpolated frequencies, and an
  attention factor (from `mscale` / `mscale_all_dim`, or `factor`) that scales cos and sin.
- dynamic (NTK): the base grows with the sequence length once it passes `max_position_embeddings`.
- longrope (Phi-3): per-frequency `short_factor`s up to `original_max_position_embeddings`, `long_factor`s
  past it, and an attention factor from the ratio of the context lengths.

Dynamic and longrope depend on the sequence length. Transformers recomputes their frequencies per forward
pass from its largest position: a decode step at position p uses length p + 1, keys already cached keep the
rotation they got. folio applies that rule per position (row p of the table is for length p + 1), which gives
Transformers' numbers whenever the prompt fits the original context, whatever the chunking, batching or
preemption, and keeps a position's keys independent of the request (prefix caching needs that). A prompt
longer than the original context differs: Transformers rotates the whole prompt for its full length. So does
Phi-3's generate past the original context: it drops its cache there and recomputes it with the long factors.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

SUPPORTED = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def rope_type(scaling: Optional[dict[str, Any]]) -> str:
    return "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _default(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, scaling: dict[str, Any], max_len: int) -> tuple[torch.Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_len / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
                     if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # Transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention


def _dynamic(dim: int, theta: float, factor: float, max_len: int, max_positions: int) -> torch.Tensor:
    """[max_positions, dim/2]: rows up to max_len are the unscaled frequencies (Transformers computes them with
    Python floats at init); row p beyond is for length p + 1 (a 0-d int64 tensor in Transformers' forward,
    hence the float32 arithmetic), computed row by row with Transformers' very expressions."""
    base = theta * ((factor * max_len / max_len) - (factor - 1)) ** (dim / (dim - 2))
    rows = [(1.0 / (base ** _exponents(dim))).expand(min(max_len, max_positions), -1)]
    for seq_len in range(max_len + 1, max_positions + 1):
        grown = theta * ((factor * torch.tensor(seq_len) / max_len) - (factor - 1)) ** (dim / (dim - 2))
        rows.append((1.0 / (grown ** _exponents(dim)))[None])
    return torch.cat(rows)


def _longrope(dim: int, theta: float, scaling: dict[str, Any], max_len: int,
              max_positions: int) -> tuple[torch.Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_len / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = (1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * theta ** _exponents(dim))
                   for key in ("short_factor", "long_factor"))
    beyond = torch.arange(max_positions)[:, None] >= original  # row p is for length p + 1
    return torch.where(beyond, long, short), attention


def inv_freq_table(dim: int, max_positions: int, theta: float, scaling: Optional[dict[str, Any]],
                   max_len: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, [dim/2] or per position [max_positions, dim/2]; attention factor) of a rotary
    embedding over `dim` channels. max_len: the config's max_position_embeddings."""
    kind = rope_type(scaling)
    if kind == "default":
        return _default(dim, theta), 1.0
    if kind == "linear":
        return _default(dim, theta) / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(_default(dim, theta), scaling), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, max_len)
    if kind == "dynamic":
        return _dynamic(dim, theta, scaling["factor"], max_len, max_positions), 1.0
    if kind == "longrope":
        return _longrope(dim, theta, scaling, max_len, max_positions)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(SUPPORTED)})")


def cos_sin_tables(dim: int, max_positions: int, theta: float, scaling: Optional[dict[str, Any]],
                   max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 [max_positions, dim] cos and sin tables, attention factor applied, as Transformers builds them
    (`position * inv_freq`, duplicated halves, cos/sin, times the attention factor)."""
    inv_freq, attention = inv_freq_table(dim, max_positions, theta, scaling, max_len)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention, emb.sin() * attention
