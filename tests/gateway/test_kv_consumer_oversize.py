"""A worker whose ``GET /v1/kv_events`` answer is huge (broken or hostile) must not make the gateway
buffer it: the answer is read up to ``kv_events_max_bytes`` and refused past it like a malformed batch
(logged, counted in ``prefixgate_kv_event_batches_refused_total``, the worker dropped from the routing
index and read again from its first event), and the consumer's task goes on.

The worker is a fake HTTP server, labelled as such: a real worker's answers are capped by ``max_events``.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.kv_consumer import KVEventConsumer
from gateway.kv_index import PrefixIndex
from gateway.metrics import GatewayMetrics
from gateway.workers import WorkerPool

CAP_BYTES = 1 << 20
HUGE_BYTES = 64 << 20
GOOD = {
    "worker_id": "w",
    "last_seq": 1,
    "reset": False,
    "load": {},
    "events": [
        {
            "seq": 1,
            "type": "BlockStored",
            "medium": "L1",
            "block_hashes": ["aa" * 16],
            "parent_block_hash": None,
            "namespace_id": "ns",
        }
    ],
}


class HugeAnswerWorker:
    """Answers its second poll with a valid batch padded to ``HUGE_BYTES`` (declared in Content-Length,
    or chunked without one), every other poll with a small good batch; counts the bytes it got out."""

    def __init__(self, *, declared: bool) -> None:
        self.declared, self.calls, self.huge_bytes_sent = declared, 0, 0
        self.huge_done = asyncio.Event()

    async def kv_events(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        if self.calls != 2:
            return web.json_response(GOOD)
        head = orjson.dumps(GOOD)[:-1] + b', "pad": "'
        chunk = b"x" * (256 << 10)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        if self.declared:
            response.content_length = HUGE_BYTES + len(head) + 2
        try:
            await response.prepare(request)
            await response.write(head)
            while self.huge_bytes_sent < HUGE_BYTES:
                await response.write(chunk)
                self.huge_bytes_sent += len(chunk)
            await response.write(b'"}')
            await response.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the gateway hung up: what it wanted
        finally:
            self.huge_done.set()
        return response


@pytest.mark.timeout(60)
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_a_huge_kv_events_answer_is_refused_without_buffering_it(aiohttp_server, declared):
    worker = HugeAnswerWorker(declared=declared)
    app = web.Application()
    app.router.add_get("/v1/kv_events", worker.kv_events)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    metrics = GatewayMetrics()
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        pool = WorkerPool((url,), session, kv_events_max_bytes=CAP_BYTES)
        index = PrefixIndex()
        consumer = KVEventConsumer(pool, index, wait_ms=10, retry_s=0.01, metrics=metrics)
        consumer.start()
        try:
            await asyncio.wait_for(worker.huge_done.wait(), 30)
            while worker.calls < 5:  # polled again after the huge answer: the task is alive
                assert not consumer._tasks[0].done(), consumer._tasks[0]
                await asyncio.sleep(0.01)
            assert url in index.workers  # read again from the good batches that followed
        finally:
            await consumer.close()
    refused = metrics.registry.get_sample_value(
        "prefixgate_kv_event_batches_refused_total", {"reason": "too_large"}
    )
    assert refused == 1
    # Read up to the cap, then hung up: the server got out a few socket buffers past it at most.
    assert worker.huge_bytes_sent < 16 * CAP_BYTES, worker.huge_bytes_sent
