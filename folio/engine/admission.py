"""What a server's engine admits, and for how long: a bound on the waiting queue and a per-request deadline.

Without a bound, an overloaded server queues every request it gets and answers each later and later, until
clients time out on work it still does; with one, a request beyond it is refused at once (503 with
Retry-After) and the client can go elsewhere or back off. The bound is checked against the queue as it is
when a submission arrives, so an empty queue always admits (one request larger than the bound is not
starved), and the queue may go past the bound by at most one submission.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from folio.core.request import Request


@dataclass(frozen=True)
class AdmissionPolicy:
    max_waiting_requests: Optional[int] = None  # sequences waiting for the batch (n > 1 counts n)
    max_waiting_tokens: Optional[int] = None  # prompt tokens of those sequences
    request_timeout: Optional[float] = None  # seconds from arrival to the end of a request

    def refusal(self, waiting: Iterable[Request]) -> Optional[str]:
        """Why a submission arriving now is refused, or None when it is admitted."""
        if self.max_waiting_requests is None and self.max_waiting_tokens is None:
            return None
        waiting = list(waiting)
        if self.max_waiting_requests is not None and len(waiting) >= self.max_waiting_requests:
            return f"{len(waiting)} requests are waiting (the server's bound is {self.max_waiting_requests})"
        if self.max_waiting_tokens is not None:
            tokens = sum(request.num_tokens for request in waiting)
            if tokens >= self.max_waiting_tokens:
                return f"{tokens} prompt tokens are waiting (the server's bound is {self.max_waiting_tokens})"
        return None

    def deadline(self, arrival_time: float) -> Optional[float]:
        return None if self.request_timeout is None else arrival_time + self.request_timeout
