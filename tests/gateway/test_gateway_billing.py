"""Billing through the real gateway and real worker processes: delivered tokens billed, failures before
any output free, who ended a request recorded, prices frozen per record, reports and export.

The random-tiny model's tokenizer is byte-level: one token per byte, and a token whose byte does not
complete a character sends no text yet. So for a stream whose text the client fully received,
``len(text) <= tokens delivered <= len(text.encode())`` (a replacement character stands for one bad byte).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from gateway.app import create_app
from gateway.billing import UNKNOWN_MODEL
from gateway.state import SESSIONMAKER, USAGE_WRITER
from tenancy.models import UsageRecord
from tests.gateway.conftest import ADMIN, create_tenant, make_config
from tests.gateway.test_gateway_e2e import MODEL, auth, chat_body, unique_system_prompt
from tests.worker_process import worker_process

PRICES = {"price_input_per_mtok": 3.0, "price_cached_input_per_mtok": 0.5, "price_output_per_mtok": 7.0}


async def records(client) -> list[UsageRecord]:
    await client.app[USAGE_WRITER].flush()
    async with client.app[SESSIONMAKER]() as session:
        return list(await session.scalars(select(UsageRecord).order_by(UsageRecord.id)))


async def wait_records(client, count: int, timeout_s: float = 10.0) -> list[UsageRecord]:
    """The records once ``count`` exist (a cut request is recorded when its handler ends)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        rows = await records(client)
        if len(rows) >= count or loop.time() > deadline:
            return rows
        await asyncio.sleep(0.05)


def parse_sse(raw: bytes) -> list[Any]:
    events = []
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def streamed_text(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


async def key_id_of(client, tenant_id: str) -> str:
    keys = await (await client.get(f"/admin/v1/tenants/{tenant_id}/keys", headers=ADMIN)).json()
    return keys["data"][0]["id"]


async def test_stream_the_client_closes_is_billed_what_was_sent(gateway):
    tenant = await create_tenant(gateway, **PRICES)
    body = chat_body(unique_system_prompt(), stream=True, max_tokens=3000, ignore_eos=True)
    body["user"] = "alice"  # the end user (chat_body's `user` is the user message)
    response = await gateway.post("/v1/chat/completions", json=body, headers=auth(tenant["api_key"]))
    assert response.status == 200
    received = b""
    while received.count(b"data: ") < 20:
        chunk = await asyncio.wait_for(response.content.readany(), 30)
        assert chunk, f"the stream ended early: {received[-500:]!r}"
        received += chunk
    response.close()  # the client hangs up part-way
    [row] = await wait_records(gateway, 1)
    text = streamed_text(parse_sse(received))
    assert row.outcome == "client_cancelled" and row.status == 499
    assert len(text) <= row.completion_tokens < 3000  # at least what the client read; not all of it
    assert row.prompt_tokens > 64 and row.end_user == "alice"
    assert row.key_id == await key_id_of(gateway, tenant["id"])
    assert row.price_output_per_mtok == 7.0 and row.tenant_name == "acme"
    expected_cost = (
        (row.prompt_tokens - row.cached_tokens) * 3.0 + row.cached_tokens * 0.5 + row.completion_tokens * 7.0
    ) / 1e6
    assert row.cost_total == pytest.approx(expected_cost, abs=1e-9) and row.cost_total > 0


async def test_completed_stream_and_request_are_billed_the_workers_usage(gateway):
    tenant = await create_tenant(gateway)
    key = tenant["api_key"]
    body = chat_body(unique_system_prompt(), stream=True, max_tokens=40, ignore_eos=True)
    response = await gateway.post("/v1/chat/completions", json=body, headers=auth(key))
    events = parse_sse(await response.read())
    usage = [e for e in events if isinstance(e, dict) and e.get("usage")][-1]["usage"]
    plain = await gateway.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, headers=auth(key)
    )
    assert plain.status == 200
    stream_row, plain_row = await wait_records(gateway, 2)
    assert stream_row.outcome == plain_row.outcome == "completed"
    assert stream_row.completion_tokens == usage["completion_tokens"] == 40
    assert stream_row.prompt_tokens == usage["prompt_tokens"]
    assert plain_row.completion_tokens == (await plain.json())["usage"]["completion_tokens"]
    assert plain_row.cost_total > 0 and plain_row.price_input_per_mtok == 1.0  # the gateway's default


async def test_requests_refused_before_any_work_cost_nothing(gateway):
    key = (await create_tenant(gateway))["api_key"]
    bad = await gateway.post("/v1/chat/completions", json=chat_body("x", max_tokens=10**6), headers=auth(key))
    assert bad.status == 400
    [row] = await wait_records(gateway, 1)
    assert row.outcome == "client_error" and row.status == 400
    assert (row.prompt_tokens, row.completion_tokens, row.cost_total) == (0, 0, 0.0)


async def test_model_names_no_one_serves_make_no_report_rows_of_their_own(gateway):
    """A 404 stored the client's model string and the report groups by model: 50 junk names made 50
    rows (for free), forever. Only a model the gateway serves names a record; others are "(unknown)"."""
    tenant = await create_tenant(gateway, name="junk")

    async def junk(i: int) -> int:
        body = chat_body("hi") | {"model": f"no-such-model-{i:05d}"}
        response = await gateway.post("/v1/chat/completions", json=body, headers=auth(tenant["api_key"]))
        await response.read()
        return response.status

    assert set(await asyncio.gather(*(junk(i) for i in range(50)))) == {404}
    served = await gateway.post("/v1/chat/completions", json=chat_body("hi"), headers=auth(tenant["api_key"]))
    assert served.status == 200, await served.text()
    await gateway.app[USAGE_WRITER].flush()
    report = await gateway.get(f"/admin/v1/reports/usage?tenant_id={tenant['id']}", headers=ADMIN)
    rows = {row["model"]: row for row in (await report.json())["data"]}
    assert sorted(rows) == sorted([UNKNOWN_MODEL, MODEL])
    assert (rows[UNKNOWN_MODEL]["requests"], rows[UNKNOWN_MODEL]["errors"]) == (50, 50)
    assert rows[UNKNOWN_MODEL]["cost_total"] == 0.0 and rows[MODEL]["requests"] == 1


def worker_pid(url: str) -> int:
    """The pid of the ``python -m worker --port P`` process serving ``url``."""
    wanted = ["-m", "worker", "--port", url.rsplit(":", 1)[1]]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            if any(argv[i : i + 4] == wanted for i in range(len(argv))):
                return int(entry.name)
    raise LookupError(f"no worker process for {url}")


@pytest.fixture
def own_worker(tmp_path):
    """A worker this test may SIGKILL."""
    with worker_process("--model", "random-tiny", "--num-blocks", "2048", log_path=tmp_path / "w.log") as url:
        yield url


async def test_worker_crash_mid_stream_and_before_output(aiohttp_client, sqlite_url, tmp_path, own_worker):
    config = make_config(sqlite_url, tmp_path, worker_urls=(own_worker,), worker_health_interval_s=60)
    client = await aiohttp_client(create_app(config))
    key = (await create_tenant(client, **PRICES))["api_key"]
    body = chat_body(unique_system_prompt(), stream=True, max_tokens=3500, ignore_eos=True)
    response = await client.post("/v1/chat/completions", json=body, headers=auth(key))
    received = b""
    while received.count(b"data: ") < 20:
        chunk = await asyncio.wait_for(response.content.readany(), 30)
        assert chunk, f"the stream ended early: {received[-500:]!r}"
        received += chunk
    os.kill(worker_pid(own_worker), signal.SIGKILL)  # the worker dies mid-stream
    received += await asyncio.wait_for(response.read(), 30)
    events = parse_sse(received)
    assert events[-1] == "[DONE]" and "error" in events[-2]  # the client is told it was cut
    text = streamed_text(events)

    # A request routed to the dead worker before the health check noticed: 503, and free.
    failed = await client.post(
        "/v1/chat/completions", json=chat_body(unique_system_prompt()), headers=auth(key)
    )
    assert failed.status == 503

    cut, refused = await wait_records(client, 2)
    assert cut.outcome == "server_error" and cut.status == 200  # not "499 client closed"
    assert 0 < len(text) <= cut.completion_tokens <= len(text.encode())
    assert cut.prompt_tokens > 64 and cut.cost_total > 0
    assert refused.outcome == "server_error" and refused.status == 503
    assert (refused.prompt_tokens, refused.completion_tokens, refused.cost_total) == (0, 0, 0.0)


async def test_history_keeps_its_prices_and_name_when_the_tenant_changes(gateway):
    tenant = await create_tenant(gateway, **PRICES)
    key = tenant["api_key"]
    response = await gateway.post(
        "/v1/chat/completions", json=chat_body(unique_system_prompt()), headers=auth(key)
    )
    assert response.status == 200

    async def report() -> dict:
        await gateway.app[USAGE_WRITER].flush()
        return await (await gateway.get("/admin/v1/reports/usage", headers=ADMIN)).json()

    before = await report()
    assert before["data"][0]["cost_total"] > 0 and before["data"][0]["tenant_name"] == "acme"
    patched = await gateway.patch(
        f"/admin/v1/tenants/{tenant['id']}",
        json={"price_output_per_mtok": 1000.0, "name": "renamed"},
        headers=ADMIN,
    )
    assert patched.status == 200
    assert await report() == before
    assert (await gateway.delete(f"/admin/v1/tenants/{tenant['id']}", headers=ADMIN)).status in (200, 204)
    assert await report() == before


async def test_report_endpoints_export_and_rejected_records(gateway):
    tenant = await create_tenant(gateway, name="=cmd|' /C calc'!A0")
    key = tenant["api_key"]
    for user in ("u1", "u2", "u1"):
        body = {**chat_body(unique_system_prompt()), "user": user}
        assert (await gateway.post("/v1/chat/completions", json=body, headers=auth(key))).status == 200
    await wait_records(gateway, 3)
    by_user = await (
        await gateway.get("/admin/v1/reports/usage?group_by=end_user&granularity=hour", headers=ADMIN)
    ).json()
    assert sorted((r["end_user"], r["requests"]) for r in by_user["data"]) == [("u1", 2), ("u2", 1)]
    csv_text = await (await gateway.get("/admin/v1/reports/usage?format=csv", headers=ADMIN)).text()
    assert "'=cmd" in csv_text and "\n=cmd" not in csv_text and ",=cmd" not in csv_text

    page = await (await gateway.get("/admin/v1/reports/requests?limit=2", headers=ADMIN)).json()
    assert len(page["data"]) == 2 and page["has_more"] is True
    rest = await (
        await gateway.get(f"/admin/v1/reports/requests?cursor={page['next_cursor']}", headers=ADMIN)
    ).json()
    assert len(rest["data"]) == 1 and rest["has_more"] is False
    bad = await gateway.get("/admin/v1/reports/requests?cursor=abc", headers=ADMIN)
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "cursor"
    bad_group = await gateway.get("/admin/v1/reports/usage?group_by=planet", headers=ADMIN)
    assert bad_group.status == 400

    listed = await (await gateway.get("/admin/v1/usage/rejected", headers=ADMIN)).json()
    assert listed == {"object": "list", "total": 0, "data": []}
    retried = await (await gateway.post("/admin/v1/usage/rejected/retry", headers=ADMIN)).json()
    assert retried == {"stored": 0, "rejected": 0}
    metrics = await (await gateway.get("/metrics", headers=ADMIN)).text()
    assert "prefixgate_usage_rejected 0.0" in metrics


async def test_cli_report_commands(gateway, capsys, monkeypatch):
    from tests.gateway.conftest import ADMIN_TOKEN
    from tests.gateway.test_gateway_admin_api import run_cli

    monkeypatch.setenv("PREFIXGATE_URL", str(gateway.make_url("")))
    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    key = (await create_tenant(gateway, name="cli-billing"))["api_key"]
    for user in ("ann", "bob"):
        body = {**chat_body(unique_system_prompt()), "user": user}
        assert (await gateway.post("/v1/chat/completions", json=body, headers=auth(key))).status == 200
    await wait_records(gateway, 2)
    code, out, _ = await run_cli(capsys, "report", "usage", "--tenant", "cli-billing", "--by-end-user")
    assert code == 0 and sorted(r["end_user"] for r in json.loads(out)["data"]) == ["ann", "bob"]
    # The report is paged by the gateway; the command follows the pages (one page with --cursor).
    report = ("report", "usage", "--tenant", "cli-billing", "--by-end-user", "--limit", "1")
    code, out, _ = await run_cli(capsys, *report)
    whole = json.loads(out)
    assert code == 0 and [r["end_user"] for r in whole["data"]] == ["ann", "bob"] and not whole["has_more"]
    code, out, _ = await run_cli(capsys, *report, "--format", "csv")
    assert code == 0 and [line.split(",")[4] for line in out.splitlines()] == ["end_user", "ann", "bob"]
    first = await (
        await gateway.get(
            "/admin/v1/reports/usage", params={"group_by": "end_user", "limit": "1"}, headers=ADMIN
        )
    ).json()
    code, out, _ = await run_cli(capsys, *report, "--cursor", first["next_cursor"])
    assert code == 0 and [r["end_user"] for r in json.loads(out)["data"]] == ["bob"]
    code, out, _ = await run_cli(capsys, "report", "requests", "--tenant", "cli-billing", "--limit", "1")
    first = json.loads(out)
    assert code == 0 and len(first["data"]) == 1 and first["has_more"] is True
    code, out, _ = await run_cli(capsys, "report", "requests", "--cursor", first["next_cursor"])
    assert [r["end_user"] for r in json.loads(out)["data"]] == ["bob"]
    code, out, _ = await run_cli(capsys, "report", "rejected")
    assert code == 0 and json.loads(out)["total"] == 0
    code, out, _ = await run_cli(capsys, "report", "rejected", "--retry")
    assert code == 0 and json.loads(out) == {"stored": 0, "rejected": 0}
