"""OpenAI's Agents SDK against the server, on both of its model classes: the default one speaks
the Responses API. What it sends that plain clients do not: "tools": [] for an agent without
tools, and an output type's text.format / response_format beside tool_choice "required" (both
were 400s before a probe with the SDK found them). Tracing is off: it would post to OpenAI."""
from __future__ import annotations

import asyncio

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import BaseModel, Field
from server_harness import KEYS, MODEL

set_tracing_disabled(True)


class Weather(BaseModel):
    city: str = Field(max_length=24)
    sunny: bool


calls: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city now."""
    calls.append(city)
    return f"sunny and 21 degrees in {city}"


@pytest.fixture(params=["responses", "chat"])
def model(request, server):
    client = AsyncOpenAI(base_url=server.base_url, api_key=KEYS["alice"], max_retries=0, timeout=120)
    if request.param == "responses":
        return OpenAIResponsesModel(model=MODEL, openai_client=client)
    return OpenAIChatCompletionsModel(model=MODEL, openai_client=client)


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agent_without_tools_gets_its_output_type(model, streamed):
    agent = Agent(name="w", instructions="Answer about the weather.", model=model, output_type=Weather,
                  model_settings=ModelSettings(max_tokens=48, temperature=0))

    async def go():
        if not streamed:
            return (await Runner.run(agent, "Is it sunny in Paris?", max_turns=1)).final_output
        run = Runner.run_streamed(agent, "Is it sunny in Paris?", max_turns=1)
        async for _ in run.stream_events():
            pass
        return run.final_output

    out = asyncio.run(go())
    assert isinstance(out, Weather) and out.city


def test_a_required_tool_with_an_output_type_is_called(model):
    """An output type puts a format beside tool_choice "required": the call comes back and the
    SDK runs the tool (stopping there: what a 135M model does with the result is not the point)."""
    calls.clear()
    agent = Agent(name="w", instructions="Use the tool.", model=model, tools=[get_weather], output_type=Weather,
                  tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(max_tokens=64, temperature=0, tool_choice="required",
                                                 parallel_tool_calls=False))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=2))
    assert len(calls) == 1 and calls[0]
    assert result.final_output == f"sunny and 21 degrees in {calls[0]}"
