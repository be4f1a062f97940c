"""Persistent input buffers of the model runner, updated incrementally from step to step.

Every request the runner is computing owns a row of two arrays that live as long as the engine: its token
ids and its block table (one per KV cache group: a model with sliding-window layers has several). A step only writes what changed since the previous one (the tokens each request
sampled, appended by the runner; the block ids the step's message brings, a new one every `block_size`
tokens; draft tokens to verify, past the known ones; a whole row when a request arrives or resumes), then
builds the step's flattened inputs (token ids, positions, cache slots, the [B, max blocks] block table)
with a few vectorised numpy gathers over those rows, instead of per-request Python lists rebuilt every step.

Rows are released when a request finishes or is preempted (SchedulerOutput.finished_ids / preempted_ids);
a preempted request gets a fresh row when it is scheduled again, filled from the runner's RequestState,
and its message then brings its whole new block table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import torch

from folio.attention.backend import BatchLayout
from folio.core.step_contract import ScheduledRequestData
from folio.utils.math_utils import cdiv
from folio.worker.request_state import RequestState


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    layouts: list[BatchLayout]  # per KV cache group: the same requests, the group's tables and slots
    rows: np.ndarray  # [B] int64: each request's row (a hybrid model's recurrent states live in rows alike)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 device: torch.device = torch.device("cpu"), num_groups: int = 1) -> None:
        self.block_size = block_size
        self.device = device  # where the step's tensors go
        self.max_model_len = max_model_len
        self.max_blocks = cdiv(max_model_len, block_size)
        # np.zeros maps zero pages lazily: only the token positions requests actually reach take memory
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        # per KV cache group
        self.block_tables = [np.zeros((max_num_reqs, self.max_blocks), dtype=np.int32) for _ in range(num_groups)]
        # per row: tokens and (per group) blocks written so far (plain lists: the fastest per-item access)
        self.num_tokens: list[int] = [0] * max_num_reqs
        self.group_num_blocks: list[list[int]] = [[0] * max_num_reqs for _ in range(num_groups)]
        self.rows: dict[str, int] = {}
        self.free_rows: list[int] = list(range(max_num_reqs - 1, -1, -1))

    def remove(self, request_ids: Iterable[str]) -> None:
        """Release the rows of requests that finished or were preempted."""
        for request_id in request_ids:
            row = self.rows.pop(request_id, None)
            if row is not None:
                self.free_rows.append(row)

    def append_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Tokens the runner sampled for a request: the next positions' inputs."""
        row = self.rows[request_id]
        n = self.num_tokens[row]
        if n + len(token_ids) > self.max_model_len:
            raise ValueError(f"request {request_id} would exceed max_model_len {self.max_model_len}")
        self.token_ids[row, n:n + len(token_ids)] = token_ids
        self.num_tokens[row] = n + len(token_ids)

    def tokens(self, request_id: str) -> np.ndarray:
        """The request's tokens so far, a read-only view of its row."""
        row = self.rows[request_id]
        view = self.token_ids[row, :self.num_tokens[row]]
        view.flags.writeable = False
        return view

    def prepare(self, scheduled: list[ScheduledRequestData], requests: Mapping[str, RequestState]) -> StepInputs:
        """Bring the rows of this step's requests up to date, then gather the step's flattened inputs."""
        rows, starts, query_lens = [], [], []
        for item in scheduled:
            row = self.rows.get(item.request_id)
            if row is None:
                row = self._add_row(requests[item.request_id])
            start = item.num_computed_tokens
            if len(item.new_block_ids) != len(self.block_tables):
                raise ValueError(f"request {item.request_id}: block ids for {len(item.new_block_ids)} KV cache "
                                 f"groups, the cache has {len(self.block_tables)}")
            for table, counts, new in zip(self.block_tables, self.group_num_blocks, item.new_block_ids):
                have = counts[row]
                if new:
                    table[row, have:have + len(new)] = new
                    have = counts[row] = have + len(new)
                if have * self.block_size < start + item.num_tokens:
                    raise ValueError(f"request {item.request_id}: {have} blocks for {start + item.num_tokens} tokens")
            if item.draft_token_ids:  # guesses after the known tokens: inputs of this step only, never kept
                n = self.num_tokens[row]
                if n + len(item.draft_token_ids) > self.max_model_len:
                    raise ValueError(f"request {item.request_id}: drafts past max_model_len {self.max_model_len}")
                self.token_ids[row, n:n + len(item.draft_token_ids)] = item.draft_token_ids
            rows.append(row)
            starts.append(start)
            query_lens.append(item.num_tokens)

        bs = self.block_size
        rows_a = np.asarray(rows, dtype=np.int64)
        starts_a = np.asarray(starts, dtype=np.int64)
        qlens = np.asarray(query_lens, dtype=np.int64)
        seq_lens = starts_a + qlens
        ends = np.cumsum(qlens)
        # token t of the step belongs to request i = token_req[t], at position starts[i] + (t - first[i])
        token_req = np.repeat(np.arange(len(rows)), qlens)
        positions = np.arange(int(ends[-1])) + np.repeat(starts_a - (ends - qlens), qlens)
        token_rows = rows_a[token_req]
        input_ids = self.token_ids[token_rows, positions].astype(np.int64)
        max_blocks = cdiv(int(seq_lens.max()), bs)
        device = self.device
        layouts = []
        block_of, offset = positions // bs, positions % bs
        for table in self.block_tables:
            slots = table[token_rows, block_of].astype(np.int64) * bs + offset
            # columns past a request's own blocks may hold a former occupant's ids: kernels read seq_lens only
            tables = table[rows_a, :max_blocks]
            layouts.append(BatchLayout(qlens, seq_lens, torch.from_numpy(tables).to(device),
                                       torch.from_numpy(slots).to(device), bs))
        return StepInputs(torch.from_numpy(input_ids).to(device), torch.from_numpy(positions).to(device), layouts,
                          rows_a)

    def _add_row(self, request: RequestState) -> int:
        """A fresh row holding the request's tokens so far; its block table starts empty."""
        if not self.free_rows:  # more requests than max_num_seqs: the scheduler never does this, but grow
            self._grow()
        n = request.num_tokens
        if n > self.max_model_len:
            raise ValueError(f"request of {n} tokens exceeds max_model_len {self.max_model_len}")
        row = self.free_rows.pop()
        self.rows[request.request_id] = row
        prompt_len = len(request.prompt_token_ids)
        self.token_ids[row, :prompt_len] = request.prompt_token_ids
        self.token_ids[row, prompt_len:n] = request.output_token_ids
        self.num_tokens[row] = n
        for counts in self.group_num_blocks:
            counts[row] = 0
        return row

    def _grow(self) -> None:
        old = len(self.num_tokens)
        self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
        self.block_tables = [np.concatenate([t, np.zeros_like(t)]) for t in self.block_tables]
        self.num_tokens += [0] * old
        for counts in self.group_num_blocks:
            counts += [0] * old
        self.free_rows += list(range(2 * old - 1, old - 1, -1))
