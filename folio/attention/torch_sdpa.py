"""Reference attention backend in plain torch: gathers each request's K/V through its block table and
calls scaled_dot_product_attention (grouped-query attention without repeating K/V).

Decoding requests (one query token each) are batched into one SDPA call over a padded context; requests
with several query tokens (prefill chunks) get one call each with a causal mask offset by their cached
context. Correctness first: faster backends implement the same interface. An 8-bit cache
(folio.attention.kv_quant) is written quantised and read back dequantised to q's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from folio.attention import kv_quant
from folio.attention.backend import AttentionBackend, BatchLayout


@dataclass
class PrefillItem:
    token_slice: slice  # where its queries sit in the flattened batch
    context_slots: torch.Tensor  # [L] cache slots of its whole context
    mask: Optional[torch.Tensor]  # [n, L] bool, None when plain causal (no cached context)


@dataclass
class TorchSDPAMetadata:
    slot_mapping: torch.Tensor
    decode_token_idx: Optional[torch.Tensor]  # [Bd] positions of decode queries in the batch
    decode_slots: Optional[torch.Tensor]  # [Bd, Lmax] cache slots, padding points at slot 0
    decode_mask: Optional[torch.Tensor]  # [Bd, 1, 1, Lmax] True where a real token is
    prefills: list[PrefillItem]


def _context_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(seq_len)
    return block_table.long()[pos // block_size] * block_size + pos % block_size


class TorchSDPABackend(AttentionBackend):
    def build_metadata(self, layout: BatchLayout) -> TorchSDPAMetadata:
        decode_idx, decode_slots, lens, prefills = [], [], [], []
        start = 0
        for qlen, slen, table in zip(layout.query_lens.tolist(), layout.seq_lens.tolist(), layout.block_tables):
            slots = _context_slots(table, slen, layout.block_size)
            if qlen == 1:
                decode_idx.append(start)
                decode_slots.append(slots)
                lens.append(slen)
            else:
                mask = None
                if slen != qlen:  # cached context before the chunk: query i sees keys up to slen - qlen + i
                    mask = torch.ones(qlen, slen, dtype=torch.bool).tril(diagonal=slen - qlen)
                prefills.append(PrefillItem(slice(start, start + qlen), slots, mask))
            start += qlen
        meta = TorchSDPAMetadata(layout.slot_mapping, None, None, None, prefills)
        if decode_idx:
            lmax = max(lens)
            meta.decode_token_idx = torch.tensor(decode_idx)
            meta.decode_slots = torch.zeros(len(lens), lmax, dtype=torch.long)
            for row, slots in enumerate(decode_slots):
                meta.decode_slots[row, :len(slots)] = slots
            meta.decode_mask = (torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
        return meta

    def forward(self, q, k, v, kv_cache, metadata: TorchSDPAMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        quant = kv_quant.of_cache(k_cache)
        num_kv_heads, row = k_cache.shape[-2:]
        k_flat = k_cache.view(-1, num_kv_heads, row)
        v_flat = v_cache.view(-1, num_kv_heads, row)
        k_flat.index_copy_(0, metadata.slot_mapping, k if quant is None else quant.quantize(k))
        v_flat.index_copy_(0, metadata.slot_mapping, v if quant is None else quant.quantize(v))

        def gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            rows = flat[slots]
            return rows if quant is None else quant.dequantize(rows, q.dtype)

        out = torch.empty_like(q)
        if metadata.decode_token_idx is not None:
            qd = q[metadata.decode_token_idx].unsqueeze(2)  # [Bd, Hq, 1, D]
            kd = gather(k_flat, metadata.decode_slots).transpose(1, 2)  # [Bd, Hkv, L, D]
            vd = gather(v_flat, metadata.decode_slots).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=metadata.decode_mask, enable_gqa=True)
            out[metadata.decode_token_idx] = od.squeeze(2)
        for item in metadata.prefills:
            qp = q[item.token_slice].transpose(0, 1)  # [Hq, n, D]
            kp = gather(k_flat, item.context_slots).transpose(0, 1)  # [Hkv, L, D]
            vp = gather(v_flat, item.context_slots).transpose(0, 1)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=item.mask, is_causal=item.mask is None,
                                                enable_gqa=True)
            out[item.token_slice] = op.transpose(0, 1)
        return out
