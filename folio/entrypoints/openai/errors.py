"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, for every failure the server returns.

FastAPI's own answers (422 validation errors, 404/405 for unknown routes, JSON parse errors) are turned into
the same shape, validation errors as 400 as OpenAI does, so a client sees one error format whatever went wrong.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from folio.engine.async_llm import EngineDeadError, EngineError

logger = logging.getLogger("folio")

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
          413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class OpenAIError(Exception):
    """Raised anywhere in a route to answer with this status and message."""

    def __init__(self, status: int, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    @classmethod
    def bad_request(cls, error: ValueError, fields: Any = ()) -> "OpenAIError":
        """A 400 from a ValueError whose message starts with the offending field, as SamplingParams' do (or a path
        in it: "tools[0].function.parameters ..." names tools)."""
        message = str(error)
        first = re.split(r"[ .\[]", message, maxsplit=1)[0]
        return cls(400, message, first if first in fields else None)


def error_body(status: int, message: str, param: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", "")
        return error_response(400, f"the request body is not valid JSON: {detail}".rstrip(": "))
    parts: dict[object, str] = {}  # the first error of each top-level field (a union field fails once per member)
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.setdefault(loc[0] if loc else None, f"{'.'.join(loc)}: {msg}" if loc else msg)
    param = next(iter(parts), None)
    return error_response(400, "; ".join(parts.values()) or "invalid request", param)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
    return error_response(503 if isinstance(exc, EngineDeadError) else 500, str(exc))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error serving %s", request.url.path, exc_info=exc)
    return error_response(500, f"internal server error: {exc!r}")


def install_error_handlers(app: FastAPI) -> None:
    for exc_type, handler in ((OpenAIError, _openai_error), (RequestValidationError, _validation_error),
                              (StarletteHTTPException, _http_error), (EngineError, _engine_error),
                              (Exception, _unexpected)):
        app.add_exception_handler(exc_type, handler)
