from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from gateway.routing import (
    ROUTERS,
    LeastLoadedRouter,
    RendezvousRouter,
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
