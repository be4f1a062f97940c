"""Pre-quantised Hugging Face int4 checkpoints: GPTQ (AutoGPTQ / GPTQModel, `quant_method: "gptq"`) and
AWQ in its GEMM layout (AutoAWQ, `quant_method: "awq"`, `version: "gemm"`). Their linear layers load the
checkpoint's packed tensors as stored and are repacked once, after loading, into folio's int4 format
(folio.models.quant_reference) to run on the int4 kernels (folio.models.int4_linear). The repacking is exact:
a weight (q - zero) * scale, with a float16 scale and 4-bit q and zero, is q * scale + offset with
offset = -zero * scale, every product exact in float32.

Checkpoint tensors per linear layer, K inputs, N outputs, groups of G inputs (K / G groups):
- GPTQ: qweight int32 [K / 8, N] (8 values along K, value i in bits 4i..4i+3), qzeros int32 [K / G, N / 8]
  (packed the same way along N), scales float16 [K / G, N], g_idx int32 [K] (each input's group). In the
  original checkpoint_format "gptq" the stored zero is the zero minus one; "gptq_v2" stores it as is.
- AWQ: qweight int32 [K, N / 8] and qzeros int32 [K / G, N / 8], 8 values along N in the order
  0, 2, 4, 6, 1, 3, 5, 7 (value AWQ_ORDER[i] in bits 4i..4i+3); scales float16 [K / G, N].

Which layers are quantised is read from the checkpoint's tensor names (a layer with a `qweight`), not from
config fields (`modules_to_not_convert`, GPTQModel's `lm_head`): a layer the checkpoint keeps as a plain
`weight` (typically the lm_head) loads with the method folio would otherwise use. GPTQ's act-order
(`desc_act`) checkpoints whose g_idx is not k // G (groups not contiguous along K) are refused: folio's
groups are contiguous, and running them would mean permuting every layer's input at run time. So are
checkpoints that store a fused layer's shards as one tensor (Phi-3's qkv_proj, gate_up_proj).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from folio.models.int4_linear import Int4LinearMethod
from folio.models.linear import Linear, LinearMethod, LinearMethodChooser
from folio.models.quant_reference import BLOCK, pack_int4
from folio.models.weight_loader import ALL_SHARDS, ShardId, set_weight_loader

PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the value each nibble of an AWQ word holds
SUPPORTED = ('GPTQ (quant_method "gptq": bits 4, checkpoint_format "gptq" or "gptq_v2", groups along K in '
             'order) and AWQ (quant_method "awq": bits 4, version "gemm", zero_point true), group_size -1 or a '
             'multiple of 32')


@dataclass(frozen=True)
class Int4CheckpointConfig:
    """What the repacking needs of a quantization_config: the format, its group size (-1: one group per row)
    and, for GPTQ, whether stored zeros are the zero minus one (checkpoint_format "gptq")."""

    method: str  # "gptq" or "awq"
    group_size: int
    zero_minus_one: bool = False

    @staticmethod
    def parse(quantization_config: dict[str, Any]) -> "Int4CheckpointConfig":
        """Validate the config: any field folio cannot honour is a ValueError naming it."""
        c = quantization_config
        method = c.get("quant_method")
        _check(method in ("gptq", "awq"), f"quant_method {method!r} is not GPTQ or AWQ")
        _check(c.get("bits") == 4, f"bits {c.get('bits')!r} is not supported")
        group_size = c.get("group_size")
        _check(isinstance(group_size, int) and (group_size == -1 or (group_size > 0 and group_size % BLOCK == 0)),
               f"group_size {group_size!r} is not supported")
        if method == "awq":
            version = str(c.get("version", "gemm")).lower()
            _check(version == "gemm", f"version {c.get('version')!r} is not supported")
            _check(c.get("zero_point", True) is True, f"zero_point {c.get('zero_point')!r} is not supported")
            return Int4CheckpointConfig("awq", group_size)
        checkpoint_format = c.get("checkpoint_format", "gptq")
        _check(checkpoint_format in ("gptq", "gptq_v2"), f"checkpoint_format {checkpoint_format!r} is not supported")
        _check(not c.get("dynamic"), "dynamic (per-module overrides) is not supported")
        return Int4CheckpointConfig("gptq", group_size, zero_minus_one=checkpoint_format == "gptq")


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"quantization_config: {what}; folio loads {SUPPORTED}")


def _unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: the 8 nibbles of each word, lowest bits first (a nibble at a time:
    the int32 temporaries stay the size of the words, not 8 times it)."""
    nibbles = torch.empty(*words.shape, PACK, dtype=torch.uint8)
    for i in range(PACK):
        nibbles[..., i] = (words >> (4 * i)) & 15
    return nibbles


class Int4CheckpointMethod(Int4LinearMethod):
    """The int4 method whose parameters are a GPTQ or AWQ checkpoint's raw tensors (layer.qweight, qzeros,
    scales), repacked into layer.weight, weight_scale and weight_offset by process_weights_after_loading.

    The checkpoint keeps N along dim 1 (packed by 8 in qzeros, and in AWQ's qweight), so the shards of a fused
    layer (q/k/v, gate/up) load into column ranges: each shard's rows must be a multiple of 8."""

    def __init__(self, config: Int4CheckpointConfig) -> None:
        super().__init__(group_size=config.group_size)
        self.config = config

    def group_size(self, input_size: int) -> int:
        return input_size if self.config.group_size == -1 else self.config.group_size

    def create_weights(self, layer: Linear) -> None:
        k, g = layer.input_size, self.group_size(layer.input_size)
        if k % g or g % BLOCK:
            raise ValueError(f"quantization_config: group_size {self.config.group_size} does not fit a layer of "
                             f"{k} inputs (the int4 kernels need groups of a multiple of {BLOCK} that divide it)")
        super().create_weights(layer)  # weight_scale, weight_offset [N, K / G] and the bias
        del layer.weight  # made after loading, from the checkpoint's tensors
        if self.config.method == "gptq":
            layer.qweight = self._column_parameter(layer, k // PACK, 1, torch.int32)
            layer.g_idx = nn.Parameter(torch.zeros(0, dtype=torch.int32), requires_grad=False)
            # nothing kept: g_idx only has to say that groups are contiguous (optional, as in older checkpoints)
            set_weight_loader(layer.g_idx, lambda param, tensor, shard_id: _check_g_idx(tensor, k, g), ())
        else:
            layer.qweight = self._column_parameter(layer, k, PACK, torch.int32)
        layer.qzeros = self._column_parameter(layer, k // g, PACK, torch.int32)
        layer.scales = self._column_parameter(layer, k // g, 1, torch.float32)  # float16 in, exact in float32

    @staticmethod
    def _column_parameter(layer: Linear, rows: int, pack: int, dtype: torch.dtype) -> nn.Parameter:
        """[rows, N / pack], each shard loaded into its columns (the shard's outputs, `pack` per column)."""
        param = nn.Parameter(torch.empty(rows, layer.output_size // pack, dtype=dtype), requires_grad=False)

        def load(param: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId) -> None:
            first, count = layer.shard_extent(shard_id)
            if first % pack or count % pack:
                raise ValueError(f"packs {pack} outputs per column, but its shard has {count} outputs")
            if tuple(tensor.shape) != (rows, count // pack):
                raise ValueError(f"has shape {tuple(tensor.shape)}, expected {(rows, count // pack)}")
            param.data[:, first // pack:(first + count) // pack].copy_(tensor)

        set_weight_loader(param, load, tuple(layer.shards))  # ids only: no tensor of all shards (quantized_layers)
        return param

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Unpack to q [N, K] and zeros [N, K / G], pack q in folio's nibble order; offsets = -zero * scale."""
        q, zeros = self._unpack(layer)
        scales = layer.scales.detach().T.contiguous()
        layer.weight = nn.Parameter(pack_int4(q), requires_grad=False)
        layer.weight_scale.copy_(scales)
        layer.weight_offset.copy_(-(zeros.float() * scales))
        del layer.qweight, layer.qzeros, layer.scales
        if self.config.method == "gptq":
            del layer.g_idx
        super().process_weights_after_loading(layer)

    def _unpack(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """(q uint8 [N, K], zeros [N, K / G]) from the checkpoint's layout."""
        k, n = layer.input_size, layer.output_size
        zeros = _unpack_words(layer.qzeros.detach())  # [K / G, N / 8, 8]
        if self.config.method == "gptq":
            q = _unpack_words(layer.qweight.detach()).transpose(1, 2).reshape(k, n)  # [K / 8, N, 8] -> [K, N]
            zeros = zeros.reshape(-1, n).to(torch.int32) + int(self.config.zero_minus_one)
        else:
            nibble_of = torch.tensor([AWQ_ORDER.index(v) for v in range(PACK)])  # value v sits in nibble_of[v]
            q = _unpack_words(layer.qweight.detach())[..., nibble_of].reshape(k, n)
            zeros = zeros[..., nibble_of].reshape(-1, n)
        return q.T.contiguous(), zeros.T.contiguous()


def _check_g_idx(g_idx: torch.Tensor, input_size: int, group_size: int) -> None:
    expected = torch.arange(input_size, dtype=torch.int64) // group_size
    if tuple(g_idx.shape) != (input_size,) or not torch.equal(g_idx.long(), expected):
        raise ValueError("is not k // group_size: act-order (desc_act) checkpoints whose groups are not "
                         "contiguous along K are not supported")


def quantized_layers(tensor_names: Iterable[str], map_name: Callable[[str], Any]) -> frozenset[str]:
    """The model's Linear layers (folio names) that the checkpoint stores quantised: those with a qweight.
    map_name: the model's checkpoint name -> (parameter name, shard id) mapping."""
    layers = set()
    for name in tensor_names:
        target = map_name(name) if name.endswith(".qweight") else None
        if target is not None:
            if target[1] == ALL_SHARDS:  # the loading loop splits those by rows, where these pack N in columns
                raise ValueError(f"checkpoint tensor {name!r} holds all the shards of a fused layer: not supported "
                                 "for GPTQ and AWQ checkpoints")
            layers.add(target[0].removesuffix(".qweight"))
    return frozenset(layers)


def int4_checkpoint_chooser(quantization_config: dict[str, Any], layers: frozenset[str],
                            otherwise: LinearMethodChooser) -> LinearMethodChooser:
    """GPTQ / AWQ for the layers the checkpoint quantises (`quantized_layers`), `otherwise` for the rest."""
    method = Int4CheckpointMethod(Int4CheckpointConfig.parse(quantization_config))

    def choose(name: str, layer: Linear) -> LinearMethod:
        if name not in layers:
            return otherwise(name, layer)
        if layer.tied:
            raise ValueError(f"{name} is tied to the embedding but quantised in the checkpoint: not supported")
        return method

    return choose
