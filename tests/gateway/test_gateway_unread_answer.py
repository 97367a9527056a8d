"""A non-streamed answer that its client does not read is cut too (review r8 #2).

aiohttp wrote a handler's ``web.Response`` after the handler returned: its admission slots were given
back and its call recorded while the answer still sat in the gateway's memory, for as long as the
client kept the socket open. A tenant limited to 1 concurrent request could hold any number of 16 MiB
answers at once. The answer is now written inside the handler under ``stream_write_timeout_s``: one
nobody reads holds its slot until it is cut, the connection is aborted (nothing held), and the call is
recorded as the client's cancellation (499), billed whole (docs/api.md).
"""

from __future__ import annotations

import logging

from aiohttp import web

from gateway.state import ADMISSION
from tenancy.usage_types import OUTCOME_CLIENT_CANCELLED, OUTCOME_COMPLETED
from tests.gateway.conftest import create_tenant
from tests.gateway.test_gateway_billing import wait_records
from tests.gateway.test_gateway_stalled_stream import BOUND_S, silent_client, wait_for
from tests.gateway.test_gateway_upstream_openai import PUBLIC_MODEL, front_app, messages

WRITE_TIMEOUT_S = 1.0
ANSWER_BYTES = 16 << 20  # beyond what the kernel's socket buffers take
USAGE = {"prompt_tokens": 5, "completion_tokens": 100, "total_tokens": 105}


def big_answer_upstream() -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        message = {"role": "assistant", "content": "x" * ANSWER_BYTES}
        choice = {"index": 0, "finish_reason": "stop", "message": message}
        answer = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "usage": USAGE}
        return web.json_response({**answer, "choices": [choice]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def bytes_held(front) -> int:
    connections = front.server.runner.server.connections
    return sum(c.transport.get_write_buffer_size() for c in connections if c.transport is not None)


async def test_an_unread_non_streamed_answer_is_cut_and_holds_nothing(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path, caplog
):
    server = await aiohttp_server(big_answer_upstream())
    url = str(server.make_url("/v1"))
    app = front_app(
        sqlite_template, tmp_path / "front", url, api_key="k", stream_write_timeout_s=WRITE_TIMEOUT_S
    )
    front = await aiohttp_client(app)
    tenant = await create_tenant(front, max_concurrent_requests=1)
    headers = {"Authorization": f"Bearer {tenant['api_key']}"}
    body = {"model": PUBLIC_MODEL, "messages": messages("x")}
    gate = front.app[ADMISSION]
    async with silent_client(front, "/v1/chat/completions", tenant["api_key"], body):
        assert await wait_for(lambda: bytes_held(front) > 0, 20.0)  # the answer is being written
        async with front.post("/v1/chat/completions", json=body, headers=headers) as second:
            assert second.status == 429  # its slot is held while it is written: one such answer at once
        rows = await wait_records(front, 2, BOUND_S)
        assert await wait_for(lambda: bytes_held(front) == 0), f"{bytes_held(front)} bytes still held"
        assert tenant["id"] not in gate.tenant_to_in_flight
    cut = [row for row in rows if row.status != 429]
    assert [(row.status, row.outcome) for row in cut] == [(499, OUTCOME_CLIENT_CANCELLED)]
    assert (cut[0].prompt_tokens, cut[0].completion_tokens) == (5, 100)  # generated and sent: billed whole
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]  # not a server error
    async with front.post("/v1/chat/completions", json=body, headers=headers) as reader:  # one that reads
        answer = await reader.json()
    assert len(answer["choices"][0]["message"]["content"]) == ANSWER_BYTES
    rows = await wait_records(front, 3)
    assert [(row.status, row.outcome) for row in rows[2:]] == [(200, OUTCOME_COMPLETED)]
