"""ASGI middleware: API-key check, request body size limit, and the x-request-id header.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would wrap `receive` and hide client
disconnects from the routes that abort engine requests when their client goes away.
"""

from __future__ import annotations

import hmac
import uuid

from starlette.exceptions import HTTPException
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from folio.entrypoints.openai.errors import error_response

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without a key


class APIKeyMiddleware:
    """401 for any request without `Authorization: Bearer <key>`, except OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 when a request body exceeds max_bytes, counted as it arrives (Content-Length may be absent or lie),
    so an oversized upload is refused before it is buffered. The error is an HTTPException, which FastAPI's
    body reader re-raises as is and the error handlers turn into an OpenAI-style 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
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


class RequestIdMiddleware:
    """Every response carries `x-request-id`: the client's own when it sent one (so it can match its logs with
    ours), else a fresh one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
