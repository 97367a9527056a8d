"""A worker answer the gateway cannot format (a logprobs entry without its "logprob", as a worker of
another protocol version could send): the tenant gets a clear OpenAI-style error, and the usage record
keeps the tokens the worker used under the outcome ``format_error``, priced at nothing (nothing was
delivered: docs/api.md, "What a record bills")."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import openai
import pytest
from sqlalchemy import select

from gateway.pipeline import RequestPipeline
from gateway.state import SESSIONMAKER, USAGE_WRITER
from tenancy.models import UsageRecord
from tests.gateway.test_gateway_e2e import MODEL

BROKEN_LOGPROBS = [{"token_id": 65, "top": []}]  # no "logprob"


@pytest.fixture
def unformattable_answer(monkeypatch) -> list[dict[str, Any]]:
    """The real worker generates; its answer's logprobs are replaced by an entry the formatter cannot
    read. Returns the worker's real usage of each request, as it came."""
    generate, stream = RequestPipeline.generate, RequestPipeline.stream
    usages: list[dict[str, Any]] = []

    async def broken_generate(self, prepared):
        result = await generate(self, prepared)
        usages.append(result["usage"])
        return {**result, "logprobs": BROKEN_LOGPROBS}

    async def broken_stream(self, prepared):
        async for event in stream(self, prepared):
            if event.get("type") == "final":
                usages.append(event["usage"])
            # Every token event carries logprobs (requested), also one whose byte completes no text yet.
            yield {**event, "logprobs": BROKEN_LOGPROBS} if event.get("logprobs") else event

    monkeypatch.setattr(RequestPipeline, "generate", broken_generate)
    monkeypatch.setattr(RequestPipeline, "stream", broken_stream)
    return usages


async def _record(gateway) -> UsageRecord:
    await gateway.app[USAGE_WRITER].flush()
    async with gateway.app[SESSIONMAKER]() as session:
        [record] = list(await session.scalars(select(UsageRecord)))
    return record


async def test_an_answer_that_cannot_be_formatted_is_a_clear_500_recorded_with_its_tokens(
    gateway, sdk, unformattable_answer
):
    with pytest.raises(openai.InternalServerError) as raised:
        await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
    error = raised.value.body
    assert raised.value.status_code == 500
    assert (error["type"], error["code"]) == ("api_error", "response_format_failed")
    assert "could not be formatted" in error["message"] and error["request_id"]
    [usage] = unformattable_answer
    record = await _record(gateway)
    assert (record.status, record.outcome) == (500, "format_error")
    assert (record.prompt_tokens, record.completion_tokens) == (usage["prompt_tokens"], 5)
    assert record.prompt_tokens > 0 and record.cost_total == 0.0  # nothing delivered costs nothing


async def test_a_stream_whose_chunk_cannot_be_formatted_ends_with_an_error_event(
    gateway, sdk, unformattable_answer
):
    stream = await sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        logprobs=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    with pytest.raises(openai.APIError) as raised:
        async for _ in stream:
            pass
    assert "could not be formatted" in raised.value.message
    record = await _record(gateway)
    assert (record.status, record.outcome) == (200, "format_error")  # the headers had gone out
    # The first token (the one that could not be sent) had been generated: the worker's count then.
    assert record.prompt_tokens > 0 and record.completion_tokens == 1 and record.cost_total == 0.0


async def test_the_unbilled_record_is_told_apart_in_the_table_the_export_and_the_cli(
    gateway, sdk, unformattable_answer, capsys, monkeypatch
):
    """The record's ``billable`` was dropped on the way to the table: the export, the report and the CLI
    showed its tokens like billed ones (only its cost of 0 hinted, and a zero-priced row costs 0 too)."""
    from tests.gateway.conftest import ADMIN_TOKEN
    from tests.gateway.test_gateway_admin_api import run_cli

    monkeypatch.setenv("PREFIXGATE_URL", str(gateway.make_url("")))
    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    with pytest.raises(openai.InternalServerError):
        await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True
        )
    record = await _record(gateway)
    assert record.billable is False and record.prompt_tokens > 0
    code, out, _ = await run_cli(capsys, "report", "requests")
    [row] = json.loads(out)["data"]
    assert code == 0 and row["billable"] is False and row["prompt_tokens"] == record.prompt_tokens
    code, out, _ = await run_cli(capsys, "report", "requests", "--format", "csv")
    lines = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and [line["billable"] for line in lines] == ["False"]
    code, out, _ = await run_cli(capsys, "report", "usage")
    [usage_row] = json.loads(out)["data"]
    assert (usage_row["unbilled_requests"], usage_row["unbilled_prompt_tokens"]) == (1, record.prompt_tokens)
    assert usage_row["unbilled_completion_tokens"] == record.completion_tokens
