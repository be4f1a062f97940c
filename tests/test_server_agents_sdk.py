"""The OpenAI Agents SDK against the server, over the Responses API (its default model) and chat completions,
streamed and not: an agent calls its function tool, and an agent with an output_type gets its pydantic model back,
with a forced tool call first too (a 400 before the message format applied to the message only). The tiny model with
the Qwen2.5-style template of test_server_structured_output writes whatever the grammars allow; the runs stop at the
first tool call (`stop_on_first_tool`), so they do not depend on what a random model does with a tool's result."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import pydantic
import pytest

from server_fixture import MODEL_NAME
from test_server_structured_output import server  # noqa: F401 (a fixture)

agents = pytest.importorskip("agents")

agents.set_tracing_disabled(True)  # (no network: traces would go to OpenAI)
APIS = pytest.mark.parametrize("api", ["responses", "chat"])
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["run", "streamed"])


class Record(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(max_length=8)]
    n: Annotated[int, pydantic.Field(ge=0, le=99)]


def run(server, api: str, stream: bool, tool_choice: str = None, output_type: type = None, seed: int = 3):
    """Run an agent with a get_time tool (none with tool_choice None); returns (the result, the calls it ran)."""
    calls: list[str] = []

    @agents.function_tool
    def get_time(tz: Literal["UTC", "CET"]) -> str:
        """The time in a timezone."""
        calls.append(tz)
        return "12:00"

    async def go():
        # closed here, on this loop: a leaked client is closed by the GC later, on whatever loop runs then
        async with server.async_openai() as client:
            model = agents.OpenAIResponsesModel(MODEL_NAME, client) if api == "responses" else \
                agents.OpenAIChatCompletionsModel(MODEL_NAME, client)
            settings = agents.ModelSettings(tool_choice=tool_choice, parallel_tool_calls=False if tool_choice else None,
                                            max_tokens=120, temperature=1.0, extra_body={"seed": seed})
            agent = agents.Agent(name="clock", instructions="Tell the time.", model=model, model_settings=settings,
                                 tools=[get_time] if tool_choice else [], output_type=output_type,
                                 tool_use_behavior="stop_on_first_tool")
            if not stream:
                return await agents.Runner.run(agent, "What time is it in Paris?", max_turns=2)
            result = agents.Runner.run_streamed(agent, "What time is it in Paris?", max_turns=2)
            async for _ in result.stream_events():
                pass
            return result

    return asyncio.run(go()), calls


@APIS
@STREAM
@pytest.mark.parametrize("tool_choice", ["required", "get_time"])
def test_an_agent_calls_its_tool(server, api, stream, tool_choice):  # noqa: F811
    result, calls = run(server, api, stream, tool_choice)
    assert len(calls) == 1 and calls[0] in ("UTC", "CET") and result.final_output == "12:00"


@APIS
@STREAM
def test_an_output_type_comes_back_as_its_model(server, api, stream):  # noqa: F811
    result, calls = run(server, api, stream, output_type=Record)
    assert isinstance(result.final_output, Record) and not calls


@APIS
def test_an_output_type_with_a_forced_tool_call_first(server, api):  # noqa: F811
    result, calls = run(server, api, False, "required", output_type=Record)
    assert len(calls) == 1 and result.final_output == "12:00"  # (the run stops at the call, before the message)
