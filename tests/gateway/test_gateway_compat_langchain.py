"""LangChain (langchain-openai's ChatOpenAI) against the gateway: structured output and tool calling
end to end, with the random test model (constrained decoding makes its answers well-formed)."""

import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.gateway.conftest import create_tenant
from tests.gateway.test_gateway_e2e import MODEL, unique_system_prompt


class Answer(BaseModel):
    """A short verdict."""

    verdict: str = Field(max_length=12)
    confidence: int = Field(ge=0, le=100)


class WeatherQuery(BaseModel):
    # Bounded: a random model would otherwise spend max_tokens inside one string.
    city: str = Field(max_length=10)
    days: int = Field(ge=0, le=9)


@tool(args_schema=WeatherQuery)
def get_weather(city: str, days: int) -> str:
    """The weather in a city for the next days."""
    return f"sunny in {city} for {days} days"


@pytest.fixture
async def llm(gateway):
    key = (await create_tenant(gateway))["api_key"]
    return ChatOpenAI(
        model=MODEL, base_url=str(gateway.make_url("/v1")), api_key=key, max_retries=0, max_tokens=300, seed=3
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
async def test_with_structured_output_returns_the_model(llm, method):
    structured = llm.with_structured_output(Answer, method=method)
    answer = await structured.ainvoke([("system", unique_system_prompt(10)), ("user", "verdict?")])
    assert isinstance(answer, Answer) and len(answer.verdict) <= 12 and 0 <= answer.confidence <= 100


async def test_bind_tools_with_a_required_choice_gives_a_tool_call(llm):
    bound = llm.bind_tools([get_weather], tool_choice="required", strict=True)  # no extra properties
    message = await bound.ainvoke([("system", unique_system_prompt(10)), ("user", "weather in Oslo?")])
    assert isinstance(message, AIMessage)
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "days"}
    assert isinstance(call["args"]["days"], int) and call["id"].startswith("call_")
