"""A schema fuzzer (schemathesis) over the server's own OpenAPI document: requests that fit the schema and requests
that break it, from a fixed seed and a fixed example budget. No answer may be a 5xx, and every answer must be
what the document says: a documented status, a documented media type, a body that fits its schema.

The server's context is short, so that a valid request generating up to max_tokens stays quick."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
# (imported now, not lazily by from_dict under a running server: pytest rewrites schemathesis's modules with
# ast.parse, and CPython 3.11.7's AST builder keeps its depth count per interpreter, so a parse in another thread,
# such as a traceback formatted there, fails it with "AST constructor recursion depth mismatch")
from schemathesis.specs.openapi import schemas  # noqa: F401
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance)

from folio.entrypoints.openai.server_options import ServerOptions
from server_fixture import running_server

EXAMPLES = 250
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def server(llama_dir):
    with running_server(llama_dir, max_model_len=48, options=ServerOptions(max_prompts_per_request=4)) as s:
        yield s


def test_every_answer_is_documented_and_none_is_a_5xx(server):
    schema = schemathesis.openapi.from_dict(httpx.get(server.base_url + "/openapi.json").json())
    operations = [result.ok() for result in schema.get_all_operations()]
    cases = st.one_of([operation.as_strategy(mode) for operation in operations for mode in GenerationMode])

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case) -> None:
        response = case.call(base_url=server.base_url, timeout=60)
        case.validate_response(response, checks=CHECKS)

    check()
    server.wait_idle()
