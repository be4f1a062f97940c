"""Pre-quantised FP8 Hugging Face checkpoints (quant_method "fp8": DeepSeek-V3/R1, Qwen3-*-FP8, GLM-4.5-FP8,
MiniMax-M2...), dequantised into the model's dtype as they load.

Each quantised weight is float8_e4m3fn beside a float scale that multiplies it: `weight_scale_inv`, one per block of
weight_block_size [rows, columns] over [out, in] (the last blocks of a dimension partial), or, with weight_block_size
null, one per tensor or per output row (`weight_scale_inv` as Transformers' FineGrainedFP8 names it, `weight_scale`
as vLLM's Fp8Config does). CPUs have no FP8 arithmetic, so each weight becomes float32(fp8) * float32(scale) rounded
to the model's dtype, exactly what Transformers' Fp8Dequantize computes (it dequantises on CPUs).

This happens on the checkpoint's tensor stream (`dequantized`), before any weight loader sees a tensor, not in a
linear method: the model then loads plain float tensors as from a bf16 folder, so every consumer takes them
unchanged. The linear method is whichever `quantization` asks (dense by default; int8 / int4 quantise the float
weight again as it loads, so memory stays small); fused q/k/v and gate/up shards and a fused checkpoint tensor are
cut from the dequantised weight; a tensor-parallel rank's slice is cut from it too, so its rows keep their blocks'
scales wherever the slice starts within a block; MoE experts are Linear layers like any; and weights outside the
linear methods (DeepSeek's kv_b_proj, a full-precision `Gate` in MLA) are covered as well. Which layers were
quantised is read from the tensors (a weight with a scale), so modules_to_not_convert / ignored_layers need no
reading. Refused with the field or tensor named: static activation scales (activation_scheme "static", `input_scale`:
folio computes activations in its dtype and would ignore them), fmt other than e4m3, and DeepSeek-V4's UE8M0 scales
and FP4 experts (scale_fmt, expert_dtype), which folio does not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
ACTIVATION_SCALE_SUFFIXES = (".input_scale", ".activation_scale")
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED = ('FP8 (quant_method "fp8": fmt "e4m3", activation_scheme "dynamic", float scales per block of '
             'weight_block_size, or per tensor or output row with weight_block_size null)')
# Elements of a weight dequantised at a time: bounds the float32 temporary (16 MB) of a large weight.
_BAND_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Fp8CheckpointConfig:
    """block: weight_block_size (rows, columns) of one scale; None: a scale per tensor or per output row."""

    block: Optional[tuple[int, int]]

    @staticmethod
    def parse(quantization_config: dict[str, Any]) -> "Fp8CheckpointConfig":
        """Validate the config: any field folio cannot honour is a ValueError naming it."""
        c = quantization_config
        _check(c.get("quant_method") == "fp8", f"quant_method {c.get('quant_method')!r} is not FP8")
        _check(c.get("fmt", "e4m3") == "e4m3", f"fmt {c.get('fmt')!r} is not supported")
        scheme = c.get("activation_scheme", "dynamic")
        _check(scheme == "dynamic", f"activation_scheme {scheme!r} is not supported (folio computes activations in "
                                    f"its dtype and would ignore their static input_scale)")
        _check(c.get("scale_fmt", "float") == "float", f"scale_fmt {c.get('scale_fmt')!r} is not supported")
        _check(c.get("expert_dtype", "fp8") == "fp8", f"expert_dtype {c.get('expert_dtype')!r} is not supported")
        block = c.get("weight_block_size")
        if block is None:
            return Fp8CheckpointConfig(None)
        _check(isinstance(block, (list, tuple)) and len(block) == 2
               and all(isinstance(b, int) and b > 0 for b in block),
               f"weight_block_size {block!r} is not two positive integers")
        return Fp8CheckpointConfig((block[0], block[1]))


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"quantization_config: {what}; folio loads {SUPPORTED}")


def fp8_config(quantization_config: Optional[dict[str, Any]]) -> Optional[Fp8CheckpointConfig]:
    """The parsed config of an FP8 checkpoint's quantization_config; None for any other (or none)."""
    if quantization_config is None or quantization_config.get("quant_method") != "fp8":
        return None
    return Fp8CheckpointConfig.parse(quantization_config)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, config: Fp8CheckpointConfig,
               dtype: torch.dtype) -> torch.Tensor:
    """float32(weight) * float32(its scale) in dtype, [out, in]; a scale grid of the wrong shape is a ValueError
    completing "checkpoint tensor NAME ..." (folio.models.weight_loader)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"has a scale but is {weight.dtype} {tuple(weight.shape)}, expected a float8_e4m3fn matrix")
    if scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"has scales of dtype {scale.dtype}, expected one of {', '.join(map(str, SCALE_DTYPES))}")
    rows, cols = weight.shape
    if config.block is not None:
        (block_rows, block_cols), grid = config.block, scale
        expected = (-(-rows // block_rows), -(-cols // block_cols))
    else:  # one scale per tensor or per row: a grid of one column, a row high
        block_rows, block_cols = 1, cols
        grid = scale.reshape(1, 1).expand(rows, 1) if scale.numel() == 1 else scale.reshape(-1, 1)
        expected = (rows, 1)
    if tuple(grid.shape) != expected:
        raise ValueError(f"has scales of shape {tuple(scale.shape)}, expected {expected} for a weight of "
                         f"{(rows, cols)} (weight_block_size {list(config.block) if config.block else None})")
    out = torch.empty(rows, cols, dtype=dtype)
    band = max(1, _BAND_ELEMENTS // (cols * block_rows)) * block_rows  # whole blocks of rows at a time
    whole_columns = cols // block_cols  # blocks of columns, but for a partial last one
    for first in range(0, rows, band):
        w = weight[first:first + band].float()
        s = grid[first // block_rows:-(-(first + w.shape[0]) // block_rows)].float()
        s = s.repeat_interleave(block_rows, 0)[:w.shape[0]]  # [band rows, blocks of columns]
        w[:, :whole_columns * block_cols].view(w.shape[0], whole_columns, block_cols).mul_(s[:, :whole_columns, None])
        w[:, whole_columns * block_cols:].mul_(s[:, whole_columns:])
        out[first:first + w.shape[0]] = w
    return out


def dequantized(tensors: Iterable[tuple[str, torch.Tensor]], config: Fp8CheckpointConfig,
                dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each FP8 weight and its scale replaced by the weight dequantised into dtype,
    under the weight's name; the others as they come. A weight waits for its scale, or a scale for its weight
    (adjacent in a file's sorted names, so one tensor waits at a time); one whose partner never comes is a
    ValueError naming it."""
    weights: dict[str, torch.Tensor] = {}  # waiting for their scales, by name
    scales: dict[str, torch.Tensor] = {}  # waiting for their weights, by the weight's name
    for name, tensor in tensors:
        if name.endswith(ACTIVATION_SCALE_SUFFIXES):
            raise ValueError(f"checkpoint tensor {name!r} is a static activation scale: not supported; folio loads "
                             f"{SUPPORTED}")
        scale_of = name.rsplit(".", 1)[0] + ".weight" if name.endswith(SCALE_SUFFIXES) else None
        if scale_of is None and tensor.dtype.itemsize > 1:  # neither a scale nor 8-bit (dequantize checks which)
            yield name, tensor
            continue
        weight_name = scale_of or name
        weight = weights.pop(weight_name, None) if scale_of else tensor
        scale = tensor if scale_of else scales.pop(weight_name, None)
        if weight is None:
            scales[weight_name] = tensor
        elif scale is None:
            weights[weight_name] = tensor
        else:
            try:
                yield weight_name, dequantize(weight, scale, config, dtype)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {weight_name!r} {e}") from None
    if weights:
        raise ValueError(f"checkpoint tensor {next(iter(weights))!r} is 8-bit but has no weight_scale_inv (or "
                         f"weight_scale)")
    if scales:
        raise ValueError(f"checkpoint has scales for {next(iter(scales))!r} but no 8-bit weight of that name")
