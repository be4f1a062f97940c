"""The OpenAPI document as the server behaves, so that a schema fuzzer can check responses, not only requests.

FastAPI's defaults describe another server: a 422 for invalid requests (this one answers 400, as OpenAI
does), `{}` for bodies that the routes return as ready-made Responses, JSON for the streams and /metrics. Each
route declares its success schema, its streaming media type and the errors only it can give (`responses`);
`install_openapi` adds the errors any route can give and removes the 422.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from folio.entrypoints.openai.errors import ERROR_TYPES


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: int


class ErrorResponse(BaseModel):
    """Every error's body (folio.entrypoints.openai.errors)."""

    error: ErrorInfo


def errors(*statuses: int) -> dict[int, dict[str, Any]]:
    """`responses` entries for the error statuses a route gives."""
    return {status: {"model": ErrorResponse, "description": ERROR_TYPES[status]} for status in statuses}


# A route that streams when the request says "stream": true documents its 200 with this beside its JSON schema.
EVENT_STREAM = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                      "description": "the JSON body, or with \"stream\": true server-sent events ending in "
                                     "`data: [DONE]`"}}
# Errors any route may give: an unexpected failure, and 503 when the engine is down or shutting down, or when
# uvicorn's connection limit is reached.
_ANY_ROUTE = (500, 503)


def install_openapi(app: FastAPI, api_key: bool) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            keyed = (401,) if api_key else ()
            for path, operations in schema["paths"].items():
                for operation in operations.values():
                    responses = operation["responses"]
                    responses.pop("422", None)
                    for status in _ANY_ROUTE + (keyed if path != "/health" else ()):
                        responses.setdefault(str(status), _error_response(status))
            components = schema["components"]["schemas"]  # ErrorResponse among them: the routes' errors() name it
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _error_response(status: int) -> dict[str, Any]:
    return {"description": ERROR_TYPES[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
