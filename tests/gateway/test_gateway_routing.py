from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from gateway.kv_index import PrefixIndex
from gateway.routing import (
    ROUTERS,
    KVAwareRouter,
    LeastLoadedRouter,
    RandomRouter,
    RendezvousRouter,
    RoundRobinRouter,
    RouteRequest,
    WorkerLoad,
    cache_key_affinity,
)

URLS = [f"http://w{i}:8081" for i in range(4)]


def loads(*in_flight: int) -> list[WorkerLoad]:
    return [WorkerLoad(url=url, in_flight=n) for url, n in zip(URLS, in_flight, strict=False)]


def test_registry_builds_routers():
    assert isinstance(ROUTERS["rendezvous"](), RendezvousRouter)
    assert isinstance(ROUTERS["least_loaded"](), LeastLoadedRouter)


@given(st.binary(min_size=8, max_size=32))
def test_same_key_same_worker_and_minimal_disruption(key: bytes):
    router = RendezvousRouter()
    four = router.choose(RouteRequest(affinity_key=key, candidates=loads(0, 0, 0, 0)))
    assert four == router.choose(RouteRequest(affinity_key=key, candidates=list(reversed(loads(0, 0, 0, 0)))))
    three = router.choose(RouteRequest(affinity_key=key, candidates=loads(0, 0, 0)))
    if four != URLS[3]:
        assert three == four  # removing w3 only moves the keys w3 owned


def test_keys_spread_over_workers():
    router = RendezvousRouter()
    counts = Counter(
        router.choose(RouteRequest(affinity_key=i.to_bytes(4, "little"), candidates=loads(0, 0, 0, 0)))
        for i in range(4000)
    )
    assert set(counts) == set(URLS) and min(counts.values()) > 800


def test_load_bound_and_no_affinity():
    router = RendezvousRouter(max_load_factor=1.5, load_slack=0)
    key = b"k" * 16
    preferred = router.choose(RouteRequest(affinity_key=key, candidates=loads(0, 0, 0, 0)))
    overloaded = [WorkerLoad(url=w.url, in_flight=40 if w.url == preferred else 2) for w in loads(0, 0, 0, 0)]
    assert router.choose(RouteRequest(affinity_key=key, candidates=overloaded)) != preferred
    assert router.choose(RouteRequest(affinity_key=None, candidates=loads(3, 1, 2, 5))) == URLS[1]


def test_cache_key_affinity_is_namespaced():
    assert cache_key_affinity(b"a" * 32, "conv-1") != cache_key_affinity(b"b" * 32, "conv-1")
    assert cache_key_affinity(b"a" * 32, "conv-1") == cache_key_affinity(b"a" * 32, "conv-1")


# --- KV-aware routing and the KV-event prefix index ------------------------------------------------


def stored(seq: int, block: bytes, ns: str, medium: str = "L1") -> dict:
    return {
        "seq": seq,
        "type": "BlockStored",
        "medium": medium,
        "block_hashes": [block.hex()],
        "namespace_id": ns,
    }


def test_index_matches_the_longest_prefix_within_the_namespace_and_by_tier():
    index = PrefixIndex()
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    events = [stored(1, a, "t-1"), stored(2, b, "t-1", "L2"), stored(3, c, "t-2")]
    index.apply(URLS[0], {"worker_id": "w0", "last_seq": 3, "events": events, "load": {"num_running": 2}})
    found = index.match(URLS[0], [a, b, c], ["t-1", "t-1", "t-1"])
    assert (found.num_blocks, found.weighted_blocks) == (2, 1.8)  # c is another namespace's block
    assert index.match(URLS[1], [a], ["t-1"]).num_blocks == 0
    removed = {"seq": 4, "type": "BlockRemoved", "medium": "L1", "block_hashes": [a.hex()]}
    index.apply(URLS[0], {"worker_id": "w0", "last_seq": 4, "events": [removed]})
    assert index.match(URLS[0], [a, b], ["t-1", "t-1"]).num_blocks == 0 and index.position(URLS[0]) == (
        "w0",
        4,
    )
    index.apply(URLS[0], {"worker_id": "w0-restarted", "last_seq": 1, "events": [stored(1, b, "t-1")]})
    assert index.match(URLS[0], [b], ["t-1"]).weighted_blocks == 1.0  # the old process's state is gone
    index.drop(URLS[0])
    assert index.position(URLS[0]) == (None, 0)


def test_kv_aware_prefers_the_cached_prefix_until_load_outweighs_it():
    router = KVAwareRouter(running_cost_tokens=64)
    cold = loads(0, 0, 0)
    request = RouteRequest(affinity_key=b"k" * 16, candidates=cold, num_prompt_tokens=512, block_size=16)
    assert router.choose(request) == RendezvousRouter().choose(request)  # nothing cached: consistent hash
    warm = [
        WorkerLoad(
            url=w.url,
            in_flight=0,
            cached_blocks=20 if w.url == URLS[2] else 0,
            cached_weighted_blocks=20.0 if w.url == URLS[2] else 0.0,
        )
        for w in cold
    ]
    assert router.choose(RouteRequest(affinity_key=None, candidates=warm, num_prompt_tokens=512)) == URLS[2]
    busy = [
        w
        if w.url != URLS[2]
        else WorkerLoad(
            url=w.url, in_flight=0, cached_blocks=20, cached_weighted_blocks=20.0, queued_prefill_tokens=4000
        )
        for w in warm
    ]
    assert router.choose(RouteRequest(affinity_key=None, candidates=busy, num_prompt_tokens=512)) != URLS[2]


def test_baseline_routers_spread_requests():
    request = RouteRequest(affinity_key=None, candidates=loads(0, 0, 0, 0))
    robin = RoundRobinRouter()
    assert [robin.choose(request) for _ in range(8)] == sorted(URLS) * 2
    assert len({RandomRouter().choose(request) for _ in range(200)}) == 4
    assert isinstance(ROUTERS["kv_aware"](), KVAwareRouter)


def test_index_clears_a_tier_and_resets_when_the_worker_says_so():
    index = PrefixIndex()
    a, b = b"a" * 32, b"b" * 32
    events = [stored(1, a, "t-1"), stored(2, a, "t-1", "L2"), stored(3, b, "t-1")]
    index.apply(URLS[0], {"worker_id": "w0", "last_seq": 3, "events": events})
    cleared = {"seq": 4, "type": "AllBlocksCleared", "medium": "L1"}
    index.apply(URLS[0], {"worker_id": "w0", "last_seq": 4, "events": [cleared]})
    found = index.match(URLS[0], [a, b], ["t-1", "t-1"])
    assert (found.num_blocks, found.weighted_blocks) == (1, 0.8)  # a survives in L2, b is gone
    index.apply(URLS[0], {"worker_id": "w0", "last_seq": 9, "reset": True, "events": []})
    assert index.match(URLS[0], [a], ["t-1"]).num_blocks == 0 and index.position(URLS[0]) == ("w0", 9)
