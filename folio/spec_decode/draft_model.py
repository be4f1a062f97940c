"""Draft-model proposer: a smaller model with the target's vocabulary runs ahead k tokens, greedily.

The draft model has its own paged KV cache: per layer a K and a V tensor of its own shape, indexed by the
same block ids as the target's (the engine sizes the cache for both, and the scheduler reserves k lookahead
slots past each step's tokens for the positions the draft writes while guessing). It uses the block tables
of the target's full-attention KV cache group, which hold the whole context while the request runs (a sliding
group frees the blocks out of its window, and the draft's catch-ups read whole contexts). A block id belongs to
one group at a time, so the draft's tensors hold at a block id only the tokens of that group's block, and the
target's other groups can share the pool as they would without a draft model. A request's draft KV is valid
up to a known position; each proposal first catches the draft up to the request's last token (its
whole context the first time, and after a preemption, whose freed blocks took the draft KV with them), then
feeds back its own guesses one position at a time. Guesses the target rejected leave KV behind that the next
catch-up overwrites: the proposer compares what it fed with the tokens the request actually has.

Drafts are the draft model's argmax. For random requests the rejection sampler treats them as one-hot
proposals (accepted with the target's probability), which keeps sampling exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from folio.attention.backend import AttentionBackend, BatchLayout
from folio.config import is_gguf_file
from folio.loader.model_loader import load_model
from folio.models.llama import StepContext
from folio.models.model_config import ModelConfig
from folio.platforms.interface import Platform
from folio.spec_decode.config import SpeculativeConfig
from folio.spec_decode.proposer import Proposer
from folio.utils.math_utils import cdiv
from folio.worker.input_batch import InputBatch
from folio.worker.kv_cache import KVCacheSpec
from folio.worker.request_state import RequestState


@dataclass
class DraftModel:
    model: nn.Module
    kv_cache_spec: KVCacheSpec


def load_draft_model(config: SpeculativeConfig, target: ModelConfig, dtype: torch.dtype, max_model_len: int,
                     block_size: int, platform: Platform) -> DraftModel:
    # a GGUF draft runs its quantised layers as stored, as a target does by default
    loaded = load_model(config.model, dtype, max_model_len, platform.linear_method, platform.device,
                        gguf_native=is_gguf_file(config.model))
    if loaded.config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model has a vocabulary of {loaded.config.vocab_size} tokens, the "
                         f"target {target.vocab_size}: a draft model must share the target's vocabulary")
    if loaded.config.recurrent_layers:  # their states would keep the rejected guesses (folio.models.recurrent_state)
        raise ValueError(f"speculative_config.model: a draft model with recurrent layers ({loaded.config.architecture})"
                         " is not supported")
    if loaded.config.max_context < max_model_len:
        raise ValueError(f"speculative_config.model handles {loaded.config.max_context} positions, "
                         f"fewer than max_model_len {max_model_len}")
    return DraftModel(loaded.model, KVCacheSpec.for_model(loaded.config, block_size, dtype))


@dataclass
class _DraftKV:
    """Up to which position a request's draft KV holds its real tokens, and the guesses fed after them."""

    valid: int
    fed: list[int]  # guesses written at positions valid, valid + 1, ...


class DraftModelProposer(Proposer):
    def __init__(self, draft: DraftModel, inputs: InputBatch, group: int, backend: AttentionBackend,
                 num_blocks: int, device: torch.device) -> None:
        self.model = draft.model
        self.inputs = inputs  # the runner's: token rows and block tables, read only
        self.group = group  # the target's full-attention KV cache group, whose tables the draft uses
        self.backend = backend
        self.kv_caches = draft.kv_cache_spec.allocate(backend, num_blocks, device)
        self.device = device
        self._kv: dict[str, _DraftKV] = {}

    def preempted(self, request_id: str) -> None:
        self._kv.pop(request_id, None)

    def finished(self, request: RequestState) -> None:
        self._kv.pop(request.request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[RequestState], tokens: list[np.ndarray], max_drafts: list[int]) -> list[list[int]]:
        ids = [r.request_id for r in requests]
        max_drafts = [min(k, self._room(rid, len(seq))) for rid, seq, k in zip(ids, tokens, max_drafts)]
        # catch up: from the first position whose draft KV is stale to the last known token, whose logits
        # give the first guess
        starts = [self._valid(rid, seq) for rid, seq in zip(ids, tokens)]
        guesses = self._forward(ids, [np.arange(start, len(seq)) for start, seq in zip(starts, tokens)],
                                [seq[start:] for start, seq in zip(starts, tokens)])
        drafts = [[g] if k > 0 else [] for g, k in zip(guesses, max_drafts)]
        for rid, seq in zip(ids, tokens):
            self._kv[rid] = _DraftKV(len(seq), [])
        for step in range(1, max(max_drafts, default=0)):  # feed each guess back for the next one
            going = [i for i, k in enumerate(max_drafts) if k > step]
            if not going:
                break
            positions = [np.array([len(tokens[i]) + step - 1]) for i in going]
            fed = [np.array([drafts[i][-1]]) for i in going]
            for i, guess in zip(going, self._forward([ids[i] for i in going], positions, fed)):
                self._kv[ids[i]].fed.append(drafts[i][-1])
                drafts[i].append(guess)
        return drafts

    def _valid(self, request_id: str, seq: np.ndarray) -> int:
        """Positions from 0 whose draft KV was computed from the request's actual tokens."""
        kv = self._kv.get(request_id)
        if kv is None:
            return 0
        valid = kv.valid
        for guess in kv.fed:
            if valid >= len(seq) - 1 or seq[valid] != guess:
                break
            valid += 1
        return min(valid, len(seq) - 1)  # the last token is fed again: its logits give the first guess

    def _room(self, request_id: str, num_tokens: int) -> int:
        """How many guesses the request's blocks hold: guess i is written at position num_tokens + i - 1."""
        row = self.inputs.rows[request_id]
        return self.inputs.group_num_blocks[self.group][row] * self.inputs.block_size - num_tokens + 1

    def _forward(self, request_ids: list[str], positions: list[np.ndarray], token_ids: list[np.ndarray]) -> list[int]:
        """One draft forward pass over the given positions of each request; the argmax after each one's last."""
        bs = self.inputs.block_size
        rows = np.array([self.inputs.rows[rid] for rid in request_ids])
        qlens = np.array([len(p) for p in positions], dtype=np.int64)
        seq_lens = np.array([int(p[-1]) + 1 for p in positions], dtype=np.int64)
        flat = np.concatenate(positions).astype(np.int64)
        token_rows = np.repeat(rows, qlens)
        table = self.inputs.block_tables[self.group]
        slots = table[token_rows, flat // bs].astype(np.int64) * bs + flat % bs
        tables = torch.from_numpy(table[rows, :cdiv(int(seq_lens.max()), bs)])
        layout = BatchLayout(qlens, seq_lens, tables.to(self.device), torch.from_numpy(slots).to(self.device), bs)
        ctx = StepContext(self.backend, [self.backend.build_metadata(layout)], self.kv_caches)
        ids = torch.from_numpy(np.concatenate(token_ids).astype(np.int64)).to(self.device)
        hidden = self.model(ids, torch.from_numpy(flat).to(self.device), ctx)
        return self.model.compute_greedy_tokens(hidden[torch.from_numpy(np.cumsum(qlens) - 1)]).tolist()
