import math
from collections import Counter
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from gateway.kv_index import WRITE_PRESSURE_TAU_S, PrefixIndex
from gateway.routing import (
    ROUTERS,
    KVAwareRouter,
    LeastLoadedRouter,
    RandomRouter,
    RendezvousRouter,
    RoundRobinRouter,
    RouteRequest,
    WorkerLoad,
    _rank,
    cache_key_affinity,
)
from tests.gateway.test_gateway_refused_leader import held_router

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
    # A longer queue alone does not move it: a second copy of the prefix would cost cache room.
    queued = [
        w
        if w.url != URLS[2]
        else WorkerLoad(
            url=w.url, in_flight=2, cached_blocks=20, cached_weighted_blocks=20.0, queued_prefill_tokens=4000
        )
        for w in warm
    ]
    assert router.choose(RouteRequest(affinity_key=None, candidates=queued, num_prompt_tokens=512)) == URLS[2]
    # Over the rendezvous load bound (1.5 x mean in flight + 4), the cheapest worker takes it.
    busy = [
        w
        if w.url != URLS[2]
        else WorkerLoad(url=w.url, in_flight=20, cached_blocks=20, cached_weighted_blocks=20.0)
        for w in warm
    ]
    assert router.choose(RouteRequest(affinity_key=None, candidates=busy, num_prompt_tokens=512)) != URLS[2]


def test_kv_aware_places_a_cold_prefix_on_the_less_write_pressed_of_its_two_rendezvous_workers():
    key = b"cold-prefix-key!"
    first = RendezvousRouter().choose(RouteRequest(affinity_key=key, candidates=loads(0, 0, 0, 0)))
    second = RendezvousRouter().choose(
        RouteRequest(affinity_key=key, candidates=[w for w in loads(0, 0, 0, 0) if w.url != first])
    )

    def pressured(**by_url: float) -> list[WorkerLoad]:
        return [WorkerLoad(url=u, in_flight=0, write_pressure_blocks=by_url.get(u, 0.0)) for u in URLS]

    def place(candidates: list[WorkerLoad]) -> str:  # a fresh router: no placement remembered
        return KVAwareRouter().choose(
            RouteRequest(affinity_key=key, candidates=candidates, num_prompt_tokens=160)
        )

    assert place(pressured()) == first  # equal pressure: the rendezvous order
    assert place(pressured(**{first: 500.0})) == second  # its first choice's cache turns over faster
    assert place(pressured(**{first: 8.0})) == first  # less than this prompt's 10 blocks apart: equal
    others = [u for u in URLS if u not in (first, second)]
    # Never a third worker, however idle its cache: replicas with a stale view do not herd onto it.
    assert place(pressured(**{first: 500.0, second: 400.0})) == second
    assert place(pressured(**{first: 500.0, second: 400.0})) not in others


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


def test_index_measures_write_pressure_from_new_device_pool_stores_only():
    index = PrefixIndex()
    history = [stored(n, bytes([n]) * 32, "t-1") for n in range(1, 6)]
    index.apply(URLS[0], {"worker_id": "w0", "last_seq": 8, "events": history})  # catching up: history
    index.apply(URLS[0], {"worker_id": "w0", "last_seq": 8, "events": [stored(8, b"h" * 32, "t-1")]})
    (load,) = index.annotate(loads(0), [], [])
    assert load.write_pressure_blocks == 0.0  # a replay of what the worker did before we listened
    fresh = [stored(9, b"x" * 32, "t-1"), stored(10, b"y" * 32, "t-1"), stored(11, b"z" * 32, "t-1", "L2")]
    index.apply(URLS[0], {"worker_id": "w0", "last_seq": 11, "events": fresh})
    (load,) = index.annotate(loads(0), [], [])
    assert 1.99 < load.write_pressure_blocks <= 2.0  # two new L1 blocks (the L2 copy is a demotion)
    state = index.workers[URLS[0]]
    state.pressure_at_s -= WRITE_PRESSURE_TAU_S  # a time constant later
    assert abs(index.write_pressure(state) - 2.0 / math.e) < 0.01


def test_kv_aware_sends_a_cold_prefix_where_it_placed_it_until_the_index_catches_up():
    router = KVAwareRouter()
    key = b"new-prefix-key!!"
    calm = [WorkerLoad(url=u, in_flight=0) for u in URLS]
    first = router.choose(RouteRequest(affinity_key=key, candidates=calm, num_prompt_tokens=64))
    # Other prefixes' blocks reached the index meanwhile and loaded `first` with writes; this prefix's
    # own blocks have not arrived yet: its next request still follows the first one.
    pressed = [WorkerLoad(url=u, in_flight=0, write_pressure_blocks=900.0 * (u == first)) for u in URLS]
    assert router.choose(RouteRequest(affinity_key=key, candidates=pressed, num_prompt_tokens=64)) == first
    other = router.choose(
        RouteRequest(affinity_key=b"another-prefix!!", candidates=pressed, num_prompt_tokens=64)
    )
    assert other != first  # a new prefix does see the pressure


def test_kv_aware_holds_a_follower_while_its_leader_prefills_the_prefix_there():
    now = [100.0]
    router = KVAwareRouter(clock=lambda: now[0], leader_hold_s=2.0)
    calm = [WorkerLoad(url=u, in_flight=0) for u in URLS]

    def request(**changes) -> RouteRequest:
        fields = {
            "affinity_key": b"k" * 16,
            "candidates": calm,
            "num_prompt_tokens": 160,
            "head_block": b"h" * 32,
        }
        return RouteRequest(**{**fields, **changes})

    leader, hold = router.choose_and_hold(request())
    assert hold == 0.0  # the first request of a cold prefix goes at once
    now[0] += 0.5
    assert router.choose_and_hold(request()) == (leader, 1.5)  # a follower waits out the rest
    now[0] += 2.0
    assert router.choose_and_hold(request()) == (leader, 0.0)  # long placed: evicted, not in prefill
    now[0] = 100.1
    assert router.choose_and_hold(request(head_block=None)) == (leader, 0.0)  # nothing to wait on
    warm = [replace(w, cached_blocks=4, cached_weighted_blocks=4.0) if w.url == leader else w for w in calm]
    assert router.choose_and_hold(request(candidates=warm)) == (leader, 0.0)  # indexed: no wait


def test_a_different_prompt_under_the_same_affinity_key_never_holds():
    """A prompt_cache_key groups different prompts under one affinity key (and for `shared` tenants the
    key is the global namespace's): a second prompt waited the whole hold for its own head block, which
    no request was computing."""
    now = [100.0]
    router = KVAwareRouter(clock=lambda: now[0], leader_hold_s=2.0)
    calm = [WorkerLoad(url=u, in_flight=0) for u in URLS]

    def request(head: bytes) -> RouteRequest:
        return RouteRequest(affinity_key=b"k" * 16, candidates=calm, num_prompt_tokens=160, head_block=head)

    leader, _ = router.choose_and_hold(request(b"a" * 32))
    now[0] += 0.5
    assert router.choose_and_hold(request(b"b" * 32)) == (leader, 0.0)  # same worker (affinity), no hold
    assert router.choose_and_hold(request(b"a" * 32)) == (leader, 1.5)  # the leader's own head still holds


async def test_index_wakes_a_waiter_when_the_worker_announces_the_block():
    import asyncio

    index = PrefixIndex()
    block = b"b" * 32
    stored = {
        "seq": 1,
        "type": "BlockStored",
        "medium": "L1",
        "block_hashes": [block.hex()],
        "namespace_id": "t",
    }
    waiting = asyncio.ensure_future(index.wait_stored(URLS[0], block, 5.0))
    await asyncio.sleep(0)
    index.apply(URLS[1], {"worker_id": "w1", "last_seq": 1, "events": [stored]})  # another worker
    await asyncio.sleep(0)
    assert not waiting.done()
    index.apply(URLS[0], {"worker_id": "w0", "last_seq": 1, "events": [stored]})
    assert await waiting is True and not index._waiters
    assert await index.wait_stored(URLS[0], block, 0.0) is True  # already there
    assert await index.wait_stored(URLS[0], b"c" * 32, 0.01) is False  # never comes: the bound
    dropped = asyncio.ensure_future(index.wait_stored(URLS[0], b"c" * 32, 5.0))
    await asyncio.sleep(0)
    index.drop(URLS[0])  # a dead worker: stop waiting at once
    assert await dropped is False


def test_kv_aware_places_a_cold_prefix_on_the_less_busy_of_its_two_workers():
    """Busy in prefill tokens, not in requests: a cold prompt is prefilled whole, behind the prompt tokens
    already waiting there; requests past their first token (decoding) cost ``running_cost_tokens`` each."""
    key = b"cold-prefix-key!"
    first, second = sorted(URLS, key=lambda url: _rank(key, url))[:2]  # its two rendezvous workers

    def placed(pending: dict[str, int], pressure: dict[str, float], in_flight: dict[str, int] | None = None):
        workers = [
            WorkerLoad(
                url=u,
                in_flight=(in_flight or {}).get(u, 0),
                pending_prefill_tokens=pending.get(u, 0),
                write_pressure_blocks=pressure.get(u, 0.0),
            )
            for u in URLS
        ]
        request = RouteRequest(affinity_key=key, candidates=workers, num_prompt_tokens=64)
        return KVAwareRouter().choose(request)

    assert placed({}, {}) == first  # equal: the rendezvous order
    assert placed({first: 30}, {}) == second  # equally pressed caches: the shorter prefill queue
    assert placed({}, {}, in_flight={first: 1}) == second  # (one running sequence there: still longer)
    assert placed({}, {first: 500.0}) == second  # the cache that turns over slower
    assert placed({first: 60}, {second: 500.0}) == first  # less than its own prompt apart: by pressure
    assert placed({first: 400}, {second: 500.0}) == second  # a prefill queue on the first: avoid it
    assert placed({second: 400}, {first: 500.0}) == first
    # Two requests there that are decoding (no prefill pending) do not outweigh the pressure; two whole
    # prompts waiting for their prefill do.
    assert placed({}, {second: 500.0}, in_flight={first: 2}) == first
    assert placed({first: 2 * 300}, {second: 500.0}, in_flight={first: 2}) == second


def test_a_leader_s_first_token_ends_its_followers_hold():
    """The gateway sees its leader's first token before the KV event announcing the head block: the
    followers waiting go then (``RequestPipeline.prefilled``), and later ones do not wait."""
    router, now, request = held_router()
    leader, _ = router.choose_and_hold(request("leader"))
    now[0] += 0.5
    assert router.choose_and_hold(request("follower")) == (leader, 1.5)
    other = next(w.url for w in request("x").candidates if w.url != leader)
    assert router.leader_prefilled(request("follower"), leader) is False  # only the leader's token counts
    assert router.leader_prefilled(request("leader"), other) is False  # retried elsewhere: not there
    assert router.choose_and_hold(request("follower-2")) == (leader, 1.5)
    assert router.leader_prefilled(request("leader"), leader) is True  # release the waiting ones
    assert router.choose_and_hold(request("follower-3")) == (leader, 0.0)  # same worker, no wait
    assert router.leader_prefilled(request("leader"), leader) is True  # (a retry: harmless)
    assert router.drop_placement(request("leader")) == leader  # failed later: still its own to drop


async def test_a_leader_s_first_token_wakes_only_its_own_followers_as_stored():
    import asyncio

    index = PrefixIndex()
    block = b"h" * 32
    mine = asyncio.ensure_future(index.wait_stored(URLS[0], block, 30.0, "leader-a"))
    theirs = asyncio.ensure_future(index.wait_stored(URLS[0], block, 30.0, "leader-b"))
    await asyncio.sleep(0)
    index.release(URLS[0], block, "leader-a", stored=True)
    assert await asyncio.wait_for(mine, 5) is True  # computed there: the follower finds it cached
    await asyncio.sleep(0)
    assert not theirs.done()  # another leader's followers wait for theirs
    theirs.cancel()
