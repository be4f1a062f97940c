"""ASGI middleware: API-key check, request body size limit, the x-request-id header, and unexpected errors.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would wrap `receive` and hide client
disconnects from the routes that abort engine requests when their client goes away.
"""

from __future__ import annotations

import hmac
import logging
import uuid

from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from folio.entrypoints.openai.errors import error_response

logger = logging.getLogger("folio")

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without a key


class HTTPMiddleware:
    """Middleware that acts on HTTP requests only (`handle`); lifespan and other messages pass through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.handle(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class APIKeyMiddleware(HTTPMiddleware):
    """401 for any request without `Authorization: Bearer <key>`, except OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        super().__init__(app)
        self.expected = f"Bearer {api_key}".encode()

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware(HTTPMiddleware):
    """413 when a request body exceeds max_bytes, counted as it arrives (Content-Length may be absent or lie),
    so an oversized upload is refused before it is buffered. The error is an HTTPException, which FastAPI's
    body reader re-raises as is and the error handlers turn into an OpenAI-style 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = dict(scope["headers"]).get(b"content-length", b"")
        declared = int(length) if length.isdigit() else 0
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            if declared > self.max_bytes:
                raise HTTPException(413, f"request body exceeds the limit of {self.max_bytes} bytes")
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, f"request body exceeds the limit of {self.max_bytes} bytes")
            return message

        await self.app(scope, limited_receive, send)


class RequestIdMiddleware(HTTPMiddleware):
    """Every response carries `x-request-id`: the client's own when it sent one (so it can match its logs with
    ours), else a fresh one."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


class InternalErrorMiddleware(HTTPMiddleware):
    """A 500 in OpenAI's shape for an unexpected exception, logged with its traceback, and the exception kept
    from reaching uvicorn, so the connection stays open for the client's next request. Once a response has
    started (a stream) there is nothing to answer with: the exception goes on, and the connection is closed."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            logger.exception("unexpected error serving %s", scope["path"], exc_info=exc)
            await error_response(500, f"internal server error: {exc!r}")(scope, receive, send)
