"""SpecDecodingStats: how speculation is paying, counted since start by the scheduler (vLLM's names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verification steps: (request, step) pairs that had at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos += [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def since(self, earlier: "SpecDecodingStats") -> "SpecDecodingStats":
        """What was counted after `earlier` (a snapshot of these stats)."""
        per_pos = [n - (earlier.num_accepted_tokens_per_pos[i] if i < len(earlier.num_accepted_tokens_per_pos) else 0)
                   for i, n in enumerate(self.num_accepted_tokens_per_pos)]
        return SpecDecodingStats(self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
                                 self.num_accepted_tokens - earlier.num_accepted_tokens, per_pos)

    def snapshot(self) -> "SpecDecodingStats":
        return dataclasses.replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per draft token."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields on average: the accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
