"""The token embedding and the lm_head split by vocabulary across tensor-parallel ranks (vLLM's
VocabParallelEmbedding and ParallelLMHead).

Replicated, both are the largest tensors a rank holds (0.5B Qwen2: 136M of its 494M parameters, the head read whole
by every rank at every decode step). Split, each rank keeps one slice of the vocabulary's rows, the vocabulary padded
with zero rows to a multiple of the ranks so that every rank's slice, and so every collective, is the same size
(0.5B Qwen2 over two ranks: 247M parameters a rank instead of 315M). The embedding looks up the ids of its slice,
zeros the others' rows and sums over the ranks (exact: each row is one rank's, the others add zeros). The head
computes its slice of the logits; the ranks gather them into the whole [T, vocab] logits that the sampler, its
logits processors and prompt logprobs read, the pad cut off. A greedy step gathers less than a row's logits: each
rank's largest logit and its token, [2, T], of which every rank picks the same one (`best_of_ranks`). A tied head is
the embedding's slice, and every linear method (dense, quantised as it loads) sees a layer of `rows` outputs and
never the ranks; what a model does with the logits (Gemma's soft-cap, Granite's logits_scaling) comes after the
gather. GGUF layers run as stored are not split at all (folio.config refuses them under tensor parallelism).

On one rank both classes are Embedding and Linear as they are: nothing is added to a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from folio.distributed.parallel_state import TensorParallelGroup, tensor_parallel_group
from folio.models.layers import Embedding
from folio.models.linear import Linear, LinearMethod
from folio.models.weight_loader import ShardId, weight_loader_of
from folio.sample.sampling_ops import argmax_rows


@dataclass(frozen=True)
class VocabSlice:
    """One rank's rows of a vocabulary of `vocab` tokens: `rows` of them (every rank's count), of which the first
    `valid` are tokens start .. start + valid - 1 and the rest pad."""

    vocab: int
    rows: int
    start: int
    valid: int

    @classmethod
    def of(cls, vocab: int, tp: TensorParallelGroup) -> Optional[VocabSlice]:
        """The rank's slice; None on one rank, which keeps the whole vocabulary."""
        if tp.size == 1:
            return None
        rows = -(-vocab // tp.size)
        if (tp.size - 1) * rows >= vocab:
            raise ValueError(f"tensor_parallel_size {tp.size}: a vocabulary of {vocab} tokens leaves the last rank "
                             f"none")
        start = tp.rank * rows
        return cls(vocab, rows, start, min(rows, vocab - start))

    def load_rows(self, param: nn.Parameter) -> None:
        """Make the parameter's weight loader take this slice's rows of a whole [vocab, ...] checkpoint tensor, zeros
        for the pad."""
        load = weight_loader_of(param)

        def load_slice(p: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId) -> None:
            if tensor.shape[0] != self.vocab:
                raise ValueError(f"has {tensor.shape[0]} rows, expected the vocabulary's {self.vocab}")
            rows = tensor.narrow(0, self.start, self.valid)
            if self.valid < self.rows:
                rows = torch.cat([rows, rows.new_zeros(self.rows - self.valid, *rows.shape[1:])])
            load(p, rows, shard_id)

        param.weight_loader = load_slice


class VocabParallelEmbedding(Embedding):
    """Token ids to vectors, the table's rows split by vocabulary across the tensor-parallel ranks."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        tp = tensor_parallel_group()
        part = VocabSlice.of(num_embeddings, tp)
        super().__init__(num_embeddings if part is None else part.rows, dim)
        self.part = part
        if part is not None:
            self.tp = tp
            part.load_rows(self.weight)
            self.forward = self._sum_of_slices

    def _sum_of_slices(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.part.start
        outside = (local < 0) | (local >= self.part.valid)
        rows = Embedding.forward(self, local.masked_fill(outside, 0))
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(Linear):
    """The lm_head (a Linear of `vocab` outputs, tied_to the embedding's weight where the model ties them), its rows
    split by vocabulary across the tensor-parallel ranks: a call returns the whole vocabulary's logits, `argmax` the
    whole vocabulary's argmax."""

    def __init__(self, input_size: int, vocab: int, tied_to: Optional[nn.Parameter] = None) -> None:
        part = VocabSlice.of(vocab, tensor_parallel_group())
        super().__init__(input_size, vocab if part is None else part.rows, tied_to=tied_to)
        self.part = part
        if part is not None:
            self.forward = self._gathered_logits
            self.argmax = self._argmax_of_ranks

    def bind(self, method: LinearMethod) -> None:
        super().bind(method)
        if self.part is not None:
            for name, param in self._parameters.items():
                if param is not None and not (self.tied and name == "weight"):  # a tied one loads as the embedding
                    self.part.load_rows(param)

    def _gathered_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits, every rank's slice in rank order, the pad cut off."""
        logits = self.tp.all_gather(self.method.apply(self, x), dim=-1)
        return logits if logits.shape[-1] == self.part.vocab else logits[..., :self.part.vocab].contiguous()

    def _argmax_of_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's argmax from each rank's slice of the logits, written (the method's own argmax would
        neither skip the pad nor give the maximum's value, which the ranks compare) but not gathered."""
        logits = self.method.apply(self, x.reshape(-1, self.input_size))[:, :self.part.valid]
        tokens = argmax_rows(logits)
        best = torch.stack([logits.gather(1, tokens.unsqueeze(1)).squeeze(1).double(),
                            (tokens + self.part.start).double()])  # exact: logits are at most float32, tokens < 2^53
        gathered = self.tp.all_gather(best, dim=0).view(self.tp.size, 2, -1)
        return best_of_ranks(gathered[:, 0], gathered[:, 1].long())


def best_of_ranks(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The whole row's torch.argmax from each rank's largest logit and its token ([ranks, T] each, rank order, each
    rank's first maximum or first NaN): the largest value, a NaN above any, ties to the lower rank, whose tokens come
    first. int64 [T]."""
    return tokens.gather(0, torch.argmax(values, dim=0).unsqueeze(0)).squeeze(0)
