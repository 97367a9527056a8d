"""The adaptive default: experts on shadow caches, the leader's order on the real one, ghosts kept."""

import random

from bench.isolation import partitions
from bench.replay import replay
from bench.trace import TraceRequest
from policies.eviction import AdaptivePolicy, ARCPolicy, BlockId, BlockMeta, make_policy


def _insert(policy, block_id: int, parent: int | None = None, position: int = 0) -> None:
    meta = BlockMeta(position=position, parent=None if parent is None else BlockId(parent))
    policy.on_miss(BlockId(block_id), 0.0)
    policy.on_insert(BlockId(block_id), meta, 0.0)


def test_alone_the_leader_is_exactly_its_expert():
    # Until another expert's shadow is significantly ahead, the real cache is ARC, the first leader.
    requests = [
        TraceRequest(timestamp_ms=i, hash_ids=tuple(range(i % 7 * 10, i % 7 * 10 + 5))) for i in range(60)
    ]
    (part,) = partitions(requests, "shared", 12)
    adaptive = AdaptivePolicy(12)
    ours = replay(part.requests, adaptive, 12)
    alone = replay(part.requests, make_policy("arc", 12), 12)
    assert adaptive.leader_name == "arc"
    assert ours == alone


def test_a_better_expert_takes_the_lead():
    # Two hot 3-block chains alternate with one-off 4-block chains: 11 distinct blocks between two uses
    # of a hot chain, one more than the cache holds, so LRU never hits while ARC's frequency list and the
    # prefix policy's protected segment keep the hot chains.
    requests = []
    for i in range(1500):
        hot = (i % 2) * 1000
        requests.append(TraceRequest(timestamp_ms=i, hash_ids=tuple(range(hot, hot + 3))))
        requests.append(
            TraceRequest(timestamp_ms=i, hash_ids=tuple(range(10_000 + 4 * i, 10_000 + 4 * i + 4)))
        )
    (part,) = partitions(requests, "shared", 10)
    adaptive = AdaptivePolicy(10)
    adaptive.leader = 2  # start on LRU, the worst expert here
    ours = replay(part.requests, adaptive, 10)
    lru = replay(part.requests, make_policy("lru", 10), 10)
    assert adaptive.leader_name != "lru"
    assert ours.prefix_hit_ratio > lru.prefix_hit_ratio


def test_followers_forget_what_the_leader_evicts():
    policy = AdaptivePolicy(8)
    for block_id in range(1, 9):
        _insert(policy, block_id)
    victim = policy.evict(lambda b: True)
    assert victim is not None and victim not in policy and len(policy) == 7
    assert all(victim not in follower for follower in policy._followers)
    assert all(len(follower) == 7 for follower in policy._followers)


def test_arc_keeps_a_block_evicted_by_another_policy_as_a_ghost():
    arc = ARCPolicy(4)
    for block_id in (1, 2):
        _insert(arc, block_id)
    arc.on_evicted(BlockId(2))
    assert BlockId(2) not in arc
    arc.on_miss(BlockId(2), 0.0)  # a ghost hit: p grows, the block goes to T2
    arc.on_insert(BlockId(2), BlockMeta(position=0, parent=None), 0.0)
    assert arc.target_t1_blocks == 1.0


def test_large_caches_sample_their_shadows():
    policy = AdaptivePolicy(100_000)
    assert policy.sample_rate == 12
    assert all(shadow.capacity_blocks == 100_000 // 12 for shadow in policy._shadows)


def _with_discordant_counts(wins_over_leader: float, wins_over_real: float, *, hits: float = 1000.0):
    """A policy led by ARC (arm 1) whose prefix shadow (arm 0) hit where the others missed this often."""
    policy = AdaptivePolicy(100)
    assert policy.leader == 1
    for arm in range(4):
        policy._wins[arm][arm] = hits
    policy._wins[0][1], policy._wins[1][0] = wins_over_leader, 10.0
    policy._wins[0][AdaptivePolicy.REAL_ARM], policy._wins[AdaptivePolicy.REAL_ARM][0] = wins_over_real, 10.0
    return policy


def test_a_significant_lead_over_the_leader_and_the_real_cache_takes_over():
    assert _with_discordant_counts(100.0, 100.0)._next_leader() == 0


def test_no_switch_to_an_expert_the_real_cache_already_matches():
    # The prefix shadow beats ARC's shadow, but the real cache hits as often as it: a switch would only
    # cost (the new leader inherits a cache it did not fill).
    assert _with_discordant_counts(100.0, 12.0)._next_leader() == 1


def test_no_switch_on_a_lead_within_noise():
    # 25 against 10 discordant accesses: 15 < 3 standard deviations (3 × √35 ≈ 17.7).
    assert _with_discordant_counts(25.0, 25.0)._next_leader() == 1


class _SwitchRecorder(AdaptivePolicy):
    """Records, per eviction, whether the victim is still held by the leader's shadow, and whether a
    real resident block its shadow had dropped could have gone instead."""

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self.evictions: list[tuple[bool, bool]] = []

    def evict(self, can_evict):
        shadow = self._shadows[self.leader].parent_of
        dropped_evictable = any(b not in shadow and can_evict(b) for b in self._meta)
        victim = super().evict(can_evict)
        self.evictions.append((victim in shadow, dropped_evictable))
        return victim


def _sessions(num_requests: int, seed: int) -> list[TraceRequest]:
    """Requests that extend one of 40 growing sessions or bring a one-off chain."""
    rng = random.Random(seed)
    heads = {s: list(range(s * 10_000, s * 10_000 + rng.randint(2, 6))) for s in range(40)}
    requests = []
    for i in range(num_requests):
        if rng.random() < 0.3:
            chain = list(range(1_000_000 + 8 * i, 1_000_000 + 8 * i + rng.randint(2, 8)))
        else:
            chain = heads[rng.randrange(40)]
            chain.extend(range(chain[-1] + 1, chain[-1] + 1 + rng.randint(1, 3)))
            chain = chain[:]
        requests.append(TraceRequest(timestamp_ms=i, hash_ids=tuple(chain)))
    return requests


def test_after_a_switch_the_real_cache_first_drops_what_the_new_leaders_shadow_dropped():
    # LRU leads while the real cache fills, then ARC takes over: its follower only watched LRU's choices,
    # so its own order would evict blocks ARC's shadow still holds while the real cache keeps blocks ARC
    # had already let go. The real cache must drop those first (and only then ask the follower).
    (part,) = partitions(_sessions(1200, seed=5), "shared", 60)
    policy = _SwitchRecorder(60)
    policy.switch_z = float("inf")  # the test makes the one switch itself
    policy.leader = 2
    done = []

    def switch_halfway() -> None:
        done.append(1)
        if len(done) == 600:
            policy.leader, policy.evictions = 1, []

    replay(part.requests, policy, 60, on_request=switch_halfway)
    assert sum(dropped for _, dropped in policy.evictions) > 20  # the case occurs, often
    assert not [e for e in policy.evictions if e == (True, True)]


PREFIX, ARC, LRU, REAL = 0, 1, 2, AdaptivePolicy.REAL_ARM


def _guarded(leader: int, *, lru_over_real: int, prefix_over_lru: int, accesses: int = 10_000):
    """A policy whose usual rule (decayed counts) would now switch from ``leader`` to the prefix expert, with
    whole-trace counts where LRU beats ARC and the real cache by ``lru_over_real`` hits (of 600 discordant
    accesses), and the prefix shadow beats LRU's by ``prefix_over_lru`` (of 2 000)."""
    policy = AdaptivePolicy(100)  # the guard starts after 16 × 100 accesses
    policy.leader = leader
    for arm in range(4):
        policy._wins[arm][arm] = 1000.0
    for arm in {leader, REAL} - {PREFIX}:
        policy._wins[PREFIX][arm], policy._wins[arm][PREFIX] = 100.0, 10.0
    totals = policy._totals
    totals[LRU][ARC], totals[ARC][LRU] = 400, 200
    totals[LRU][REAL], totals[REAL][LRU] = (600 + lru_over_real) // 2, (600 - lru_over_real) // 2
    totals[PREFIX][LRU], totals[LRU][PREFIX] = (2000 + prefix_over_lru) // 2, (2000 - prefix_over_lru) // 2
    policy._accesses = accesses
    return policy


def test_the_guard_keeps_the_target_while_the_real_cache_is_behind_it():
    # On the whole trace LRU beats ARC (it is the target) and the real cache (200 of 600: z ≈ 8); the prefix
    # expert's recent lead is within noise of LRU over the whole trace (50 of 2 000): no switch.
    assert _guarded(LRU, lru_over_real=200, prefix_over_lru=50)._next_leader() == LRU
    # Without the real cache's deficit, before the warm-up, or against an expert that beats the target
    # over the whole trace (300 of 2 000: z ≈ 6.7), the usual rule decides.
    assert _guarded(LRU, lru_over_real=0, prefix_over_lru=50)._next_leader() == PREFIX
    assert _guarded(LRU, lru_over_real=200, prefix_over_lru=50, accesses=1_000)._next_leader() == PREFIX
    assert _guarded(LRU, lru_over_real=200, prefix_over_lru=300)._next_leader() == PREFIX


def test_the_guard_sends_a_leader_the_target_beats_over_the_whole_trace_to_the_target():
    # LRU beats the prefix expert over the whole trace (300 of 2 000) and the real cache: the guard leaves
    # prefix, which the usual rule would keep.
    policy = _guarded(PREFIX, lru_over_real=200, prefix_over_lru=-300)
    assert policy._usual_leader() == PREFIX
    assert policy._next_leader() == LRU
    assert policy.target == LRU
