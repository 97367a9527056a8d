"""The default eviction policy: follow whichever expert policy is winning on this workload, online.

No single order wins everywhere: the prefix-aware policy (``eviction_prefix``) is well ahead on traces
with much one-off content (Mooncake), ARC on small caches of multi-turn chats, LRU on large caches of
sessions that come back after a long think time. ``AdaptivePolicy`` runs all three and learns which one
to follow from the accesses it sees:

- **Shadows.** Each expert also runs on a shadow cache of the same capacity that holds ids only and sees
  every access (hits and misses of the real cache alike): what that expert would have hit alone.
- **Followers.** Each expert also orders the real resident blocks. ``evict`` asks the leader for the
  victim and tells the others with ``on_evicted``, so each follower keeps its ghost lists. Behind an
  owner that evicts leaves only (``declare_leaf_only``) the LRU and ARC followers are
  ``eviction_leaves``' versions: the same victims, without asking about inner blocks.
- **The leader's shadow first.** Before asking the leader's follower, ``evict`` takes the real resident
  blocks the leader's shadow has already evicted, in the order it evicted them: after a switch the real
  cache drops what the new leader would not hold, instead of what its follower (which only watched the
  old leader's choices) ranks last. With one leader all along there is no such block that the real cache
  can drop (the shadows do not know which blocks are in use). Behind a leaf-only owner only the lists'
  leaves are asked about (``eviction_outside``): the same victim, at a cost that does not grow with the
  blocks in use.
- **Paired evidence.** The arms (three shadows and the real cache itself) see the same accesses, so
  they are compared on the accesses where exactly one of two arms hit (McNemar's test), decayed by half
  every ``half_life_factor`` × capacity accesses. Per-arm hit counts would hide a small, steady lead
  under the variance the arms share.
- **Switch only to a better cache than the one we have.** Another expert takes the lead only if its
  shadow beats the leader's shadow *and the real cache*, each by ``switch_z`` standard deviations and by
  ``switch_margin`` of the loser's hits. A switch costs (the new leader inherits a cache the old one
  filled); comparing with the real cache's own hits stops the learner from paying that again for a
  lead the real cache already has, and from flapping between experts that tie.
- **A guard over the whole trace.** The usual rule follows leads of the last few capacities; where
  leads reverse, every switch costs the real cache and the real cache can end below every expert. So
  the policy also keeps undecayed paired counts, and a *target*: the better of ARC and LRU over the whole
  trace (the policies the default must not lose to; it changes only on a significant lead). Once the
  real cache is significantly behind the target over the whole trace (after ``guard_after_factor`` ×
  capacity accesses, the warm-up), a leader the target beats significantly over the whole trace gives
  way to the target, and the target, once leading, gives way only to an expert that beats it
  significantly over the whole trace.
- **A safe start.** The first leader is ARC, one of the two policies the default must never lose to;
  the prefix-aware order takes over where its lead is significant (Mooncake: within a few capacities).

When one expert leads all the time the real cache is exactly that expert (the leader's follower gets the
same calls as the policy alone). Large caches sample the shadows by block id (SHARDS, Waldspurger et
al., FAST'15: a shadow of ``capacity / rate`` blocks sees one id in ``rate``), so the shadows cost at
most ``max_shadow_blocks`` ids each whatever the capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from policies.eviction_arc import ARCPolicy
from policies.eviction_base import BlockId, BlockMeta, EvictionPolicy
from policies.eviction_leaves import LeafARCPolicy, LeafLRUPolicy
from policies.eviction_lru import LRUPolicy
from policies.eviction_outside import OutsideLists
from policies.eviction_prefix import PrefixAwarePolicy
from policies.eviction_shadow import ARCShadow, LRUShadow, PolicyShadow, Shadow, walk_hits

_EXPERTS: tuple[type[EvictionPolicy], ...] = (PrefixAwarePolicy, ARCPolicy, LRUPolicy)
# The same experts' victims behind an owner that evicts leaves only, without asking about inner blocks
_LEAF_ONLY_EXPERTS: tuple[type[EvictionPolicy], ...] = (PrefixAwarePolicy, LeafARCPolicy, LeafLRUPolicy)
_SAMPLE_MULTIPLIER = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads sequential ids over the samples
_MASK_64 = (1 << 64) - 1
_RESCALE_AT = 1e100  # renormalize the decayed counts before their weight overflows
_ALL_SHADOWS = (0, 1, 2)  # indices of the shadows, in the order of _EXPERTS


class AdaptivePolicy(EvictionPolicy):
    """Follows the expert (prefix-aware, ARC, LRU) whose shadow beats both the leader's and the real cache."""

    name = "adaptive"
    REAL_ARM = 3  # index of the real cache among the arms compared (after the three shadows)

    half_life_factor = 8.0  # accesses for a hit to count half, × capacity
    switch_z = 3.0  # a lead must be this many standard deviations of the discordant count (McNemar)
    switch_margin = 0.01  # ... and this fraction of the loser's (decayed) hits
    initial_leader = 1  # ARC: a policy the default is measured against
    max_shadow_blocks = 8192  # shadows of larger caches sample ids (one in capacity / this)
    guard_after_factor = 16.0  # the whole-trace guard starts after this many capacities of accesses
    GUARD_EXPERTS = (1, 2)  # ARC and LRU: the guard's target is the better of these over the whole trace

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        capacity = max(capacity_blocks, 1)
        self.sample_rate = max(1, capacity // self.max_shadow_blocks)
        shadow_capacity = max(1, capacity // self.sample_rate)
        self._followers = [expert(capacity) for expert in _EXPERTS]
        sampled = self.sample_rate > 1
        self._shadows: list[Shadow] = [  # in the order of _EXPERTS
            PolicyShadow(PrefixAwarePolicy(shadow_capacity), sampled=sampled),
            ARCShadow(shadow_capacity, sampled=sampled),
            LRUShadow(shadow_capacity, sampled=sampled),
        ]
        self._decay = 0.5 ** (1.0 / (self.half_life_factor * shadow_capacity))
        self.leader = self.initial_leader  # index into the experts, until the shadows show otherwise
        self._meta: dict[BlockId, BlockMeta] = {}  # resident block -> its meta (shadows need parents)
        # _wins[i][j]: decayed count of accesses where arm i hit and arm j missed; arms are the shadows
        # and, last, the real cache. Counts are kept in units of 1 / _weight so decay costs nothing.
        self._wins = [[0.0] * (len(_EXPERTS) + 1) for _ in range(len(_EXPERTS) + 1)]
        self._weight = 1.0
        # _totals[i][j]: the same count over the whole trace (no decay), for the guard
        self._totals = [[0] * (len(_EXPERTS) + 1) for _ in range(len(_EXPERTS) + 1)]
        self._accesses = 0  # accesses the shadows saw
        self._guard_after = self.guard_after_factor * shadow_capacity
        self.target = self.initial_leader  # the guard's: the better of ARC and LRU over the whole trace
        # _outside.lists[i]: real resident blocks shadow i does not hold, in the order it dropped them (the
        # real cache evicts the leader's first); unused with sampled shadows, which see no whole cache.
        self._outside = OutsideLists(len(_EXPERTS))

    @property
    def leader_name(self) -> str:
        return self._followers[self.leader].name

    # -- owner calls ---------------------------------------------------------------------------------

    def declare_leaf_only(self) -> None:
        """Follow with ``eviction_leaves``' LRU and ARC: the same victims, fewer ``can_evict`` calls."""
        if self._meta:
            raise RuntimeError("declare_leaf_only() comes before the first insert")
        capacity = max(self.capacity_blocks, 1)
        self._followers = [expert(capacity) for expert in _LEAF_ONLY_EXPERTS]
        if self.sample_rate == 1:  # sampled shadows keep no lists
            self._outside.declare_leaf_only()

    def on_miss(self, block_id: BlockId, now: float) -> None:
        for follower in self._followers:
            follower.on_miss(block_id, now)

    def on_insert(self, block_id: BlockId, meta: BlockMeta, now: float) -> None:
        for follower in self._followers:
            follower.on_insert(block_id, meta, now)
        self._outside.link(block_id, meta.parent)
        self._meta[block_id] = meta
        self._observe(block_id, meta, now, hit=False)

    def on_hit(self, block_id: BlockId, now: float) -> None:
        meta = self._meta.get(block_id)
        if meta is None:
            return
        for follower in self._followers:
            follower.on_hit(block_id, now)
        self._observe(block_id, meta, now, hit=True)

    def on_hits(self, block_ids: Sequence[BlockId], now: float) -> None:
        meta_of = self._meta
        known = [block_id for block_id in block_ids if block_id in meta_of]
        if not known:
            return
        for follower in self._followers:
            follower.on_hits(known, now)
        if self.sample_rate > 1:
            known = [block_id for block_id in known if not self._skips(block_id)]
        metas = [meta_of[block_id] for block_id in known]
        self._accesses += len(known)
        # A shadow that holds the whole prompt (most do, most of the time) replays it in bulk; its prompt
        # walk depends only on where the shadow's previous access left it, so it is shared.
        known_set, walk, walk_start = set(known), None, None
        columns: list[list[bool]] = []
        missing = []  # shadows that did not hold the whole prompt (the others evicted nothing)
        for index, shadow in enumerate(self._shadows):
            start = (shadow.last_position, shadow.last_usable)
            if (walk is None or start == walk_start) and shadow.holds_all(known_set):
                if walk is None:
                    walk, walk_start = walk_hits(known, metas, *start, sampled=shadow.sampled), start
                shadow.hit_all(known, walk, now)
                columns.append(walk.usable)
            else:
                columns.append(shadow.access_many(known, metas, now))
                missing.append(index)
        if missing:
            self._track_outside(known, missing)
        if walk is not None and all(column is walk.usable for column in columns) and all(walk.usable):
            self._tally_all_hit(len(known))
            return
        row0, row1, row2, row3 = self._wins
        decay, weight = self._decay, self._weight
        for prefix_hit, arc_hit, lru_hit in zip(*columns, strict=True):
            if prefix_hit and arc_hit and lru_hit:  # ``_tally``'s path where no arm differs, inlined
                weight /= decay
                row0[0] += weight
                row1[1] += weight
                row2[2] += weight
                row3[3] += weight
                if weight > _RESCALE_AT:
                    self._weight = weight
                    self._rescale()
                    weight = self._weight
            else:
                self._weight = weight
                self._tally(prefix_hit, arc_hit, lru_hit, True)
                weight = self._weight
        self._weight = weight

    def on_remove(self, block_id: BlockId) -> None:
        self._forget(block_id)
        for follower in self._followers:
            follower.on_remove(block_id)

    def on_evicted(self, block_id: BlockId) -> None:
        self._forget(block_id)
        for follower in self._followers:
            follower.on_evicted(block_id)

    def evict(self, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        followers = self._followers
        victim = self._outside.pop_first_evictable(self.leader, can_evict)
        if victim is not None:  # the leader's shadow already dropped it
            self._forget(victim)
            for follower in followers:
                follower.on_evicted(victim)
            return victim
        order = (self.leader, *(i for i in range(len(followers)) if i != self.leader))
        for index in order:  # the others only when the leader has no evictable block
            victim = followers[index].evict(can_evict)
            if victim is not None:
                self._forget(victim)
                for other in order:
                    if other != index:
                        followers[other].on_evicted(victim)
                return victim
        return None

    def __len__(self) -> int:
        return len(self._meta)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._meta

    # -- internals ----------------------------------------------------------------------------------

    def _forget(self, block_id: BlockId) -> None:
        self._meta.pop(block_id, None)
        self._outside.forget(block_id)

    def _skips(self, block_id: BlockId) -> bool:
        """Whether sampled shadows leave this id out (they see one id in ``sample_rate``)."""
        return bool((((block_id * _SAMPLE_MULTIPLIER) & _MASK_64) >> 32) % self.sample_rate)

    def _observe(self, block_id: BlockId, meta: BlockMeta, now: float, *, hit: bool) -> None:
        """One access of the stream: every shadow replays it, then the leader may change."""
        if self.sample_rate > 1 and self._skips(block_id):
            return
        self._accesses += 1
        prefix, arc, lru = self._shadows
        hits = (
            prefix.access(block_id, meta, now),
            arc.access(block_id, meta, now),
            lru.access(block_id, meta, now),
        )
        self._track_outside((block_id,), _ALL_SHADOWS)
        self._tally(*hits, hit)

    def _track_outside(self, block_ids: Sequence[BlockId], shadows: Iterable[int]) -> None:
        """After ``shadows`` (indices) replayed ``block_ids``: which real resident blocks each one lacks."""
        resident, sampled = self._meta, self.sample_rate > 1
        for index in shadows:
            shadow = self._shadows[index]
            victims = shadow.victims
            if sampled:  # a sampled shadow's contents are not the real cache's
                victims.clear()
                continue
            outside = self._outside.lists[index]
            if victims:
                for victim in victims:
                    if victim in resident:
                        self._outside.add(index, victim)
                victims.clear()
            held = shadow.parent_of
            for block_id in block_ids:
                if block_id in outside:
                    if block_id in held:
                        del outside[block_id]
                elif block_id not in held:  # the shadow had no room it could free
                    self._outside.add(index, block_id)

    def _tally(self, prefix_hit: bool, arc_hit: bool, lru_hit: bool, hit: bool) -> None:
        """Count one access's hits in the arms (the three shadows, then the real cache); maybe switch."""
        self._weight /= self._decay  # a hit now weighs 1 / decay more than one an access ago
        weight = self._weight
        wins = self._wins
        if prefix_hit is hit and arc_hit is hit and lru_hit is hit:  # no arm differs: only hit counts
            if hit:
                for i, row in enumerate(wins):
                    row[i] += weight
            if weight > _RESCALE_AT:
                self._rescale()
            return
        hits = (prefix_hit, arc_hit, lru_hit, hit)
        totals = self._totals
        for i, hit_i in enumerate(hits):
            if hit_i:
                row, total_row = wins[i], totals[i]
                for j, hit_j in enumerate(hits):
                    if i == j or not hit_j:  # the diagonal counts the arm's own hits
                        row[j] += weight
                        if i != j:
                            total_row[j] += 1
        if weight > _RESCALE_AT:
            self._rescale()
        self.leader = self._next_leader()

    def _tally_all_hit(self, num_accesses: int) -> None:
        """``_tally(True, True, True, True)`` ``num_accesses`` times: the same float operations, in locals."""
        wins, decay, weight = self._wins, self._decay, self._weight
        hits = [wins[i][i] for i in range(len(wins))]
        prefix_hits, arc_hits, lru_hits, real_hits = hits
        for _ in range(num_accesses):
            weight /= decay
            prefix_hits += weight
            arc_hits += weight
            lru_hits += weight
            real_hits += weight
            if weight > _RESCALE_AT:
                for i, count in enumerate((prefix_hits, arc_hits, lru_hits, real_hits)):
                    wins[i][i] = count
                self._weight = weight
                self._rescale()
                weight = self._weight
                prefix_hits, arc_hits, lru_hits, real_hits = (wins[i][i] for i in range(len(wins)))
        for i, count in enumerate((prefix_hits, arc_hits, lru_hits, real_hits)):
            wins[i][i] = count
        self._weight = weight

    def _next_leader(self) -> int:
        """The usual rule's leader, unless the guard over the whole trace says otherwise."""
        usual = self._usual_leader()
        if self._accesses < self._guard_after:
            return usual
        target = self._guard_target()
        if not self._proven(target, self.REAL_ARM):  # the real cache is not behind the target
            return usual
        leader = self.leader
        if leader == target:  # stay, unless another expert beats the target over the whole trace
            return usual if usual != target and self._proven(usual, target) else target
        return target if self._proven(target, leader) else usual

    def _guard_target(self) -> int:
        """The better of ARC and LRU over the whole trace: the other takes over on a significant lead."""
        target = self.target
        for i in self.GUARD_EXPERTS:
            if i != target and self._proven(i, target):
                self.target = i
        return self.target

    def _proven(self, i: int, j: int) -> bool:
        """McNemar's test (``switch_z``) on the whole trace's accesses where one of arms i and j hit."""
        wins, losses = self._totals[i][j], self._totals[j][i]
        lead = wins - losses
        return lead > 0 and lead * lead > self.switch_z**2 * (wins + losses)

    def _usual_leader(self) -> int:
        """The expert whose shadow beats both the leader's shadow and the real cache by the most."""
        wins, leader, real = self._wins, self.leader, len(self._shadows)
        best, best_lead = leader, 0.0
        for i in range(real):
            lead = wins[i][leader] - wins[leader][i]
            if i != leader and lead > best_lead and self._beats(i, leader) and self._beats(i, real):
                best, best_lead = i, lead
        return best

    def _beats(self, i: int, j: int) -> bool:
        """McNemar's test on the accesses where exactly one of arms ``i`` and ``j`` hit (decayed)."""
        wins, losses = self._wins[i][j], self._wins[j][i]
        lead = wins - losses
        if lead <= 0:
            return False
        # In real units (counts / weight): lead² > z² × (wins + losses), and lead > margin × j's hits.
        return (
            lead > self.switch_margin * self._wins[j][j]
            and lead * lead > self.switch_z**2 * (wins + losses) * self._weight
        )

    def _rescale(self) -> None:
        weight = self._weight
        for row in self._wins:
            row[:] = [count / weight for count in row]
        self._weight = 1.0
