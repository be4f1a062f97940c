"""Reference attention backend in plain torch: gathers each request's K/V through its block table and
calls scaled_dot_product_attention (grouped-query attention without repeating K/V).

Decoding requests (one query token each) are batched into one SDPA call over a padded context; requests
with several query tokens (prefill chunks) get one call each with a causal mask offset by their cached
context. Correctness first: faster backends implement the same interface. An 8-bit cache
(folio.attention.kv_quant) is written quantised and read back dequantised to q's dtype.

A layer with a sliding window gathers only the keys its queries can see (from the window of the step's first
query on), with a mask that also hides keys that fell out of a later query's window; the gathered index
tensors and masks are built once per step and window, on the first layer that asks. Soft-capped scores
(Gemma 2) and attention sinks (GPT-OSS) are computed as Transformers' eager attention does (SDPA has neither).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from folio.attention import kv_quant
from folio.attention.backend import FULL_ATTENTION, AttentionBackend, AttentionParams, BatchLayout


@dataclass
class PrefillItem:
    token_slice: slice  # where its queries sit in the flattened batch
    context_slots: torch.Tensor  # [L] cache slots of the keys its queries may see
    mask: Optional[torch.Tensor]  # [n, L] bool, None when plain causal (the keys are exactly its own queries')


@dataclass
class WindowView:
    """The step's gathered context as layers with one sliding window (or none) see it."""

    decode_token_idx: Optional[torch.Tensor]  # [Bd] positions of decode queries in the batch
    decode_slots: Optional[torch.Tensor]  # [Bd, Lmax] cache slots, padded with the row's last one
    decode_mask: Optional[torch.Tensor]  # [Bd, 1, 1, Lmax] True where a real token is
    prefills: list[PrefillItem]


@dataclass
class TorchSDPAMetadata:
    layout: BatchLayout
    slot_mapping: torch.Tensor
    views: dict[Optional[int], WindowView] = field(default_factory=dict)  # by sliding window, built on first use


def _context_slots(block_table: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    return block_table.long()[pos // block_size] * block_size + pos % block_size


def build_view(layout: BatchLayout, window: Optional[int]) -> WindowView:
    decode_idx, decode_slots, lens, prefills = [], [], [], []
    start = 0
    for qlen, slen, table in zip(layout.query_lens.tolist(), layout.seq_lens.tolist(), layout.block_tables):
        off = slen - qlen  # cached context before the step's queries
        first = 0 if window is None else max(0, off - window + 1)  # the first key any of its queries sees
        slots = _context_slots(table, first, slen, layout.block_size)
        if qlen == 1:
            decode_idx.append(start)
            decode_slots.append(slots)
            lens.append(slen - first)
        else:
            mask = None
            if first != off or (window is not None and window < qlen):
                # query i (position off + i) sees key position t iff t <= off + i and t > off + i - window
                q_pos = torch.arange(off, slen)[:, None]
                k_pos = torch.arange(first, slen)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
            prefills.append(PrefillItem(slice(start, start + qlen), slots, mask))
        start += qlen
    view = WindowView(None, None, None, prefills)
    if decode_idx:
        lmax = max(lens)
        view.decode_token_idx = torch.tensor(decode_idx)
        view.decode_slots = torch.zeros(len(lens), lmax, dtype=torch.long)
        for row, slots in enumerate(decode_slots):
            view.decode_slots[row] = slots[-1]  # padding reads the request's own last key (masked out)
            view.decode_slots[row, :len(slots)] = slots
        view.decode_mask = (torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    return view


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool,
           params: AttentionParams) -> torch.Tensor:
    """q [..., Hq, n, D], k/v [..., Hkv, L, D]; mask broadcast to [..., Hq, n, L] (True: visible)."""
    if params.logit_softcap is None and params.sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=params.scale,
                                              enable_gqa=True)
    # Transformers' eager attention (scaled scores, soft-capped, masked, softmax with the sinks as one more column
    # whose probability is dropped), in float32 whatever the dtype
    dtype = q.dtype
    group = q.shape[-3] // k.shape[-3]
    q, k, v = q.float(), k.float().repeat_interleave(group, dim=-3), v.float().repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * params.scale_for(q.shape[-1])
    cap = params.logit_softcap
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if is_causal:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool).tril(diagonal=length - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if params.sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v).to(dtype)
    sinks = params.sinks.view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v).to(dtype)


class TorchSDPABackend(AttentionBackend):
    def build_metadata(self, layout: BatchLayout) -> TorchSDPAMetadata:
        return TorchSDPAMetadata(layout, layout.slot_mapping)  # views are built by the first layer using each

    def forward(self, q, k, v, kv_cache, metadata: TorchSDPAMetadata,
                params: AttentionParams = FULL_ATTENTION) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        quant = kv_quant.of_cache(k_cache)
        num_kv_heads, row = k_cache.shape[-2:]
        k_flat = k_cache.view(-1, num_kv_heads, row)
        v_flat = v_cache.view(-1, num_kv_heads, row)
        k_flat.index_copy_(0, metadata.slot_mapping, k if quant is None else quant.quantize(k))
        v_flat.index_copy_(0, metadata.slot_mapping, v if quant is None else quant.quantize(v))
        view = metadata.views.get(params.sliding_window)
        if view is None:
            view = metadata.views[params.sliding_window] = build_view(metadata.layout, params.sliding_window)

        def gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            rows = flat[slots]
            return rows if quant is None else quant.dequantize(rows, q.dtype)

        out = torch.empty_like(q)
        if view.decode_token_idx is not None:
            qd = q[view.decode_token_idx].unsqueeze(2)  # [Bd, Hq, 1, D]
            kd = gather(k_flat, view.decode_slots).transpose(1, 2)  # [Bd, Hkv, L, D]
            vd = gather(v_flat, view.decode_slots).transpose(1, 2)
            od = attend(qd, kd, vd, view.decode_mask, False, params)
            out[view.decode_token_idx] = od.squeeze(2)
        for item in view.prefills:
            qp = q[item.token_slice].transpose(0, 1)  # [Hq, n, D]
            kp = gather(k_flat, item.context_slots).transpose(0, 1)  # [Hkv, L, D]
            vp = gather(v_flat, item.context_slots).transpose(0, 1)
            op = attend(qp, kp, vp, item.mask, item.mask is None, params)
            out[item.token_slice] = op.transpose(0, 1)
        return out
