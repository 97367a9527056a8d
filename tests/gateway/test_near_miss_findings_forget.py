"""A near-miss finding recorded in the background after its tenant was forgotten stays out.

A finding is written by a background task (Redis stays off the request's path). Before, one found by a
request prepared before a purge could land after ``forget_tenant``: on the replica that forgot (its
task ran after the forget had cleared the replica's copy) and in Redis from another replica that had
not seen the new epoch yet (its write landed after the forget's delete), and the purged tenant's
prompts were listed again. Now the write carries the epoch its request was prepared at: the replica
checks it when the task runs, and Redis checks it atomically against the epoch the forget left behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid

from gateway.embedding import PromptEmbedder
from gateway.near_miss import NearMissRouting
from gateway.near_miss_findings import RedisFindings
from tests.gateway.test_gateway_model import runtime  # noqa: F401 - fixture
from tests.gateway.test_gateway_routing_redis import redis_url  # noqa: F401 - fixture
from tests.gateway.test_near_miss_routing_decisions import BLOCK, SEGMENTS, TENANT, URLS, request


async def settle(routing: NearMissRouting) -> None:
    """Every background task of ``routing`` has run (a finding's write among them)."""
    while routing._background:
        await asyncio.gather(*routing._background)


async def found(routing: NearMissRouting, runtime, seed: int, tenant=TENANT) -> None:  # noqa: F811
    """Two prompts of ``tenant`` parting at a token of their own (``seed``): the second leaves a
    finding in the background (one per position is kept)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 200) for _ in range(3 * BLOCK + seed)]
    first, second = ([*shared, *(rng.randrange(1, 200) for _ in range(4 * BLOCK))] for _ in range(2))
    await routing.route(tenant, runtime, first, SEGMENTS, request(), URLS[0])
    await routing.route(tenant, runtime, second, SEGMENTS, request(), URLS[0])


async def test_a_finding_written_after_the_forget_on_this_replica_stays_out(runtime):  # noqa: F811
    routing = NearMissRouting(embedder=PromptEmbedder(), max_wait_s=0.0)
    try:
        await found(routing, runtime, 11)
        await settle(routing)
        assert len(await routing.findings(TENANT.tenant_id)) == 1  # the finding, as ever
        await routing.forget_tenant(TENANT.tenant_id, epoch=TENANT.epoch + 1)
        await found(routing, runtime, 12)  # prepared before the purge (old epoch): nothing is kept
        assert await routing.findings(TENANT.tenant_id) == []
        # The race: the finding's task is spawned, then the purge runs before the task does.
        routing = NearMissRouting(embedder=routing.embedder, max_wait_s=0.0)
        await found(routing, runtime, 13)
        await routing.forget_tenant(TENANT.tenant_id, epoch=TENANT.epoch + 1)
        await settle(routing)
        assert await routing.findings(TENANT.tenant_id) == []
    finally:
        routing.embedder.close()


async def test_a_finding_another_replica_writes_after_the_forget_stays_out_of_redis(
    runtime,  # noqa: F811
    redis_url,  # noqa: F811
):
    prefix = f"test-nm-{uuid.uuid4().hex}"
    embedder = PromptEmbedder()
    a = NearMissRouting(
        embedder=embedder, findings=RedisFindings(redis_url, salt=b"s", key_prefix=prefix), max_wait_s=0.0
    )
    b = NearMissRouting(
        embedder=embedder, findings=RedisFindings(redis_url, salt=b"s", key_prefix=prefix), max_wait_s=0.0
    )
    try:
        await found(b, runtime, 21)
        await settle(b)
        assert len(await a.findings(TENANT.tenant_id)) == 1  # shared through Redis
        await a.forget_tenant(TENANT.tenant_id, epoch=TENANT.epoch + 1)  # the admin purged through a
        assert await a.findings(TENANT.tenant_id) == []
        # b has not seen the new epoch yet: a request it prepared before the purge finds a new span.
        await found(b, runtime, 22)
        await settle(b)
        assert await a.findings(TENANT.tenant_id) == []
        # A request at the new epoch is remembered as ever.
        fresh = NearMissRouting(
            embedder=embedder, findings=RedisFindings(redis_url, salt=b"s", key_prefix=prefix), max_wait_s=0.0
        )
        tenant = dataclasses.replace(TENANT, epoch=TENANT.epoch + 1)
        await found(fresh, runtime, 23, tenant)
        await settle(fresh)
        assert len(await a.findings(TENANT.tenant_id)) == 1
        await fresh._findings.close()
    finally:
        await a._findings.close()
        await b._findings.close()
        embedder.close()
