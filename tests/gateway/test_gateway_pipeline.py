"""Namespace segments come from the authenticated tenant's policy only, and reach the worker payload."""

import aiohttp

from gateway.pipeline import PreparedRequest, RequestPipeline
from gateway.routing import RendezvousRouter
from gateway.schemas import SamplingParams
from gateway.workers import WorkerPool
from policies.isolation import (
    GLOBAL_NAMESPACE_ID,
    PROMOTED_NAMESPACE_ID,
    tenant_namespace_id,
    tenant_namespace_key,
)
from tenancy.policy import TenantPolicy

SALT = b"test-salt"


async def pipeline() -> tuple[RequestPipeline, aiohttp.ClientSession]:
    session = aiohttp.ClientSession()
    pool = WorkerPool(("http://127.0.0.1:9",), session)
    return RequestPipeline(
        pool=pool, router=RendezvousRouter(), salt=SALT, default_max_tokens=16, affinity_blocks=4
    ), session


async def test_segments_per_isolation_level():
    pipe, session = await pipeline()
    namespace = pipe.segments(TenantPolicy(tenant_id="tn_a", name="a", reserved_blocks=9))
    assert len(namespace) == 1 and namespace[0].reserved_blocks == 0  # quotas are for dedicated only
    assert namespace[0].namespace_id == tenant_namespace_id(SALT, "tn_a")
    assert namespace[0].key == tenant_namespace_key(SALT, "tn_a", 0)

    bumped = pipe.segments(TenantPolicy(tenant_id="tn_a", name="a", epoch=1))
    assert bumped[0].key != namespace[0].key and bumped[0].namespace_id == namespace[0].namespace_id

    other = pipe.segments(TenantPolicy(tenant_id="tn_b", name="b"))
    assert other[0].key != namespace[0].key

    dedicated = pipe.segments(
        TenantPolicy(tenant_id="tn_d", name="d", isolation="dedicated", reserved_blocks=9),
        promoted_prefix_tokens=64,
    )
    assert len(dedicated) == 1 and dedicated[0].reserved_blocks == 9  # never reads promoted prefixes

    shared = [
        pipe.segments(TenantPolicy(tenant_id=t, name=t, isolation="shared"), promoted_prefix_tokens=64)
        for t in ("x", "y")
    ]
    assert shared[0] == shared[1] and shared[0][1].namespace_id == GLOBAL_NAMESPACE_ID
    assert [s.namespace_id for s in shared[0]] == [PROMOTED_NAMESPACE_ID, GLOBAL_NAMESPACE_ID]

    promoted = pipe.segments(TenantPolicy(tenant_id="tn_a", name="a"), promoted_prefix_tokens=64)
    assert [(s.start_token, s.namespace_id) for s in promoted] == [
        (0, PROMOTED_NAMESPACE_ID),
        (64, tenant_namespace_id(SALT, "tn_a")),
    ]
    assert promoted[1].key == namespace[0].key
    await session.close()


async def test_worker_payload_carries_segments_and_sampling():
    pipe, session = await pipeline()
    tenant = TenantPolicy(tenant_id="tn_d", name="d", isolation="dedicated", reserved_blocks=5)
    sampling = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop=("\n",), ignore_eos=False
    )
    prepared = PreparedRequest(
        request_id="chatcmpl-1",
        endpoint="chat.completions",
        tenant=tenant,
        model=None,
        prompt_token_ids=[1, 2, 3],
        segments=pipe.segments(tenant),
        sampling=sampling,
        stream=True,
        include_usage=True,
        worker_url="http://127.0.0.1:9",
    )
    payload = prepared.worker_payload()
    assert payload["namespace"] == [
        {
            "start_token": 0,
            "namespace_id": tenant_namespace_id(SALT, "tn_d"),
            "key": tenant_namespace_key(SALT, "tn_d", 0).hex(),
            "reserved_blocks": 5,
        }
    ]
    assert payload["sampling"] == {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 3,
        "seed": 11,
        "stop": ["\n"],
        "stop_token_ids": [],
        "ignore_eos": False,
    }
    assert payload["stream"] is True and payload["cache"] is True and payload["request_id"] == "chatcmpl-1"
    await session.close()


async def test_worker_payload_names_the_tenant_apart_from_the_namespace():
    """Every ``shared`` tenant hashes in the one global namespace: the worker's prefetch lanes and budget
    shares were per namespace, so one shared tenant's burst queued the others. The payload now names the
    tenant (its opaque tag, never the tenant id) for the worker to queue by."""
    pipe, session = await pipeline()
    payloads = []
    for tenant_id in ("tn_x", "tn_y"):
        tenant = TenantPolicy(tenant_id=tenant_id, name=tenant_id, isolation="shared")
        prepared = PreparedRequest(
            request_id="chatcmpl-1",
            endpoint="chat.completions",
            tenant=tenant,
            model=None,
            prompt_token_ids=[1, 2, 3],
            segments=pipe.segments(tenant),
            sampling=SamplingParams(
                max_tokens=7, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=(), ignore_eos=False
            ),
            stream=False,
            include_usage=False,
            worker_url="http://127.0.0.1:9",
            owner=pipe.owner(tenant),
        )
        payloads.append(prepared.worker_payload())
    assert payloads[0]["namespace"] == payloads[1]["namespace"]  # the same data namespace
    assert [p["owner"] for p in payloads] == [tenant_namespace_id(SALT, t) for t in ("tn_x", "tn_y")]
    assert all("tn_" not in p["owner"] for p in payloads)
    await session.close()
