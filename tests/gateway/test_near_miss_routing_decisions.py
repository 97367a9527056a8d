"""Near-miss routing decisions on their own (no servers): what is credited, what is embedded, what waits.

The embedder is real; these decisions must not need it (nothing here loads the model)."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from gateway.embedding import EMBEDDING_DIM, PromptEmbedder
from gateway.metrics import GatewayMetrics
from gateway.near_miss import NearMissRouting
from gateway.routing import RouteRequest, WorkerLoad
from policies.hashing import NamespaceKey, NamespaceSegment
from policies.isolation import global_namespace_key
from tenancy.policy import TenantPolicy
from tests.gateway.test_gateway_model import runtime  # noqa: F401 - fixture

BLOCK = 16
URLS = ("http://w1", "http://w2", "http://w3")
TENANT = TenantPolicy(tenant_id="tn_a", name="a", near_miss_routing=True)
SEGMENTS = (NamespaceSegment(start_token=0, namespace_id="ns_a", key=NamespaceKey(b"k" * 32)),)


def request(cached_blocks: dict[str, int] | None = None, in_flight: dict[str, int] | None = None):
    cached, busy = cached_blocks or {}, in_flight or {}
    candidates = [
        WorkerLoad(
            url=url,
            in_flight=busy.get(url, 0),
            cached_blocks=cached.get(url, 0),
            cached_weighted_blocks=float(cached.get(url, 0)),
        )
        for url in URLS
    ]
    return RouteRequest(affinity_key=b"x", candidates=candidates, num_prompt_tokens=160, block_size=BLOCK)


@pytest.fixture
def near_miss():
    metrics = GatewayMetrics()
    routing = NearMissRouting(embedder=PromptEmbedder(), metrics=metrics, max_wait_s=0.0)
    yield routing
    routing.embedder.close()


def moves(routing: NearMissRouting) -> float:
    return routing._metrics.registry.get_sample_value(
        "prefixgate_near_miss_routes_total", {"outcome": "moved"}
    )


def prompt_pair(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 200) for _ in range(6 * BLOCK)]
    return (
        shared + [rng.randrange(1, 200) for _ in range(4 * BLOCK)],
        shared + [rng.randrange(1, 200) for _ in range(4 * BLOCK)],
    )


async def test_a_near_miss_the_exact_route_agrees_with_is_not_credited(near_miss, runtime):  # noqa: F811
    first, second = prompt_pair(1)
    await near_miss.route(TENANT, runtime, first, SEGMENTS, request(), URLS[0])
    # The burst's second prompt: the exact index knows nothing yet, and its route is the first's worker
    # anyway (the router remembered the placement). Near miss changed nothing: no move, no credit.
    routed = await near_miss.route(TENANT, runtime, second, SEGMENTS, request(), URLS[0])
    assert routed.worker_url == URLS[0]
    assert routed.exact_tokens is None  # usage.prefixgate.near_miss_tokens stays 0
    assert not moves(near_miss)
    # Sent elsewhere by the exact route, the same prompt is moved to the first's worker and credited.
    third = first[: 6 * BLOCK] + second[6 * BLOCK :][::-1]
    routed = await near_miss.route(TENANT, runtime, third, SEGMENTS, request(), URLS[1])
    assert routed.worker_url == URLS[0] and routed.exact_tokens == 0 and moves(near_miss) == 1


async def test_no_request_waits_for_an_embedding_without_a_bound(near_miss, runtime):  # noqa: F811
    # The default: no wait bound. Even with remembered vectors to search, a request whose head is not
    # embedded yet is routed at once, and nothing is embedded for it.
    first, second = prompt_pair(2)
    await near_miss.route(TENANT, runtime, first, SEGMENTS, request(), URLS[0])
    near_miss._add(runtime.model_id, near_miss._recent_of(runtime.model_id, SEGMENTS)[0], _unit())
    assert near_miss._searchable(runtime.model_id, SEGMENTS)  # FAISS has something to search
    unrelated = [t + 1 for t in second]  # shares nothing with the first: the token check finds nothing
    routed = await near_miss.route(TENANT, runtime, unrelated, SEGMENTS, request(), URLS[2])
    assert routed.worker_url == URLS[2]
    registry = near_miss._metrics.registry
    assert not registry.get_sample_value("prefixgate_near_miss_embed_seconds_count")  # never waited
    assert not registry.get_sample_value("prefixgate_near_miss_routes_total", {"outcome": "late"})
    assert near_miss.embedder.pending == 0 and not near_miss._background


async def test_a_prompt_the_exact_index_covers_is_not_embedded(runtime):  # noqa: F811
    routing = NearMissRouting(embedder=PromptEmbedder(), max_wait_s=0.015)  # FAISS on
    first, _ = prompt_pair(3)
    # The exact index holds 6 blocks of it on w2: it needs no near miss, and nor does any later prompt
    # that shares those blocks (the exact index finds them too), so no embedding is spent on it.
    covered = request(cached_blocks={URLS[1]: 6})
    await routing.route(TENANT, runtime, first, SEGMENTS, covered, URLS[1])
    assert not routing._background  # no background embedding was queued
    assert len(routing._recent_of(runtime.model_id, SEGMENTS)) == 1  # still among the latest (findings)
    await routing.close()


async def test_a_request_prepared_before_its_tenants_purge_leaves_nothing_behind(near_miss, runtime):  # noqa: F811
    first, second = prompt_pair(4)
    await near_miss.route(TENANT, runtime, first, SEGMENTS, request(), URLS[0])
    await near_miss.forget_tenant(TENANT.tenant_id)
    assert near_miss._recent_of(runtime.model_id, SEGMENTS) == []
    # Still in flight with the old policy (old epoch, old key) when the purge came: routed exactly,
    # remembered nowhere, no finding.
    routed = await near_miss.route(TENANT, runtime, second, SEGMENTS, request(), URLS[1])
    assert routed.worker_url == URLS[1] and routed.exact_tokens is None
    assert near_miss._recent_of(runtime.model_id, SEGMENTS) == []
    assert await near_miss.findings(TENANT.tenant_id) == []


def _unit():
    import numpy as np

    from gateway.embedding import EMBEDDING_DIM

    vector = np.ones(EMBEDDING_DIM, dtype=np.float32)
    return vector / np.linalg.norm(vector)


class GatedEmbedder:
    """Stands in for the embedder only to hold a request inside its embedding wait (a timing no real
    model gives on demand): urgent embeddings wait for ``gate``."""

    def __init__(self) -> None:
        self.gate, self.entered = asyncio.Event(), asyncio.Event()
        self.gate.set()

    def cached(self, head: str, *, tenant: str = "") -> None:
        return None

    def at_hand(self, head: str, *, tenant: str = "") -> None:
        return None

    async def embed(self, head: str, *, urgent: bool = True, tenant: str = "") -> np.ndarray:
        if urgent:
            self.entered.set()
            await self.gate.wait()
        return np.full(EMBEDDING_DIM, 1 / np.sqrt(EMBEDDING_DIM), dtype=np.float32)

    def close(self) -> None:
        return None


async def test_a_tenant_purged_while_its_request_awaits_an_embedding_is_not_remembered_again(runtime):  # noqa: F811
    """The purge check ran only before the embedding wait: the request then put its prompt back into the
    latest prompts and a finding holding the purged prompt's text into the tenant's findings."""
    embedder = GatedEmbedder()
    routing = NearMissRouting(embedder=embedder, max_wait_s=5.0)  # type: ignore[arg-type]
    first = list(range(1, 97))
    second = list(range(1, 17)) + list(range(500, 580))
    await routing.route(TENANT, runtime, first, SEGMENTS, request(), URLS[0])
    while not routing.num_remembered(TENANT.tenant_id):
        await asyncio.sleep(0.01)
    embedder.gate.clear()
    waiting = asyncio.create_task(routing.route(TENANT, runtime, second, SEGMENTS, request(), URLS[0]))
    await asyncio.wait_for(embedder.entered.wait(), 30)
    await routing.forget_tenant(TENANT.tenant_id)  # the admin purges while the request waits
    embedder.gate.set()
    assert (await asyncio.wait_for(waiting, 30)).worker_url == URLS[0]
    await asyncio.sleep(0.05)  # any background remembering
    assert routing.num_remembered(TENANT.tenant_id) == 0
    assert not routing._recent and not routing._keys_of and await routing.findings(TENANT.tenant_id) == []
    await routing.close()


SHARED_SEGMENTS = (
    NamespaceSegment(start_token=0, namespace_id="global", key=global_namespace_key(b"test-salt")),
)
ALICE = TenantPolicy(tenant_id="tn_alice", name="alice", isolation="shared", near_miss_routing=True)
BOB = TenantPolicy(tenant_id="tn_bob", name="bob", isolation="shared", near_miss_routing=True)


async def test_a_shared_tenants_findings_never_hold_another_shared_tenants_prompt(near_miss, runtime):  # noqa: F811
    """Every `shared` tenant's key is the global one: findings matched nominees by key, so bob's finding
    held alice's next 12 tokens, decoded. Routing may still use her prompt; findings may not."""
    alices, bobs = prompt_pair(5)
    await near_miss.route(ALICE, runtime, alices, SHARED_SEGMENTS, request(), URLS[0])
    await near_miss.route(BOB, runtime, bobs, SHARED_SEGMENTS, request(), URLS[1])
    await asyncio.sleep(0)  # the findings store records in a task
    assert await near_miss.findings(BOB.tenant_id) == []
    # Bob's own near miss is still found (against his own earlier prompt only).
    again = bobs[: 6 * BLOCK] + [t + 1 for t in bobs[6 * BLOCK :]]
    await near_miss.route(BOB, runtime, again, SHARED_SEGMENTS, request(), URLS[2])
    await asyncio.sleep(0)
    findings = await near_miss.findings(BOB.tenant_id)
    assert [f["other"] for f in findings] == [runtime.decode(bobs[6 * BLOCK : 6 * BLOCK + 12])]
    assert await near_miss.findings(ALICE.tenant_id) == []


async def test_a_deleted_shared_tenants_prompts_are_forgotten_from_the_global_key(near_miss, runtime):  # noqa: F811
    alices, bobs = prompt_pair(6)
    await near_miss.route(ALICE, runtime, alices, SHARED_SEGMENTS, request(), URLS[0])
    await near_miss.route(BOB, runtime, bobs, SHARED_SEGMENTS, request(), URLS[1])
    for entry in near_miss._recent_of(runtime.model_id, SHARED_SEGMENTS):
        near_miss._add(runtime.model_id, entry, _unit())
    assert near_miss.num_remembered(ALICE.tenant_id) == 1 and near_miss.num_remembered() == 2
    await near_miss.forget_tenant(ALICE.tenant_id)  # the admin deletes alice
    remaining = near_miss._recent_of(runtime.model_id, SHARED_SEGMENTS)
    assert [entry.token_ids.tolist() for entry in remaining] == [bobs]
    assert near_miss.num_remembered(ALICE.tenant_id) == 0 and near_miss.num_remembered() == 1
    # The global key itself is never forgotten: bob (and alice, were she re-created) are remembered still.
    await near_miss.route(BOB, runtime, alices, SHARED_SEGMENTS, request(), URLS[2])
    assert len(near_miss._recent_of(runtime.model_id, SHARED_SEGMENTS)) == 2


def _num_held(routing: NearMissRouting) -> int:
    """Entries in every container the routing keeps (its bookkeeping, whatever its names)."""
    return sum(len(value) for value in vars(routing).values() if isinstance(value, dict | set | list))


def _segments_at(epoch: int) -> tuple[NamespaceSegment, ...]:
    key = NamespaceKey(epoch.to_bytes(4, "little") * 8)  # a tenant's key changes with its epoch
    return (NamespaceSegment(start_token=0, namespace_id=f"ns_a{epoch}", key=key),)


async def test_repeated_purges_leave_bounded_bookkeeping_and_late_requests_out(near_miss, runtime):  # noqa: F811
    """Main kept every purged key (``_forgotten``) for ever: 300 purges of one tenant, 300 keys. A key
    is now refused by its epoch (older than the tenant's newest), which is one number per tenant; a
    request prepared before a purge (older epoch) is still routed exactly and remembered nowhere."""
    first, second = prompt_pair(9)
    sizes = []
    for epoch in range(300):
        tenant = TenantPolicy(tenant_id="tn_a", name="a", near_miss_routing=True, epoch=epoch)
        await near_miss.route(tenant, runtime, first, _segments_at(epoch), request(), URLS[0])
        await near_miss.forget_tenant(tenant.tenant_id, epoch=epoch + 1)  # the admin's purge bumped it
        late = await near_miss.route(tenant, runtime, second, _segments_at(epoch), request(), URLS[1])
        assert late.worker_url == URLS[1] and late.exact_tokens is None
        assert near_miss._recent_of(runtime.model_id, _segments_at(epoch)) == []
        sizes.append(_num_held(near_miss))
    assert max(sizes) <= 8 and sizes[-1] == sizes[10], sizes[::30]
    # The newest epoch is remembered as ever.
    tenant = TenantPolicy(tenant_id="tn_a", name="a", near_miss_routing=True, epoch=300)
    await near_miss.route(tenant, runtime, first, _segments_at(300), request(), URLS[0])
    assert len(near_miss._recent_of(runtime.model_id, _segments_at(300))) == 1
    assert await near_miss.findings("tn_a") == []


class Policies:
    """The tenant policies in force, as ``tenancy.cache.PolicyCache`` answers them (a snapshot)."""

    def __init__(self, *tenants: TenantPolicy) -> None:
        self.by_id, self.ready = {tenant.tenant_id: tenant for tenant in tenants}, True

    def get(self, tenant_id: str) -> TenantPolicy | None:
        return self.by_id.get(tenant_id)


async def test_a_request_prepared_before_its_tenant_was_deleted_leaves_nothing_behind(runtime):  # noqa: F811
    """The sweep drops a deleted tenant's epoch (no per-deletion state): a request prepared before the
    deletion that arrives after it is refused by the policies in force instead."""
    policies = Policies(TENANT)
    routing = NearMissRouting(embedder=PromptEmbedder(), policies=policies, sweep_s=3600)
    first, second = prompt_pair(10)
    await routing.route(TENANT, runtime, first, SEGMENTS, request(), URLS[0])
    await routing.forget_tenant(TENANT.tenant_id, epoch=TENANT.epoch + 1)
    del policies.by_id[TENANT.tenant_id]  # then deleted
    routing.sweep()
    assert not routing._epoch_of and not routing._keys_of
    late = await routing.route(TENANT, runtime, second, SEGMENTS, request(), URLS[1])
    assert late.worker_url == URLS[1] and late.exact_tokens is None
    assert routing._recent_of(runtime.model_id, SEGMENTS) == [] and not routing._keys_of
    assert await routing.findings(TENANT.tenant_id) == []
    await routing.close()
