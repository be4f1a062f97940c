"""Pre-quantised Hugging Face checkpoints in compressed-tensors' int-quantized format (llm-compressor's W8A8
preset, as vLLM loads them): int8 weights with one symmetric scale per output channel (`weight`,
`weight_scale` [N, 1]) and, when the config asks for them, dynamic per-token int8 activations. The weights
load as stored, with no conversion, and run on the int8 kernels (folio.models.int8_linear).

config.json's quantization_config names one config group that targets Linear layers and an `ignore` list
(layer names, or "re:" regular expressions) of layers kept in floating point, typically the lm_head. Other
compressed-tensors schemes are a ValueError naming what is supported (GPTQ and AWQ int4 checkpoints load
through folio.models.int4_checkpoints).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from folio.models.int8_linear import Int8LinearMethod
from folio.models.linear import Linear, LinearMethod, LinearMethodChooser
from folio.models.weight_loader import ShardId, set_weight_loader

SUPPORTED = ("compressed-tensors int-quantized: int8 weights, symmetric, one scale per channel; activations "
             "none or int8, dynamic, per token")


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"quantization_config: {what}; folio loads {SUPPORTED}")


def int8_activations(quantization_config: dict[str, Any]) -> bool:
    """Validate the config; whether its activations are int8 (W8A8) rather than left in float (W8A16)."""
    _check(quantization_config.get("quant_method") == "compressed-tensors",
           f"quant_method {quantization_config.get('quant_method')!r} is not supported")
    _check(quantization_config.get("format") == "int-quantized",
           f"format {quantization_config.get('format')!r} is not supported")
    groups = list(quantization_config.get("config_groups", {}).values())
    _check(len(groups) == 1 and groups[0].get("targets") == ["Linear"], "expected one config group targeting Linear")
    weights, activations = groups[0].get("weights") or {}, groups[0].get("input_activations")
    _check((weights.get("num_bits"), weights.get("type"), weights.get("symmetric"), weights.get("strategy"))
           == (8, "int", True, "channel"), f"weights {weights} are not supported")
    if activations is None:
        return False
    _check((activations.get("num_bits"), activations.get("type"), activations.get("symmetric"),
            activations.get("dynamic"), activations.get("strategy")) == (8, "int", True, True, "token"),
           f"input_activations {activations} are not supported")
    return True


class CompressedTensorsW8A8Method(Int8LinearMethod):
    """The int8 method with the checkpoint's weight and per-channel scales as parameters that load as they are;
    zero points, when saved, must be zero (symmetric)."""

    def create_weights(self, layer: Linear) -> None:
        super().create_weights(layer)
        if not layer.tied:
            layer.weight = layer.row_parameter(layer.input_size, dtype=torch.int8)
            del layer.weight_scale
            layer.weight_scale = layer.row_parameter(1, dtype=torch.float32)
            # where the checkpoint saves zero points, they only have to be zero: nothing is kept
            layer.weight_zero_point = nn.Parameter(torch.zeros(0), requires_grad=False)
            set_weight_loader(layer.weight_zero_point, _check_zero_points, ())  # no shard required


def _check_zero_points(param: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId) -> None:
    if bool(tensor.any()):
        raise ValueError("has non-zero zero points: only symmetric int8 is supported")


def compressed_tensors_chooser(quantization_config: dict[str, Any], otherwise: LinearMethodChooser) -> LinearMethodChooser:
    method = CompressedTensorsW8A8Method(int8_activations=int8_activations(quantization_config))
    ignore = quantization_config.get("ignore") or []

    def ignored(name: str) -> bool:  # folio's names drop Hugging Face's "model." prefix
        return any(re.fullmatch(p[3:], n) if p.startswith("re:") else p == n
                   for p in ignore for n in (name, f"model.{name}"))

    def choose(name: str, layer: Linear) -> LinearMethod:
        return otherwise(name, layer) if ignored(name) else method

    return choose
