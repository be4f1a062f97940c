"""The sampler's passes over a whole logits batch: row-wise argmax (greedy), top-p thresholds and
inverse-transform draws.

On CPU they are C++ kernels (folio/csrc/cpu_sampling_ops.cpp): torch's argmax is a scalar reduction (19 ms for
bf16 [64, 151936] logits, 6.5 ms in float32, more than a decode step's attention for a small model), its
cumsum a sequential pass writing a whole tensor (5.5 ms for [64, 49152]) and the nucleus needs a sort (120 ms
for [64, 49152]); the kernels stream each row once or twice and take about 1 ms. The torch code below is the reference and the fallback (other devices and
dtypes, or no kernel: build failed, FOLIO_DISABLE_CPU_KERNELS=1), with the same semantics.
"""

from __future__ import annotations

import torch

from folio.csrc_build import CSRC, CppKernel

KERNEL = CppKernel("folio_cpu_sampling_ops", CSRC / "cpu_sampling_ops.cpp", what="CPU sampling kernels",
                   fallback="using torch's argmax and cumsum")


def prepare() -> None:
    """Build or load the kernels now (at model load), not in the first step."""
    KERNEL.load()


def _kernel_for(x: torch.Tensor, dtypes: tuple[torch.dtype, ...]):
    if x.is_cpu and x.dim() == 2 and x.dtype in dtypes and x.shape[1] > 0 and x.stride(1) == 1:
        return KERNEL.load()
    return None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of a [B, V] tensor, as int64 [B]: first index among ties, first NaN."""
    ext = _kernel_for(logits, (torch.float32, torch.bfloat16))
    return ext.argmax_rows(logits) if ext is not None else logits.argmax(dim=-1)


def top_p_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, V] bool: per row of probs (non-negative weights) and top_p [B], the smallest set of most likely
    tokens whose mass reaches top_p * total, ties ranked by token index (a stable descending sort): a token
    is kept while the mass ranked before it is below the target, so the most likely token always stays."""
    ext = _kernel_for(probs, (torch.float32,))
    if ext is not None and top_p.dtype == torch.float32 and top_p.is_cpu:
        return ext.top_p_mask(probs, top_p.contiguous())
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    before = ordered.cumsum(dim=-1) - ordered  # mass ranked before each token
    keep_sorted = before < top_p.unsqueeze(1) * ordered.sum(dim=-1, keepdim=True)  # a prefix, >= 1 long
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def draw_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [B, V] (any non-negative weights), given u [B] in [0, 1): the first token
    whose running sum exceeds u * total. Tokens of probability 0 are never returned."""
    ext = _kernel_for(probs, (torch.float32,))
    if ext is not None and u.dtype == torch.float32 and u.is_cpu:
        return ext.draw_rows(probs, u.contiguous())
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # keep the target strictly below the total: u * total may round up to it, past the last positive token
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)
