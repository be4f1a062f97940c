"""ResponseStore: the responses a client may fetch again (GET /v1/responses/{id}) or continue from
(`previous_response_id`), kept in this process's memory only.

Bounded twice, so that a busy server's memory does not grow with its traffic: a response is forgotten
`ttl_s` seconds after it was stored, and beyond `max_responses` the oldest goes first. Every entry lives as
long, so insertion order is expiry order and both bounds pop from the front. A restart forgets everything.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

from folio.entrypoints.openai.protocol import ChatMessage
from folio.entrypoints.openai.protocol_responses import ResponseObject

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_TTL_S = 3600.0


@dataclass
class StoredResponse:
    response: ResponseObject
    # the conversation a follow-up continues: the earlier turns, this input and this output (instructions
    # are not carried over, as in OpenAI's API)
    conversation: list[ChatMessage]
    expires_at: float


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_responses = max_responses
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: ResponseObject, conversation: list[ChatMessage]) -> None:
        self._entries[response.id] = StoredResponse(response, conversation, self.clock() + self.ttl_s)
        self._evict()

    def get(self, response_id: str) -> Optional[StoredResponse]:
        self._evict()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        self._evict()
        return len(self._entries)

    def _evict(self) -> None:
        now = self.clock()
        while self._entries and (len(self._entries) > self.max_responses
                                 or next(iter(self._entries.values())).expires_at <= now):
            self._entries.popitem(last=False)
