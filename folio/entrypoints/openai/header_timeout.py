"""A deadline for a request's headers, which uvicorn does not have.

uvicorn closes a keep-alive connection that stays silent, but once a byte of a request has arrived it waits
for the rest of the headers for ever, so clients that open connections and send headers slowly or never
(by fault or, as slowloris does, on purpose) each hold a connection, up to the connection limit and every
client after them refused. This protocol closes a connection whose request headers are not complete within
`header_timeout` seconds of its opening, or of the first byte of its next request. Bodies are not timed:
they are bounded in size (BodyLimitMiddleware), and a stream's client may read slowly on purpose.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeaderTimeoutProtocol(HttpToolsProtocol):
    header_timeout: float = 10.0
    _header_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def header_timeout_protocol(seconds: float) -> type[HeaderTimeoutProtocol]:
    """uvicorn's `http` setting takes a protocol class: one with this deadline."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": seconds})
