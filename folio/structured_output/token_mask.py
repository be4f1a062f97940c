"""GrammarTokenMask: the logits processor that applies a step's grammar bitmask (structured outputs) in the runner.

The engine core sends the bitmask rows in the SchedulerOutput (folio.core.step_contract.GrammarBitmask); the
runner puts each sampling request's row on its RequestState (`token_bitmask`), so `applies` is true for
constrained rows only, and unconstrained greedy rows stay on the sampler's plain-argmax path. Like every
processor it works on the sampler's float32 copy after the raw logprobs are taken: reported logprobs are the
model's own distribution, as for logit_bias and penalties.

The bits are unpacked by a C++ kernel (folio/csrc/cpu_token_bitmask.cpp); the numpy/torch code below is the
reference and the fallback, with the same result.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from folio.csrc_build import CSRC, CppKernel
from folio.sample.logits_processors import LogitsProcessor
from folio.worker.request_state import RequestState

KERNEL = CppKernel("folio_cpu_token_bitmask", CSRC / "cpu_token_bitmask.cpp", what="CPU token-bitmask kernel",
                   fallback="unpacking grammar masks with numpy")


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """In place: logits[rows[k], t] = -inf where bit t of bitmask[k] is 0 (int32 words, bit t % 32 of t // 32)."""
    ext = KERNEL.load() if logits.is_cpu and logits.dtype == torch.float32 and logits.stride(1) == 1 else None
    if ext is not None:
        ext.apply_token_bitmask(logits, torch.tensor(rows, dtype=torch.long), torch.from_numpy(bitmask))
        return
    vocab_size = logits.shape[1]
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    allowed = np.pad(allowed, ((0, 0), (0, vocab_size - allowed.shape[1])))  # tokens past the mask: never allowed
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(torch.from_numpy(allowed == 0).to(logits.device), -math.inf)


class GrammarTokenMask(LogitsProcessor):
    """Only the tokens the request's grammar allows next keep their logits."""

    def __init__(self) -> None:
        KERNEL.load()  # build or load it now (at model load), not in the first constrained step

    def applies(self, request: RequestState) -> bool:
        return request.token_bitmask is not None

    def apply(self, logits: torch.Tensor, rows: list[int], requests: list[RequestState]) -> None:
        apply_token_bitmask(logits, rows, np.stack([r.token_bitmask for r in requests]))
