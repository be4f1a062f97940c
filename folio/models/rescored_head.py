"""The lm_head of the int4 schemes when it is tied to a bf16 (or float32) embedding: int4 logits, the best of them
exact.

At batch 1 the head is the largest single read of a small model's step (Qwen2-0.5B: 151936 x 896, 136 MB in
int8, 77 MB in int4 groups of 64), but 4 bits cost the logits more than any other layer: the default model's
perplexity +5.4 % with an int4 head, where an int8 head cost nothing. A tied head's exact rows are in memory
anyway, as the embedding table the lookup reads. So this head streams its int4 copy (folio.models.int4_blocks)
for every logit, then recomputes the TOP_K largest of each row from the bf16 table (k rows of the table, a few
hundred KB, and a partial selection over the row: folio/csrc/cpu_top_k_rescore.cpp): a token greedy decoding
or a sampler's top candidates pick gets the bf16 head's logit, and only the tail, which enters a softmax as
a small share of its mass, keeps the 4-bit error. A float32 model does the same where its int4 layers are
blocks (AVX2 CPUs without AVX-512, folio.models.int4_blocks), from its float32 table, or from a bf16 checkpoint's
table kept in bf16 (weight_loader.keep_bf16_tensors), its rows widened exactly as they are read.

The same at every batch size (chunks of CHUNK_ROWS rows), so a token's logits do not depend on the
batch it ran in, and perplexity over prompt logprobs measures what decoding samples from.

Under tensor parallelism (folio.models.vocab_parallel) each rank holds its slice of the vocabulary and recomputes the
TOP_K largest of its own logits: the whole vocabulary's TOP_K are among them, exact as on one rank, and so are up to
TOP_K more a rank, which moves the softmax's tail, and logprobs, a little with the number of ranks.
"""

from __future__ import annotations

import torch

from folio.csrc_build import CSRC, CppKernel
from folio.models import int4_blocks
from folio.models.int4_linear import Int4LinearMethod
from folio.models.linear import Linear

KERNEL = CppKernel("folio_cpu_top_k_rescore", CSRC / "cpu_top_k_rescore.cpp", what="CPU top-k rescoring kernel",
                   fallback="the int4 schemes keep an int8 lm_head")
# Logits per row recomputed from the table. The default model's perplexity in bf16 (README, "The rescored int4
# lm_head"; unquantised 25.9392, the int8 head 25.9094): +1.41 % at 32, +0.91 % at 128, +0.18 % at 512; the
# table rows of one row's products cost 0.13-0.2 ms at 128, 0.42-0.53 at 512 (latency-bound gathers).
TOP_K = 128
# The int4 copy's groups (where K allows, else 32; `int4-g128`'s 128 where they fit): only the tail keeps its
# error, and groups of 64 scored as well as 32 on the default model (26.1424 against 26.1746) with a head
# 8.6 % faster to stream (0.5625 bytes a weight against 0.625).
GROUP = 64
CHUNK_ROWS = int4_blocks.MAX_ROWS  # the bf16 block kernel's batches (float32 ones take any)
SERVED = (torch.bfloat16, torch.float32)  # the dtypes the rescoring kernel takes


def rescore_top_k_reference(logits: torch.Tensor, x: torch.Tensor, table: torch.Tensor, k: int) -> torch.Tensor:
    """logits [M, V] (in place) with each row's k largest, ties to the lower token index, replaced by
    x [M, H] . table[token] [H] (float32 sums of the bf16 products, rounded to logits' dtype). A NaN ranks as
    minus infinity."""
    key = logits.float()
    key = torch.where(key.isnan(), float("-inf"), key)
    top = key.sort(dim=-1, descending=True, stable=True).indices[:, :min(k, logits.shape[1])]
    exact = torch.bmm(table[top].float(), x.float().unsqueeze(-1)).squeeze(-1)
    return logits.scatter_(1, top, exact.to(logits.dtype))


def rescore_top_k(logits: torch.Tensor, x: torch.Tensor, table: torch.Tensor, k: int) -> torch.Tensor:
    """rescore_top_k_reference, by the C++ kernel where it serves these tensors."""
    ext = KERNEL.load()
    table_served = table.dtype in (x.dtype, torch.bfloat16)  # the same dtype, or a bf16 table under float32
    if (ext is not None and logits.dtype == x.dtype and logits.dtype in SERVED and table_served
            and logits.is_contiguous() and x.is_contiguous() and table.is_contiguous()):
        ext.rescore_top_k(logits, x, table, k)
        return logits
    return rescore_top_k_reference(logits, x, table, k)


class RescoredInt4Head(Int4LinearMethod):
    """Int4 weight-only logits with each row's TOP_K largest recomputed from the tied embedding table.

    Only for a tied layer of a model whose int4 layers are blocks (`serves`; elsewhere the int4 schemes keep
    an int8 head). layer.exact_table: the embedding's weight (the same storage, not a copy; in a float32 model, bf16
    where the checkpoint's table is)."""

    def __init__(self, group_size: int, top_k: int = TOP_K) -> None:
        super().__init__(group_size)
        self.top_k = top_k

    def create_weights(self, layer: Linear) -> None:
        if not layer.tied or layer.with_bias:
            raise ValueError("the rescored int4 head needs a tied layer without bias")
        super().create_weights(layer)

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.exact_table = layer.weight.detach()  # before the int4 copy replaces layer.weight
        super().process_weights_after_loading(layer)

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= CHUNK_ROWS:
            return self.rescored(layer, x)
        return torch.cat([self.rescored(layer, chunk) for chunk in x.split(CHUNK_ROWS)])

    def rescored(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        return rescore_top_k(super().matmul(layer, x), x, layer.exact_table, self.top_k)


def serves(layer: Linear) -> bool:
    """Whether a layer can be a rescored head: tied to a bf16 or float32 table, with the int4 block kernel for
    its dtype and the rescoring kernel at hand (the reference sorts whole rows: 20 ms a row, slower than the
    int8 head it replaces)."""
    return (layer.tied and not layer.with_bias and layer.params_dtype in SERVED
            and int4_blocks.available(layer.params_dtype) and KERNEL.load() is not None)
