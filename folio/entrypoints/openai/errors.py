"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, for every failure the server returns.

FastAPI's own answers (422 validation errors, 404/405 for unknown routes, JSON parse errors) are turned into
the same shape, validation errors as 400 as OpenAI does, so a client sees one error format whatever went wrong.
An unexpected exception becomes a 500 in InternalErrorMiddleware (folio.entrypoints.openai.middleware) rather
than in an `Exception` handler, which Starlette runs in its outermost middleware and then re-raises, so that
uvicorn drops the keep-alive connection.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from folio.engine.async_llm import EngineError, EngineOverloadedError, RequestTimeoutError

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
          413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError",
          504: "TimeoutError"}
RETRY_AFTER_SECONDS = 1  # an overloaded server's hint: its queue moves by a few requests a second at least


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
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: Optional[str] = None,
                   headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def engine_error_status(error: EngineError) -> int:
    """504 for a request past its deadline; 500 for a failure while running it; else 503 (the engine is shut
    down, dead, or overloaded: the request was not run, and another server or a later try may take it)."""
    if isinstance(error, RequestTimeoutError):
        return 504
    return 503 if type(error) is not EngineError else 500


async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", "")
        return error_response(400, f"the request body is not valid JSON: {detail}".rstrip(": "))
    # One error per top-level field: a union field fails once per member, and the member that got furthest into
    # the value (a list of items, not the string it could also have been) says what is wrong.
    deepest: dict[object, tuple[int, str]] = {}
    for err in errors:
        loc = [p for p in err.get("loc", ()) if p != "body"]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        path = ".".join(str(p) for p in loc if not (isinstance(p, str) and "[" in p))  # (less union members' types)
        field = loc[0] if loc else None
        if field not in deepest or len(loc) > deepest[field][0]:
            deepest[field] = len(loc), f"{path}: {msg}" if loc else msg
    param = next(iter(deepest), None)
    return error_response(400, "; ".join(text for _, text in deepest.values()) or "invalid request", param)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), headers=exc.headers)  # a 405's Allow among them


async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
    if isinstance(exc, EngineOverloadedError):
        request.app.state.rejections.inc()
        return error_response(503, str(exc), headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    return error_response(engine_error_status(exc), str(exc))


def install_error_handlers(app: FastAPI) -> None:
    """Handlers of the expected errors; add InternalErrorMiddleware too, for the unexpected ones."""
    for exc_type, handler in ((OpenAIError, _openai_error), (RequestValidationError, _validation_error),
                              (StarletteHTTPException, _http_error), (EngineError, _engine_error)):
        app.add_exception_handler(exc_type, handler)
