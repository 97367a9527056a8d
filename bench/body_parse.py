"""Request-body parsing under hostile bodies: how long the event loop is held, before and after the
byte-level shape check (hostile-input review, finding 2).

    python -m bench.body_parse

1. ``read_json`` on bodies within the 4 MiB limit, hostile (millions of tiny values) and legitimate
   (a 4 MB prompt, a 200k-token id prompt, a long chat), timed for the current code and for main's
   (``orjson.loads`` with the collector on, then a per-node depth walk in Python), same run, same bodies.
2. The real gateway app (SQLite, no worker needed) in this process: tenant B polls ``GET /v1/models``
   while tenant A posts a 3.9 MB body of 1.3 M empty lists; B's slowest answer and the loop's largest
   lag, with main's parser patched in (``gateway.request_body.load_json``, which parses tenant bodies,
   large ones on the CPU pool), then with the current one.

The last line printed is JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp.test_utils import TestClient, TestServer

import gateway.request_body
from gateway.app import create_app
from gateway.errors import InvalidRequest
from gateway.json_body import load_json, read_json
from migrations import upgrade_database_async
from tests.gateway.conftest import create_tenant, make_config

LIMIT = 4 * 1024 * 1024
BASE = {"model": "random-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _body(**extra: Any) -> bytes:
    return orjson.dumps({**BASE, **extra})


BODIES = {
    "empty_lists_1.3M": _body(x=[[]] * 1_300_000),
    "zeros_2M": _body(x=[0] * 2_000_000),
    "keys_350k": _body(**{f"k{i}": 0 for i in range(350_000)}),
    "messages_130k": _body(messages=[{"role": "user", "content": ""}] * 130_000),
    "depth60_x30k": _body(x=[json.loads("[" * 60 + "0" + "]" * 60)] * 30_000),
    "legit_text_4MB": _body(
        messages=[{"role": "user", "content": "some [text], {with} brackets. " * 130_000}]
    ),
    "legit_tokens_200k": orjson.dumps({"model": "random-tiny", "prompt": list(range(200_000))}),
    "legit_chat_2k_msgs": _body(messages=[{"role": "user", "content": "a question " * 50}] * 2_000),
}


def legacy_load_json(body: bytes) -> dict[str, Any]:
    """main's parser (before this change): loads with the collector on, then a Python walk."""
    data = orjson.loads(body)
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        for child in value.values() if isinstance(value, dict) else value:
            if isinstance(child, dict | list):
                if depth >= 64:
                    raise InvalidRequest("nested", code="invalid_json")
                stack.append((child, depth + 1))
    return data


async def legacy_read_json(body: bytes) -> dict[str, Any]:
    return legacy_load_json(body)


async def _time(parse, body: bytes) -> tuple[float, str]:
    started = time.perf_counter()
    try:
        data = await parse(body)
        outcome = "ok"
        del data
    except InvalidRequest as exc:
        outcome = exc.code or "400"
    return time.perf_counter() - started, outcome


async def parse_table() -> dict[str, Any]:
    print(f"{'body':22} {'bytes':>9} {'main s':>8} {'main':>12} {'now s':>8} {'now':>22} {'main÷now':>9}")
    out = {}
    for name, body in BODIES.items():
        assert len(body) <= LIMIT, name
        old = [await _time(legacy_read_json, body) for _ in range(2)]
        new = [await _time(read_json, body) for _ in range(2)]
        old_s, new_s = min(t for t, _ in old), min(t for t, _ in new)
        print(
            f"{name:22} {len(body):9} {old_s:8.3f} {old[0][1]:>12} {new_s:8.4f} {new[0][1]:>22} "
            f"{old_s / new_s:9.1f}"
        )
        out[name] = {"main_s": round(old_s, 4), "now_s": round(new_s, 4), "now": new[0][1]}
    return out


async def stall(load) -> dict[str, float]:
    """B's slowest /v1/models answer and the loop's largest lag while A's hostile body is handled."""
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'db.sqlite'}"
        await upgrade_database_async(url)
        original = gateway.request_body.load_json  # what the tenant handlers parse with
        gateway.request_body.load_json = load
        client = TestClient(TestServer(create_app(make_config(url, Path(tmp)))))
        await client.start_server()
        try:
            a = (await create_tenant(client, name="a"))["api_key"]
            b = (await create_tenant(client, name="b"))["api_key"]
            body = BODIES["empty_lists_1.3M"]
            lags: list[float] = []

            async def ticker() -> None:
                last = time.perf_counter()
                while True:
                    await asyncio.sleep(0.01)
                    now = time.perf_counter()
                    lags.append(now - last - 0.01)
                    last = now

            async def timed_b() -> float:
                started = time.perf_counter()
                response = await client.get("/v1/models", headers={"Authorization": f"Bearer {b}"})
                await response.read()
                return time.perf_counter() - started

            baseline = [await timed_b() for _ in range(5)]
            tick = asyncio.create_task(ticker())
            sent = asyncio.create_task(
                client.post(
                    "/v1/chat/completions",
                    data=body,
                    headers={"Authorization": f"Bearer {a}", "Content-Type": "application/json"},
                )
            )
            during = []
            while not sent.done():
                during.append(await timed_b())
            status = (await sent).status
            tick.cancel()
            return {
                "b_baseline_p50_s": round(statistics.median(baseline), 4),
                "b_max_s": round(max(during), 4),
                "loop_max_lag_s": round(max(lags), 4),
                "a_status": status,
            }
        finally:
            gateway.request_body.load_json = original
            await client.close()


async def main() -> None:
    print(f"load average {os.getloadavg()}")
    table = await parse_table()
    before = await stall(legacy_load_json)
    after = await stall(load_json)
    print(f"while A posts 1.3 M empty lists (3.9 MB): main {before}")
    print(f"                                          now  {after}")
    print(
        json.dumps(
            {
                "parse": table,
                "stall_main": before,
                "stall_now": after,
                "b_max_ratio_main_to_now": round(before["b_max_s"] / after["b_max_s"], 1),
                "loadavg": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
