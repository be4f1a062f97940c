"""The `quantization` engine option: which weight scheme each linear layer of a model gets.

A scheme is a chooser (folio.models.linear): given a layer's name and declared shapes, its linear method.
- int8: every layer in int8 with per-channel scales, rotated, times activations quantised to int8 per token
  (W8A8, folio.models.int8_linear), the lm_head too (at batch 1 it is a quarter of the 0.5B Qwen2's weight
  reads); w8a16: the same weights unrotated, times activations quantised to 16-bit integers per token.
- int4, int4-g128: every layer in int4 (groups of 32 / 128, folio.models.int4_linear), but the lm_head in
  int8: logits lose more to 4 bits than any other layer, and llama.cpp's 4-bit types keep it wider too. A
  head tied to a bf16 embedding is int4 with each row's largest logits recomputed from the embedding
  (folio.models.rescored_head), where the int4 block kernel runs; w4a8:
  int4 in groups of 32 with activations quantised to int8 per block of 32 (llama.cpp's Q4 x Q8 recipe), the
  lm_head in int8 (W8A8).
- 16-bit integer activations (folio.models.int8_linear; the w8a16 layers, the lm_head of int4 and int4-g128):
  as accurate as float activations, at about W8A8's cost at batch 1 and twice W8A8's GEMM in batches, where the
  weight-only kernel dequantised the weight for every batch of 8 rows or more; weight-only (float activations)
  on CPUs without VNNI or AMX-INT8.
- gguf: the dense method here; the GGUF loader binds the layers it keeps quantised (folio.loader.gguf_native).
Layers whose input size is not a multiple of 32 (the kernels' block) stay on the dense method.
"""

from __future__ import annotations

from folio.models import rescored_head
from folio.models.int4_linear import Int4LinearMethod
from folio.models.int8_linear import Int8LinearMethod
from folio.models.linear import Linear, LinearMethod, LinearMethodChooser
from folio.models.quant_reference import BLOCK

LM_HEAD = "lm_head"


def quantization_chooser(scheme: str, dense: LinearMethod) -> LinearMethodChooser:
    """The chooser of a scheme (one of config.QUANTIZATION_SCHEMES, validated there); `dense` serves the
    layers the kernels cannot take."""
    if scheme == "gguf":
        return lambda name, layer: dense
    w8a8 = Int8LinearMethod(int8_activations=True, rotated=True)
    int16 = Int8LinearMethod(int16_activations=True)
    body: LinearMethod
    if scheme == "int8":
        body = w8a8
    elif scheme == "w8a16":
        body = int16
    else:
        body = Int4LinearMethod(128 if scheme == "int4-g128" else BLOCK, int8_activations=scheme == "w4a8")
    head = int16 if scheme in ("w8a16", "int4", "int4-g128") else w8a8
    rescored = rescored_head.RescoredInt4Head(max(rescored_head.GROUP, body.preferred_group_size),
                                              rescored_head.TOP_K) \
        if scheme in ("int4", "int4-g128") else None

    def choose(name: str, layer: Linear) -> LinearMethod:
        if layer.input_size % BLOCK:
            return dense
        if name != LM_HEAD:
            return body
        return rescored if rescored is not None and rescored_head.serves(layer) else head

    return choose
