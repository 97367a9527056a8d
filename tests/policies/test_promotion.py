import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.hashing import NamespaceSegment, block_hashes
from policies.isolation import (
    ISOLATION_LEVELS,
    PROMOTED_NAMESPACE_ID,
    PROMOTION_IDENTITY_KEY,
    namespace_segments,
)
from policies.promotion import (
    BoundaryPrefix,
    InMemoryPromotionCounter,
    PrefixHash,
    PrefixStats,
    PromotedPrefix,
    PromotionPolicy,
    SlidingWindowCounter,
    TenantTag,
    boundary_prefixes,
    hot_prefix_access,
    longest_promoted_prefix,
    observe,
    promotion_candidates,
)

FP = b"model-fingerprint"
H = PrefixHash("aa" * 32)


def tags(n: int) -> list[TenantTag]:
    return [TenantTag(f"t-{i}") for i in range(n)]


# -- policy ---------------------------------------------------------------------------------------


def test_policy_defaults_env_and_min_tenants_clamp():
    assert PromotionPolicy() == PromotionPolicy(min_hits_per_hour=1000, min_tenants=3)
    assert PromotionPolicy(min_tenants=1).min_tenants == 3  # k ≥ 3 whatever the configuration says
    assert PromotionPolicy(min_tenants=2).min_tenants == 3
    env = {"PREFIXGATE_PROMOTION_MIN_HITS": "50", "PREFIXGATE_PROMOTION_MIN_TENANTS": "1"}
    assert PromotionPolicy.from_env(env) == PromotionPolicy(min_hits_per_hour=50, min_tenants=3)
    assert PromotionPolicy.from_env({}) == PromotionPolicy()
    with pytest.raises(ValueError, match="must be integers"):
        PromotionPolicy.from_env({"PREFIXGATE_PROMOTION_MIN_HITS": "lots"})
    with pytest.raises(ValueError, match="at least 1"):
        PromotionPolicy(min_hits_per_hour=0)


@pytest.mark.parametrize(
    ("hits", "tenants", "promote"),
    [(999, 3, False), (1000, 3, True), (1000, 2, False), (5000, 2, False), (1000, 64, True)],
)
def test_both_thresholds_must_be_met(hits, tenants, promote):
    stats = PrefixStats(prefix_hash=H, hits=hits, num_tenants=tenants)
    assert PromotionPolicy().should_promote(stats) is promote


def test_hits_per_hour_scales_a_shorter_window():
    assert PrefixStats(prefix_hash=H, hits=10, num_tenants=1, window_s=600).hits_per_hour == 60


@pytest.mark.parametrize(
    ("level", "opted_in", "access"),
    [
        ("shared", True, True),
        ("shared", False, False),
        ("namespace", True, True),
        ("namespace", False, False),
        ("dedicated", True, False),
        ("dedicated", False, False),
    ],
)
def test_eligibility_matrix(level, opted_in, access):
    assert set(ISOLATION_LEVELS) == {"shared", "namespace", "dedicated"}
    assert hot_prefix_access(level, opted_in) is access


# -- sliding-window counter -----------------------------------------------------------------------


def test_threshold_edge_is_reached_on_the_exact_hit():
    counter, policy = SlidingWindowCounter(), PromotionPolicy(min_hits_per_hour=6, min_tenants=3)
    results = [policy.should_promote(counter.record(H, tag, 10.0)) for tag in tags(3) * 2]
    assert results == [False] * 5 + [True]


def test_a_single_tenant_never_promotes_however_often_it_sends():
    counter, policy = SlidingWindowCounter(), PromotionPolicy(min_hits_per_hour=1, min_tenants=1)
    for i in range(5000):
        stats = counter.record(H, TenantTag("t-only"), i * 0.5)
        assert not policy.should_promote(stats)
    assert stats.num_tenants == 1 and stats.hits == 5000


def test_hits_and_tenants_leave_the_window_after_an_hour():
    counter = SlidingWindowCounter(window_s=3600, bucket_s=60)
    counter.record(H, TenantTag("a"), 0.0)
    counter.record(H, TenantTag("b"), 1800.0)
    assert counter.stats(H, 3599.0) == PrefixStats(prefix_hash=H, hits=2, num_tenants=2, window_s=3600)
    assert counter.stats(H, 3600.0).hits == 1 and counter.stats(H, 3600.0).num_tenants == 1
    assert counter.stats(H, 5400.0).hits == 0 and counter.stats(H, 5400.0).num_tenants == 0
    stats = counter.record(H, TenantTag("c"), 5400.0)
    assert (stats.hits, stats.num_tenants) == (1, 1)
    kept = counter._counts[H].tenant_bucket_hits
    assert list(kept) == ["c"] and len(kept["c"]) == 1  # expired buckets are dropped, not kept


def test_tenant_set_is_capped_and_keeps_the_most_recent():
    counter = SlidingWindowCounter(max_tenants=4)
    for i, tag in enumerate(tags(10)):
        stats = counter.record(H, tag, float(i * 60))
    assert stats.num_tenants == 4
    assert sorted(counter._counts[H].tenant_bucket_hits) == ["t-6", "t-7", "t-8", "t-9"]


def test_number_of_tracked_prefixes_is_bounded_and_hot_ones_survive():
    counter = SlidingWindowCounter(max_prefixes=100)
    hot = PrefixHash("hot")
    for i in range(2000):
        counter.record(PrefixHash(f"cold-{i}"), TenantTag("a"), float(i))
        if i % 50 == 0:
            counter.record(hot, TenantTag("b"), float(i))
    assert len(counter) == 100
    assert counter.stats(hot, 2000.0).hits == 40
    assert counter.stats(PrefixHash("cold-0"), 2000.0).hits == 0  # evicted


def test_forget_and_unknown_prefixes():
    counter = SlidingWindowCounter()
    counter.record(H, TenantTag("a"), 0.0)
    counter.forget(H)
    assert counter.stats(H, 1.0) == PrefixStats(prefix_hash=H, hits=0, num_tenants=0)
    with pytest.raises(ValueError):
        SlidingWindowCounter(max_tenants=1)


_events = st.lists(
    st.tuples(st.integers(0, 7_200), st.sampled_from(["a", "b", "c", "d", "e", "f"])), max_size=60
).map(sorted)


@settings(max_examples=150, deadline=None)
@given(_events, st.integers(1, 4))
def test_counter_matches_a_brute_force_window(events, cap):
    counter = SlidingWindowCounter(window_s=3600, bucket_s=60, max_tenants=6)
    for i, (t, tag) in enumerate(events):
        stats = counter.record(H, TenantTag(tag), float(t), max_hits_per_tenant=cap)
        in_window = [g for u, g in events[: i + 1] if u // 60 > t // 60 - 60]
        assert stats.hits == sum(min(in_window.count(g), cap) for g in set(in_window))
        assert stats.num_tenants == len(set(in_window))


# -- boundary prefixes and lookup -----------------------------------------------------------------


def test_boundary_prefixes_are_block_aligned_global_form_hashes():
    tokens = list(range(100))
    prefixes = boundary_prefixes(tokens, [5, 16, 40, 40, 47, None, 500], block_size=16, model_fingerprint=FP)
    assert [p.num_tokens for p in prefixes] == [16, 32]  # 500 is past the prompt: not a boundary
    identity = NamespaceSegment(start_token=0, namespace_id=PROMOTED_NAMESPACE_ID, key=PROMOTION_IDENTITY_KEY)
    global_hashes = block_hashes(tokens, 16, FP, [identity])
    assert [p.prefix_hash for p in prefixes] == [global_hashes[i].hex() for i in (0, 1)]
    assert boundary_prefixes(tokens, [100], block_size=16, model_fingerprint=FP)[0].num_tokens == 96
    assert boundary_prefixes(tokens, [3, None], block_size=16, model_fingerprint=FP) == []


def test_tenants_sharing_a_system_prompt_share_its_hash_and_the_worker_reuses_it():
    system = list(range(1000, 1064))
    a = boundary_prefixes([*system, 1, 2, 3] * 1, [64], block_size=16, model_fingerprint=FP)
    b = boundary_prefixes([*system, 9, 9], [64], block_size=16, model_fingerprint=FP)
    assert a == b == [BoundaryPrefix(prefix_hash=a[0].prefix_hash, num_tokens=64)]

    # once promoted, each opted-in tenant's request hashes [0, 64) in the promoted namespace, so the
    # worker's hash of block 3 is the same whichever tenant sends it; a new namespace secret changes it
    # (a rotation invalidates the promoted pool too) but not the promotion's identity, ``prefix_hash``
    def worker_hash(salt: bytes, tenant: str) -> bytes:
        segments = namespace_segments(
            level="namespace", salt=salt, tenant_id=tenant, epoch=1, promoted_prefix_tokens=64
        )
        return block_hashes([*system, *range(32)], 16, FP, segments)[3]

    assert worker_hash(b"salt", "alice") == worker_hash(b"salt", "bob") != worker_hash(b"rotated", "bob")
    assert worker_hash(b"salt", "alice").hex() != a[0].prefix_hash


def test_longest_promoted_prefix():
    prefixes = [
        BoundaryPrefix(prefix_hash=PrefixHash(h), num_tokens=n) for h, n in (("a", 16), ("b", 64), ("c", 128))
    ]
    assert longest_promoted_prefix(prefixes, {"a", "b"}) == 64
    assert longest_promoted_prefix(prefixes, {"c", "a"}) == 128
    assert longest_promoted_prefix(prefixes, set()) == 0
    assert longest_promoted_prefix([], {"a"}) == 0


# -- promotion flow ---------------------------------------------------------------------------------


async def test_observe_promotes_once_and_never_twice():
    counter = InMemoryPromotionCounter(SlidingWindowCounter())
    policy = PromotionPolicy(min_hits_per_hour=4, min_tenants=3)
    prefixes = boundary_prefixes(list(range(64)), [16, 64], block_size=16, model_fingerprint=FP)
    promoted: dict[str, PromotedPrefix] = {}
    # Each tenant counts at most floor(4 / 3) = 1 hit: the fourth hit needs a fourth tenant.
    for step, tag in enumerate(tags(4)):
        for p in await observe(counter, policy, prefixes, tag, 100.0 + step, known=promoted):
            promoted[p.prefix_hash] = p
    assert sorted(p.num_tokens for p in promoted.values()) == [16, 64]
    record = promoted[prefixes[1].prefix_hash]
    assert (record.hits_per_hour, record.num_tenants, record.promoted_at) == (4, 4, 103.0)
    assert set(record.to_json()) == {
        "prefix_hash",
        "num_tokens",
        "hits_per_hour",
        "num_tenants",
        "promoted_at",
    }
    assert await observe(counter, policy, prefixes, TenantTag("t-9"), 105.0, known=promoted) == []
    assert longest_promoted_prefix(prefixes, promoted) == 64
    assert await observe(counter, policy, [], TenantTag("t-9"), 105.0) == []


async def test_revoked_prefixes_stay_known_and_forget_resets_counts():
    counter = InMemoryPromotionCounter()
    await counter.record([H], TenantTag("a"), 0.0)
    assert (await counter.stats([H], 1.0))[0].hits == 1
    await counter.forget(H)
    assert (await counter.stats([H], 1.0))[0].hits == 0
    prefix = [BoundaryPrefix(prefix_hash=H, num_tokens=16)]
    hot = [PrefixStats(prefix_hash=H, hits=5000, num_tenants=9)]
    assert promotion_candidates(PromotionPolicy(), prefix, hot, known={H}, now=0.0) == []
    assert len(promotion_candidates(PromotionPolicy(), prefix, hot, known=set(), now=0.0)) == 1


async def test_in_memory_counter_keeps_the_window_it_is_given():
    # An empty SlidingWindowCounter has len() 0; `window or default` used to replace it.
    window = SlidingWindowCounter(max_tenants=3)
    counter = InMemoryPromotionCounter(window)
    assert counter.window is window
    for tag in tags(4):
        (stats,) = await counter.record([H], tag, 0.0)
    assert stats.num_tenants == 3


# -- the gateway's wiring, end to end in pure code ------------------------------------------------


async def test_canonicalized_requests_of_three_tenants_promote_their_shared_system_prompt():
    import jinja2

    from policies.canonicalize import CanonicalizationPolicy, canonicalize_request
    from policies.chat_text import (
        char_to_token_offsets,
        insert_markers,
        locate_markers,
        message_boundary_positions,
    )
    from worker.tokenizer import BYTE_CHAT_TEMPLATE, TokenizerBundle

    tokenizer = TokenizerBundle.byte_level()
    template = jinja2.Environment().from_string(BYTE_CHAT_TEMPLATE)

    def render(request) -> str:
        return template.render(messages=request["messages"], bos_token="<|bos|>", add_generation_prompt=True)

    system = "You are the support bot of Example Corp. Answer in English. " * 4 + "Now: {now}."
    canon, policy = CanonicalizationPolicy(mode="on"), PromotionPolicy(min_hits_per_hour=3, min_tenants=3)
    counter, promoted = InMemoryPromotionCounter(), {}
    for tenant, now in (
        ("t-a", "2026-11-29T10:00:00Z"),
        ("t-b", "2026-11-29T10:00:07Z"),
        ("t-c", "14:03:22"),
    ):
        request = {
            "messages": [
                {"role": "system", "content": system.format(now=now)},
                {"role": "user", "content": tenant},
            ]
        }
        request = canonicalize_request(request, canon).request
        positions = message_boundary_positions(request["messages"])
        plain = render(request)
        chars = locate_markers(
            render({**request, "messages": insert_markers(request["messages"], positions)}),
            plain,
            len(positions),
        )
        encoding = tokenizer.tokenizer.encode(plain, add_special_tokens=False)
        offsets = char_to_token_offsets([start for start, _ in encoding.offsets], chars)
        prefixes = boundary_prefixes(encoding.ids, offsets, block_size=16, model_fingerprint=FP)
        assert hot_prefix_access("namespace", True)
        for record in await observe(counter, policy, prefixes, TenantTag(tenant), 0.0, known=promoted):
            promoted[record.prefix_hash] = record
    (record,) = promoted.values()
    # <|bos|> <|start|> "system\n" (2 + 7 tokens), then the canonical system prompt, one byte a token
    assert record.num_tenants == 3 and record.num_tokens == (9 + len(system.format(now="[[1]]"))) // 16 * 16
    assert longest_promoted_prefix(prefixes, promoted) == record.num_tokens


async def _record_at_cap(counter, policy, prefix, tenants, now):
    for tenant in tenants:  # as many requests as they like: each counts up to its cap
        for _ in range(policy.min_hits_per_hour):
            [stats] = await counter.record(
                prefix,
                TenantTag(tenant),
                now,
                max_hits_per_tenant_per_hour=policy.max_hits_per_tenant_per_hour,
            )
    return stats


@pytest.mark.parametrize(
    ("min_hits", "k"), [(3, 3), (6, 3), (8, 3), (14, 4), (1000, 3), (1001, 3), (1000, 5)]
)
async def test_k_minus_1_tenants_never_make_the_hits_alone_and_k_tenants_do(min_hits, k):
    """Review r3 D5: with (min_hits, k) = (9, 4), k−1 tenants of one party counted 9 and one request of a
    victim completed the promotion, telling the party that the victim sent the prefix. Such thresholds are
    now refused; at every accepted one the other tenants must send what the party cannot, and k tenants
    at their cap reach the threshold."""
    policy = PromotionPolicy(min_hits_per_hour=min_hits, min_tenants=k)
    policy.check_threshold()
    counter, prefix, now = InMemoryPromotionCounter(), [PrefixHash("ab" * 32)], 1_000_000.0
    stats = await _record_at_cap(counter, policy, prefix, [f"t-party-{i}" for i in range(k - 1)], now)
    assert stats.hits < min_hits
    [stats] = await counter.record(
        prefix, TenantTag("t-victim"), now, max_hits_per_tenant_per_hour=policy.max_hits_per_tenant_per_hour
    )
    assert policy.should_promote(stats) == (
        stats.hits >= min_hits
    )  # one request: only if it is all that is left
    if min_hits >= 6:
        assert not policy.should_promote(stats), (min_hits, k, stats)
    stats = await _record_at_cap(counter, policy, prefix, ["t-victim"], now)
    assert policy.should_promote(stats), (min_hits, k, stats)  # the k-th tenant at its cap: promoted


@pytest.mark.parametrize(("min_hits", "k"), [(2, 3), (4, 3), (6, 4), (9, 4), (16, 5)])
def test_a_threshold_k_minus_1_tenants_make_alone_is_refused(min_hits, k):
    with pytest.raises(ValueError, match="too low"):
        PromotionPolicy(min_hits_per_hour=min_hits, min_tenants=k).check_threshold()
