"""GGUF weights that run as stored (`quantization="gguf"`, the default for a GGUF file): Q8_0 linear layers as
int8 and Q4_0, Q4_1 and Q4_K ones as int4, both in groups of 32 (folio.models.quant_reference's formats), and
MXFP4 ones (GPT-OSS's experts) on the MXFP4 method (folio.models.mxfp4_linear), instead of dequantised to floats.

The conversion is exact: Q8_0's block scale is the int8 group scale; Q4_0's value (q - 8) d is q d + (-8 d),
Q4_1's q d + m, and Q4_K's sub-block q (d sc) - dmin m is q scale + offset with both products exact in
float32 (a float16 times a 6-bit integer). Q4_0/Q4_1 blocks already keep value j and j + 16 in one byte, as
the int4 kernel reads them; Q4_K's 256-value super-blocks are unpacked and packed in that order. ggml's MXFP4
blocks hold the same codes and scale bytes as the Hugging Face checkpoints' in another order: the loader repacks
them into the MXFP4 method's blocks and scales (`mxfp4_from_ggml`), two tensors, as those checkpoints hand them.

A fused layer (q/k/v, gate/up) runs natively only when all its checkpoint tensors convert to the same
format; any other layer, and any other type (Q5_*, Q6_K, ...), is dequantised and runs on the dense method, as
MXFP4 ones are where the MXFP4 kernel does not build (they then run fused, as an MXFP4 checkpoint's experts).
A tied lm_head reads the embedding's tensor, which the lookup needs dequantised: where that tensor is stored
in one of these types, the head quantises it into an int8 copy of its own (the int4 schemes' head).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from folio.models import mxfp4_linear
from folio.models.int4_linear import Int4LinearMethod
from folio.models.int8_linear import Int8LinearMethod
from folio.models.linear import Linear, LinearMethod, LinearMethodChooser
from folio.models.mxfp4 import BLOCK as MXFP4_BLOCK
from folio.models.quant_reference import BLOCK, pack_int4

Q = GGMLQuantizationType
FORMAT_OF = {Q.Q8_0: "int8", Q.Q4_0: "int4", Q.Q4_1: "int4", Q.Q4_K: "int4"}  # GGUFBlocks.convert's
TIED_INT8 = "tied int8"  # native_layers' kind of a tied lm_head whose embedding is stored quantised
# mxfp4_from_ggml's masks of each 16-bit lane's nibbles: the outer two stay, the middle two swap
_MXFP4_KEEP, _MXFP4_DOWN, _MXFP4_UP = (np.uint64(m) for m in (0xF00F_F00F_F00F_F00F, 0x00F0_00F0_00F0_00F0,
                                                             0x0F00_0F00_0F00_0F00))
_NIBBLE = np.uint64(4)


@dataclass
class GGUFBlocks:
    """One GGUF tensor's rows as stored: blocks [rows, bytes per row] of a quantised type."""

    qtype: GGMLQuantizationType
    blocks: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.blocks.shape[0], self.blocks.shape[1] // type_size * block_size

    def __getitem__(self, rows: slice) -> "GGUFBlocks":
        return GGUFBlocks(self.qtype, self.blocks[rows])

    def convert(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(packed, scales, offsets or None) in the int8 or int4 format, groups of 32."""
        n = self.blocks.shape[0]
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        b = self.blocks.reshape(n, -1, type_size)

        def f16(part: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(part).view(np.float16).astype(np.float32)).reshape(n, -1)

        if self.qtype == Q.Q8_0:
            codes = np.ascontiguousarray(b[:, :, 2:]).view(np.int8).reshape(n, -1)
            return torch.from_numpy(codes.copy()), f16(b[:, :, :2]), None
        if self.qtype in (Q.Q4_0, Q.Q4_1):
            head = 2 if self.qtype == Q.Q4_0 else 4
            packed = torch.from_numpy(np.ascontiguousarray(b[:, :, head:]).reshape(n, -1).copy())
            scales = f16(b[:, :, :2])
            offsets = -8 * scales if self.qtype == Q.Q4_0 else f16(b[:, :, 2:4])
            return packed, scales, offsets
        # Q4_K: d, dmin (float16), 12 bytes of 6-bit sub-block scales and mins, 128 bytes of codes in which
        # each 32 bytes hold sub-block 2i in their low nibbles and 2i + 1 in their high ones
        d, dmin, packed_scales, qs = f16(b[:, :, :2]), f16(b[:, :, 2:4]), b[:, :, 4:16], b[:, :, 16:]
        sc, mins = _q4k_scales(packed_scales)
        codes = qs.reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        codes = torch.from_numpy((codes & 15).reshape(n, -1).copy())
        scales = d.repeat_interleave(8, dim=1) * sc
        offsets = -(dmin.repeat_interleave(8, dim=1) * mins)
        return pack_int4(codes), scales, offsets


def _q4k_scales(packed: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes per super-block -> 8 sub-block scales and 8 mins, as float32 [n, super-blocks * 8]."""
    n = packed.shape[0]
    s = packed.reshape(n, -1, 3, 4)
    d, m, md = s[:, :, 0], s[:, :, 1], s[:, :, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return (torch.from_numpy(sc.reshape(n, -1).astype(np.float32)),
            torch.from_numpy(mins.reshape(n, -1).astype(np.float32)))


def mxfp4_from_ggml(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's MXFP4 rows uint8 [n, groups * 17] -> (blocks uint8 [n, groups, 16], scales uint8 [n, groups]) in
    folio.models.mxfp4's format, the same values.

    ggml's block_mxfp4 is the E8M0 scale byte, then 16 bytes of which byte i holds value i in its low nibble and
    value i + 16 in its high one; mxfp4's byte j holds values 2j (low) and 2j + 1. The codes and the scale byte mean
    the same in both (ggml halves the scale and doubles the codes' values), so only the nibbles move: bytes 2k and
    2k + 1, one little-endian 16-bit lane, hold values 2k, 2k + 16, 2k + 1, 2k + 17 from its lowest nibble up;
    swapping the middle two leaves values 2k, 2k + 1 in its low byte (mxfp4's byte k) and 2k + 16, 2k + 17 in its
    high one (byte k + 8), which one transpose puts in place. Four lanes a uint64 op: 0.5 GB/s of MXFP4 on a 2-core
    EPYC (a 2880 x 2880 expert in 8 ms, once: the loader caches the result), where gguf's dequantize took 0.023."""
    n = rows.shape[0]
    b = rows.reshape(n, -1, 1 + MXFP4_BLOCK // 2)
    lanes = np.ascontiguousarray(b[:, :, 1:]).view(np.uint64)
    swapped = (lanes & _MXFP4_KEEP) | ((lanes >> _NIBBLE) & _MXFP4_DOWN) | ((lanes << _NIBBLE) & _MXFP4_UP)
    blocks = swapped.view(np.uint8).reshape(n, -1, MXFP4_BLOCK // 4, 2).transpose(0, 1, 3, 2)
    return (torch.from_numpy(blocks.reshape(n, -1, MXFP4_BLOCK // 2)),  # (a copy: the transpose made it strided)
            torch.from_numpy(np.ascontiguousarray(b[:, :, 0])))


class GGUFInt8LinearMethod(Int8LinearMethod):
    """int8 groups of 32 from Q8_0 blocks: weight-only (the W8A8 kernel takes one scale per row)."""

    def packed_shape(self, rows: int, input_size: int) -> tuple[tuple[int, ...], torch.dtype, int]:
        return (rows, input_size), torch.int8, input_size // BLOCK

    def quantize(self, w: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        return w.convert()


class GGUFInt4LinearMethod(Int4LinearMethod):
    """int4 groups of 32 from Q4_0, Q4_1 or Q4_K blocks."""

    def packed_shape(self, rows: int, input_size: int) -> tuple[tuple[int, ...], torch.dtype, int]:
        return (rows, input_size // 2), torch.uint8, input_size // BLOCK

    def quantize(self, w: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        return w.convert()


def _format(qtype: GGMLQuantizationType) -> Optional[str]:
    """The format a linear layer stored as qtype runs in, None for dequantised: FORMAT_OF's, or "mxfp4" (the
    loader repacks the blocks, `mxfp4_from_ggml`) where the MXFP4 kernel builds; without it the torch reference
    would dequantise the weight at every call, so the layer is dequantised once, at load."""
    if qtype == Q.MXFP4:
        return "mxfp4" if mxfp4_linear.available() else None
    return FORMAT_OF.get(qtype)


def native_layers(tensor_types: dict[str, GGMLQuantizationType],
                  model: torch.nn.Module) -> tuple[dict[str, str], frozenset[str]]:
    """({Linear layer name: "int8" | "int4" | "mxfp4"}, the Hugging Face names of their tensors) for the layers
    whose every checkpoint tensor (shards of a fused layer included) converts to that one format; and TIED_INT8 for
    a tied lm_head whose embedding is stored in one of them. tensor_types: Hugging Face name -> GGUF type."""
    formats: dict[str, set] = defaultdict(set)
    names: dict[str, list[str]] = defaultdict(list)
    param_types: dict[str, GGMLQuantizationType] = {}
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    for hf_name, qtype in tensor_types.items():
        target = model.map_checkpoint_name(hf_name)
        if target is None or not target[0].endswith(".weight"):
            continue
        param_types[target[0]] = qtype
        layer = target[0].removesuffix(".weight")
        if layer in linears:
            formats[layer].add(_format(qtype))
            names[layer].append(hf_name)
    layers = {layer: next(iter(f)) for layer, f in formats.items() if len(f) == 1 and None not in f}
    kept = frozenset(n for layer in layers for n in names[layer])
    # A tied lm_head has no tensor of its own: the embedding's serves the lookup, dequantised. Where that tensor
    # is stored quantised, the head gets an int8 copy of its own (the int4 schemes' head: per channel, int16
    # activations) rather than reading the float table, twice the bytes, at every decode step.
    param_names = {id(p): n for n, p in model.named_parameters()}
    for name, m in linears.items():
        if m.tied and m.input_size % BLOCK == 0 and FORMAT_OF.get(param_types.get(param_names.get(id(m.weight)))):
            layers[name] = TIED_INT8
    return layers, kept


def native_chooser(layers: dict[str, str], otherwise: LinearMethodChooser) -> LinearMethodChooser:
    methods = {"int8": GGUFInt8LinearMethod(), "int4": GGUFInt4LinearMethod(),
               "mxfp4": mxfp4_linear.Mxfp4LinearMethod(), TIED_INT8: Int8LinearMethod(int16_activations=True)}

    def choose(name: str, layer: Linear) -> LinearMethod:
        kind = layers.get(name)
        return otherwise(name, layer) if kind is None else methods[kind]

    return choose

