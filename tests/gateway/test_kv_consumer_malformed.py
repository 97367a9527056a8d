"""A worker that sends one malformed KV-event batch (broken or hostile) must neither end the consumer's
task for that worker nor leave its stale blocks in the routing index: the batch is refused, the worker
dropped from the index, and polling goes on (it then re-reads the worker from its first event).

The worker here is a scripted client, labelled as such: a real worker never sends these shapes."""

from __future__ import annotations

import asyncio

import pytest

from gateway.kv_consumer import KVEventConsumer
from gateway.kv_index import PrefixIndex

URL = "http://worker-1"
STORED = {"seq": 1, "type": "BlockStored", "medium": "L1", "block_hashes": ["aa" * 16], "namespace_id": "ns"}
GOOD = {
    "worker_id": "w",
    "last_seq": 1,
    "reset": False,
    "load": {},
    "events": [{**STORED, "parent_block_hash": None}],
}
MALFORMED = {
    "bad_hex": {**GOOD, "last_seq": 2, "events": [{**STORED, "seq": 2, "block_hashes": ["zz"]}]},
    "events_null": {**GOOD, "events": None},
    "load_string": {**GOOD, "events": [], "load": "x"},
    "missing_type": {**GOOD, "last_seq": 2, "events": [{"seq": 2, "medium": "L1"}]},
    "remote_tier_string": {**GOOD, "events": [], "remote_tier": "abc"},
    "not_an_object": ["garbage"],
}


class ScriptedWorker:
    """``kv_events`` answers from a script: one good batch, one malformed, then good ones again."""

    def __init__(self, bad: object) -> None:
        self.answers, self.calls = [GOOD, bad], 0
        self.bad_served = asyncio.Event()

    async def kv_events(self, *, since: int, wait_ms: int, snapshot: str | None = None) -> object:
        self.calls += 1
        if self.calls == 2:
            self.bad_served.set()
        await asyncio.sleep(0.005)
        return self.answers[self.calls - 1] if self.calls <= len(self.answers) else GOOD


class Pool:
    def __init__(self, worker: ScriptedWorker) -> None:
        self.workers, self._worker = {URL: None}, worker

    def client(self, url: str) -> ScriptedWorker:
        return self._worker


@pytest.mark.parametrize("shape", list(MALFORMED))
async def test_a_malformed_batch_drops_the_worker_and_polling_goes_on(shape):
    index = PrefixIndex()
    worker = ScriptedWorker(MALFORMED[shape])
    consumer = KVEventConsumer(Pool(worker), index, wait_ms=10, retry_s=0.01)
    consumer.start()
    try:
        await asyncio.wait_for(worker.bad_served.wait(), 30)
        while worker.calls < 5:  # polled again after the bad batch: the task is alive
            assert not consumer._tasks[0].done(), consumer._tasks[0]
            await asyncio.sleep(0.01)
        assert consumer.num_malformed_batches == 1
        assert URL in index.workers  # re-read from the good batches that followed
    finally:
        await consumer.close()
