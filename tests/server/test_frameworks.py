"""LangChain's OpenAI chat model against the server, as an application built on it calls it:
plain and streamed answers with usage, tools bound from a Python function and a round trip with
the tool's result, and structured output to a pydantic model by both of LangChain's methods.
LangChain writes its schemas without "additionalProperties", so the tool and json_schema cases
also hold kvfence's closing of open objects (engine/closed_schema.py) to a real client."""
from __future__ import annotations

import asyncio
from typing import Literal

import langchain_openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from pydantic import BaseModel, Field
from server_harness import KEYS, MODEL


@pytest.fixture
def chat(server):
    def make(**kw):
        return langchain_openai.ChatOpenAI(base_url=server.base_url, api_key=KEYS["alice"], model=MODEL,
                                           temperature=0, max_retries=0, timeout=120, **{"max_tokens": 24, **kw})
    return make


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The weather in a city now."""
    return f"21 degrees {unit} and clear in {city}"


class Pick(BaseModel):
    colour: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=9)


def test_invoke_and_stream_give_the_same_answer_with_usage(chat):
    llm = chat(stream_usage=True)
    whole = llm.invoke("What is the capital of France?")
    assert "Paris" in whole.content
    assert whole.usage_metadata["input_tokens"] > 0 and whole.usage_metadata["output_tokens"] > 0
    pieces = list(llm.stream("What is the capital of France?"))
    assert "".join(p.content for p in pieces) == whole.content          # greedy: the same tokens
    assert [p.usage_metadata for p in pieces if p.usage_metadata][-1]["output_tokens"] == \
        whole.usage_metadata["output_tokens"]


def test_a_bound_python_function_is_called_and_its_result_answered(chat):
    llm = chat(max_tokens=64)
    ask = HumanMessage("What is the weather in Paris?")
    ai = llm.bind_tools([get_weather], tool_choice="required").invoke([ask])
    assert ai.tool_calls and not ai.invalid_tool_calls, ai
    for call in ai.tool_calls:
        assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
        assert call["args"]["unit"] in ("celsius", "fahrenheit")
    results = [ToolMessage(get_weather(**c["args"]), tool_call_id=c["id"]) for c in ai.tool_calls]
    answer = llm.bind_tools([get_weather]).invoke([ask, ai, *results])
    assert answer.content or answer.tool_calls


def test_streamed_tool_call_chunks_add_up_to_the_call(chat):
    bound = chat(max_tokens=64).bind_tools([get_weather], tool_choice="get_weather")
    whole = bound.invoke("Weather in Paris?")
    total = None
    for chunk in bound.stream("Weather in Paris?"):
        total = chunk if total is None else total + chunk
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]
    assert whole.tool_calls and set(whole.tool_calls[0]["args"]) == {"city", "unit"}


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_parses_into_the_pydantic_model(chat, method):
    structured = chat(max_tokens=48).with_structured_output(Pick, method=method, include_raw=True)
    got = structured.invoke("Name a colour and a small number.")
    assert got["parsing_error"] is None and isinstance(got["parsed"], Pick), got["raw"]


def test_concurrent_async_calls(chat):
    llm = chat(max_tokens=8)

    async def both():
        return await asyncio.gather(llm.ainvoke("Say hi"), llm.ainvoke("Say bye"))

    hi, bye = asyncio.run(both())
    assert hi.content == llm.invoke("Say hi").content and bye.content == llm.invoke("Say bye").content
