"""Remote tier: KV blocks in Redis, shared by every worker of one model.

Keys are ``pg:kv:<fingerprint[:16]>:<namespace_id>:<block hash>``, so the namespace and the model travel
with every block; the value is a one-block entry (``worker.tiers.entry``), verified on read (fingerprint,
namespace, hash, tokens, checksum). The byte budget is enforced by an LRU kept in Redis itself (a sorted set
of keys by last use and a hash of their sizes, trimmed atomically by a Lua script on every write) plus a
TTL. Every call has a short timeout; an error or timeout is a miss and pauses the tier for a few seconds,
so a slow or stopped Redis never fails a request.

KV events (``remote``): the blocks this worker writes (and re-reads, which refreshes their TTL), and the
keys its writes evict, its reads find damaged or its purges erase. Every worker of one model sharing
this Redis reports the same tier id (``identify``: a random id stored in Redis by the first one), so the
gateway credits a block announced by one of them to all of them.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence

import redis
import torch

from policies.fair_share import max_min_shares
from policies.hashing import BlockHash
from worker.kv_events import TierEvents
from worker.tiers.at_rest import AtRestCipher
from worker.tiers.codec import Codec, entry_codec, get_codec
from worker.tiers.entry import BlockRecord, CorruptEntry, decode_header, encode_entry, payloads
from worker.tiers.host import DemotedBlock
from worker.tiers.remote_quotas import SharedRequests

log = logging.getLogger("prefixgate.worker.remote")


def _evict_oldest(lru: str, sizes: str, total: str, limit: str) -> str:
    """Lua: pop the oldest keys of the LRU ``lru`` (their sizes in hash ``sizes``, counted in ``total``)
    while the local ``total`` is over ``limit``; the victims go into the local ``evicted``."""
    return f"""local evicted = {{}}
while total > tonumber({limit}) do
  local victim = redis.call('ZPOPMIN', {lru}, 1)[1]
  if victim == nil then break end
  local size = tonumber(redis.call('HGET', {sizes}, victim)) or 0
  redis.call('HDEL', {sizes}, victim)
  redis.call('DEL', victim)
  total = redis.call('DECRBY', {total}, size)
  evicted[#evicted + 1] = victim
end
"""


_PUT_SCRIPT = (
    """
local old = redis.call('HGET', KEYS[3], KEYS[1])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], string.len(ARGV[1]))
local total = redis.call('INCRBY', KEYS[4], string.len(ARGV[1]) - (tonumber(old) or 0))
"""
    + _evict_oldest("KEYS[2]", "KEYS[3]", "KEYS[4]", "ARGV[4]")
    + "return evicted\n"
)
_TOUCH_SCRIPT = """
local kept = 0
for i = 1, #KEYS, 2 do
  if redis.call('PEXPIRE', KEYS[i], ARGV[1]) == 0 then break end
  redis.call('ZADD', KEYS[i + 1], ARGV[1 + (i + 1) / 2], KEYS[i])
  kept = kept + 1
end
return kept
"""
_TRIM_SCRIPT = (
    """
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
"""
    + _evict_oldest("KEYS[1]", "KEYS[2]", "KEYS[3]", "ARGV[1]")
    + "return evicted\n"
)
# A purge erases a chunk of a namespace's keys in one call (a round trip per chunk, not two per key):
# each key is deleted and unbooked from every LRU it may be booked in (the shared one and the owner's
# partition: KEYS[1 .. 3 * ARGV[1]], three keys per book), its size taken off that book's byte count.
_ERASE_SCRIPT = """
local num_books = tonumber(ARGV[1])
local erased = {}
for i = 3 * num_books + 1, #KEYS do
  local key = KEYS[i]
  if redis.call('DEL', key) == 1 then erased[#erased + 1] = key end
  for b = 0, num_books - 1 do
    local size = redis.call('HGET', KEYS[3 * b + 2], key)
    if size then
      redis.call('HDEL', KEYS[3 * b + 2], key)
      redis.call('DECRBY', KEYS[3 * b + 3], size)
    end
    redis.call('ZREM', KEYS[3 * b + 1], key)
  end
end
return erased
"""
PURGE_SCAN_COUNT = 1000  # keys SCAN looks at per call
PURGE_CHUNK_KEYS = 256  # keys one erase call takes (Redis runs a script alone: keep each one short)
# A quota partition whose quota shrank (another dedicated owner asked) or went is trimmed to its new quota
# (0: emptied) before this worker's next write, as the put script trims: oldest first.

# A read refreshes the TTL and LRU rank of the run it found, in order, up to the first key that is gone
# (purged or evicted since the read): a vanished key is never booked in the LRU again nor announced.

# Eviction takes one victim at a time, just enough to fit the budget: the oldest first and, among the
# blocks of one write, the deepest first (a chain's tail is useless without its head, never the reverse).
# The score is the write time in ms plus a fraction that falls with the block's depth in its chain.

ERRORS = (redis.RedisError, OSError)
_HEX = re.compile(r"(?:[0-9a-f]{2})+")


def _score(now_ms: int, position: int) -> str:
    """The LRU score of a block written at ``now_ms``: later writes score higher, and so do the shallower
    blocks of one write (1/1024 ms apart: exact in a double until the year 2109)."""
    return repr(now_ms + (1023 - min(max(position, 0), 1023)) / 1024)


class RemoteUnavailable(RuntimeError):
    """Redis failed during an operation that must not silently succeed (purge)."""


class RemoteTier:
    def __init__(
        self,
        url: str,
        *,
        fingerprint: bytes,
        codec: str,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        budget_bytes: int,
        ttl_s: float,
        timeout_s: float,
        pause_after_error_s: float = 5.0,
        cipher: AtRestCipher | None = None,
        events: TierEvents | None = None,
        reservation_sync_s: float = 1.0,
        reservation_lease_s: float = 60.0,
    ) -> None:
        self.events = events
        self.tier_id: str | None = None  # shared by every worker of this model on this Redis (identify)
        self.cipher = cipher  # entries sealed per namespace (AES-GCM) when set
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.fingerprint = fingerprint
        self.codec = get_codec(codec)
        self.block_shape = block_shape
        self.dtype = dtype
        self.budget_bytes = budget_bytes
        self.ttl_ms = int(ttl_s * 1000)
        self.pause_after_error_s = pause_after_error_s
        self.prefix = f"pg:kv:{fingerprint.hex()[:16]}"
        self._lru, self._sizes, self._total = (
            f"{self.prefix}:lru",
            f"{self.prefix}:sizes",
            f"{self.prefix}:bytes",
        )
        self._put = self.client.register_script(_PUT_SCRIPT)
        self._touch = self.client.register_script(_TOUCH_SCRIPT)
        self._trim = self.client.register_script(_TRIM_SCRIPT)
        self._erase = self.client.register_script(_ERASE_SCRIPT)
        # Held from a read's TTL refresh to its "stored" events, and from a purge's delete to its "removed"
        # events: this worker never announces a block stored after it announced its purge.
        self._announce_lock = threading.Lock()
        # Dedicated namespaces' requests, this worker's and the other workers' (kept in Redis): the quotas
        # are granted from all of them, so workers together never reserve more than half the budget.
        self.requests = SharedRequests(
            self.client, self.prefix, sync_s=reservation_sync_s, lease_s=reservation_lease_s
        )
        self._quotas: dict[str, int] = {}  # dedicated namespace -> bytes of its own LRU partition (granted)
        self._shrunk: set[str] = set()  # partitions to trim to their (smaller) quota before the next write
        self._quota_lock = threading.Lock()
        self._down_until = 0.0
        self.counters: Counter[str] = Counter()
        self._bound_events()

    def _bound_events(self) -> None:
        """Redis expires blocks and other workers' writes evict them unannounced: this worker's record of
        the tier (its KV-event state) keeps a block no longer than its TTL, and no more blocks than the
        budget and the dedicated partitions hold (a block's payload alone: an upper bound)."""
        if self.events is not None:
            per_block = self.codec.payload_bytes(self.block_shape, self.dtype)
            max_blocks = (self.budget_bytes + sum(self._quotas.values())) // max(1, per_block)
            self.events.bound(ttl_s=self.ttl_ms / 1000, max_blocks=max_blocks)

    def key(self, namespace_id: str, block_hash: BlockHash) -> str:
        return f"{self.prefix}:{namespace_id}:{block_hash.hex()}"

    def identify(self) -> str | None:
        """The tier id shared by every worker of this model using this Redis (None while unreachable).

        The first worker to ask stores a random id (``SET NX``); the others read it. A block one of them
        announces is reachable by all of them, so the gateway credits it to every worker with this id.
        """
        if self.tier_id is None and self.available:
            key = f"{self.prefix}:tier-id"
            try:  # one round trip
                _, raw = (
                    self.client.pipeline(transaction=False)
                    .set(key, os.urandom(12).hex(), nx=True)
                    .get(key)
                    .execute()
                )
            except ERRORS as exc:  # asked again on the next write; the data path decides about pausing
                self.counters["identify_errors_total"] += 1
                log.info("remote KV tier id not read yet: %s", exc)
                return None
            self.tier_id = raw.decode() if raw else None
        return self.tier_id

    def _announce_removed(self, keys: Sequence[bytes | str]) -> None:
        if self.events is not None:
            self.events.removed(_hash_of(key) for key in keys)

    def _missed(self, block_hashes: Sequence[BlockHash], read_at: float) -> None:
        """A read found these blocks gone: those this worker announced (and not again since the read
        began) are announced removed, so the gateways stop crediting them before their TTL."""
        if self.events is not None:
            self.events.missed(block_hashes, read_at=read_at)

    def set_reservation(self, namespace_id: str, num_bytes: int) -> None:
        """Ask for a dedicated owner's own LRU partition of up to ``num_bytes`` (0: none any more), which
        others' writes never evict (engine thread: no Redis I/O; the writer publishes it).

        The quotas granted are max-min fair shares of half the budget among the owners asking, on every
        worker of this model sharing the Redis (``remote_quotas``), and the shared LRU keeps the rest:
        quotas and shared limit together never exceed ``budget_bytes``. A partition whose quota shrinks or
        goes is trimmed before the next write.
        """
        self.set_reservations({namespace_id: num_bytes})

    def set_reservations(self, num_bytes_by_namespace: Mapping[str, int]) -> None:
        """``set_reservation`` for many owners at once (the quotas granted once)."""
        changed = [self.requests.ask(ns, num_bytes) for ns, num_bytes in num_bytes_by_namespace.items()]
        if any(changed):  # (every request of a dedicated tenant sets it again)
            self._grant()

    def sync_reservations(self) -> None:
        """Publish this worker's requests and read the other workers' when due (writer thread; at most
        every ``reservation_sync_s`` unless this worker's requests changed). Raises redis errors."""
        if self.requests.due:
            self._grant(orphaned=self.requests.sync())

    def renew_reservations(self) -> None:
        """While this worker writes nothing (writer thread, idle): renew its requests' leases, so other
        workers keep counting them; errors pause the tier as a write's would."""
        if not self.requests.mine or not self.available:
            return
        try:
            orphaned = self.requests.sync()
        except ERRORS as exc:
            self._failed(exc)
            return
        self._grant(orphaned=orphaned)

    def _grant(self, orphaned: Sequence[str] = ()) -> None:
        """Grant the quotas from every live worker's requests; the partitions whose quota shrank or went,
        and those no live request names (``orphaned``: left by a worker that died), are trimmed before the
        next write (to their quota; 0: emptied)."""
        with self._quota_lock:
            before, self._quotas = self._quotas, max_min_shares(self.requests.asked(), self.budget_bytes // 2)
            self._shrunk |= {ns for ns, quota in before.items() if self._quotas.get(ns, 0) < quota}
            self._shrunk |= set(orphaned)
        if self._quotas != before:
            self._bound_events()

    def _partition(self, namespace_id: str) -> list[str]:
        part = f"{self.prefix}:~quota:{namespace_id}"
        return [f"{part}:lru", f"{part}:sizes", f"{part}:bytes"]

    def _accounting(self, namespace_id: str) -> tuple[list[str], int]:
        """(LRU set, sizes hash, byte counter) keys and the budget that a namespace's blocks count against:
        its partition's quota, or for the others the shared LRU's limit (the budget less the quotas)."""
        quota = self._quotas.get(namespace_id)
        if quota is None:
            return [self._lru, self._sizes, self._total], self.budget_bytes - sum(self._quotas.values())
        return self._partition(namespace_id), quota

    def _trim_shrunk(self) -> list[bytes]:
        """Trim the partitions whose quota shrank or went to their quota now; returns the keys evicted."""
        with self._quota_lock:  # set_reservation runs on the engine thread, writes on the writer thread
            pending, self._shrunk = self._shrunk, set()
        evicted: list[bytes] = []
        try:
            for namespace_id in sorted(pending):
                evicted += self._trim(
                    keys=self._partition(namespace_id), args=[self._quotas.get(namespace_id, 0)]
                )
        except ERRORS:
            with self._quota_lock:
                self._shrunk |= pending  # trimmed again (a trim is idempotent) once Redis is back
            raise
        return evicted

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, exc: Exception) -> None:
        self.counters["errors_total"] += 1
        self._down_until = time.monotonic() + self.pause_after_error_s
        log.warning("remote KV tier unavailable for %.0f s: %s", self.pause_after_error_s, exc)

    def put(self, blocks: Sequence[DemotedBlock]) -> int:
        """Store blocks (writer thread); returns how many were written."""
        if not blocks or not self.available:
            return 0
        self.identify()
        payloads = self.codec.encode(torch.stack([b.data for b in blocks]))
        now_ms = int(time.time() * 1000)
        try:
            self.sync_reservations()
            trimmed = self._trim_shrunk() if self._shrunk else []
            pipe = self.client.pipeline(transaction=False)
            partitioned: set[str] = set()  # the namespaces written to a partition of their own
            for block, data in zip(blocks, payloads, strict=True):
                entry = encode_entry(
                    fingerprint=self.fingerprint,
                    namespace_id=block.namespace_id,
                    codec=self.codec.name,
                    dtype=str(self.dtype).removeprefix("torch."),
                    block_shape=self.block_shape,
                    blocks=[block.record],
                    payloads=[data],
                )
                if self.cipher is not None:
                    entry = self.cipher.seal(block.namespace_id, entry)
                accounting, budget = self._accounting(block.namespace_id)
                if accounting[0] != self._lru:
                    partitioned.add(block.namespace_id)
                keys = [self.key(block.namespace_id, block.record.block_hash), *accounting]
                self._put(
                    keys=keys, args=[entry, self.ttl_ms, _score(now_ms, block.position), budget], client=pipe
                )
            if partitioned:  # after the writes: a sync emptying it in between still finds its mark
                pipe.sadd(self.requests.keys[2], *sorted(partitioned))
            evicted = pipe.execute()[: len(blocks)]
        except ERRORS as exc:
            self._failed(exc)
            return 0
        self.counters["blocks_written_total"] += len(blocks)
        evicted.append(trimmed)
        self.counters["blocks_evicted_total"] += sum(len(keys) for keys in evicted)
        if self.events is not None:
            for block in blocks:
                self.events.stored(block.namespace_id, [block.record])
            self._announce_removed([key for keys in evicted for key in keys])
        return len(blocks)

    def get_run(
        self,
        namespace_ids: Sequence[str],
        hashes: Sequence[BlockHash],
        token_blocks: Sequence[Sequence[int]],
        *,
        batch: int = 16,
    ) -> tuple[list[BlockRecord], torch.Tensor | None]:
        """The longest run of ``hashes`` stored remotely, decoded; ([], None) on a miss or an error."""
        records: list[BlockRecord] = []
        chunks: list[tuple[Codec, bytes]] = []  # verified payloads, each with the codec it was written in
        if not self.available:
            return records, None
        read_at = self.events.now() if self.events is not None else 0.0
        try:
            for start in range(0, len(hashes), batch):
                keys = [
                    self.key(ns, h)
                    for ns, h in zip(
                        namespace_ids[start : start + batch], hashes[start : start + batch], strict=True
                    )
                ]
                values = self.client.mget(keys)
                found = 0
                for offset, value in enumerate(values):
                    k = start + offset
                    if value is None:  # gone (evicted, expired, Redis flushed): no longer credited
                        self._missed([hashes[start + i] for i, v in enumerate(values) if v is None], read_at)
                        break
                    try:
                        if self.cipher is not None:
                            _, value = self.cipher.open(value)
                        header = decode_header(value, fingerprint=self.fingerprint)
                        record = header.blocks[0]
                        if (
                            header.namespace_id != namespace_ids[k]
                            or record.block_hash != hashes[k]
                            or record.token_ids != tuple(token_blocks[k])
                        ):
                            raise CorruptEntry("entry does not match its key")
                        # Layout and payload size checked here, so the decode below cannot fail.
                        codec = entry_codec(header, self.block_shape, self.dtype)  # maybe not self.codec
                        chunks.append((codec, bytes(payloads(value, header, 0, 1))))
                    except CorruptEntry as exc:
                        log.warning("dropping damaged remote KV entry %s: %s", keys[offset], exc)
                        self.client.delete(keys[offset])
                        self.counters["corrupt_deleted_total"] += 1
                        self._announce_removed([keys[offset]])
                        break
                    records.append(record)
                    found += 1
                if found:
                    refreshed = self._refresh(
                        keys[:found], namespace_ids[start : start + found], records[-found:], start
                    )
                    if refreshed < found:  # purged or evicted since the read: the run ends there
                        self._missed([hashes[start + refreshed]], read_at)
                        del records[len(records) - found + refreshed :]
                        del chunks[len(chunks) - found + refreshed :]
                        found = refreshed
                        break
                if found < len(keys):
                    break
        except ERRORS as exc:
            self._failed(exc)
            return [], None
        if not records:
            return records, None
        self.counters["blocks_read_total"] += len(records)
        return records, self._decode(chunks)

    def _refresh(
        self, keys: Sequence[str], namespace_ids: Sequence[str], records: Sequence[BlockRecord], depth: int
    ) -> int:
        """Refresh the TTL and LRU rank of a run just read (``depth``: the first one's place in its chain)
        and announce it again (the gateway keeps crediting it); returns how many of ``keys``, from the
        first, still existed: only those are refreshed and announced."""
        now_ms = int(time.time() * 1000)
        books = [
            part
            for key, ns in zip(keys, namespace_ids, strict=True)
            for part in (key, self._accounting(ns)[0][0])
        ]
        scores = [_score(now_ms, depth + k) for k in range(len(keys))]
        with self._announce_lock:
            refreshed = int(self._touch(keys=books, args=[self.ttl_ms, *scores]))
            if self.events is not None:
                for namespace_id, record in zip(namespace_ids[:refreshed], records, strict=False):
                    self.events.stored(namespace_id, [record])
        return refreshed

    def _decode(self, chunks: Sequence[tuple[Codec, bytes]]) -> torch.Tensor:
        """Blocks from verified payloads: one batched decode per run of entries of one codec."""
        parts = []
        for codec, run in itertools.groupby(chunks, key=lambda chunk: chunk[0]):
            payload = [data for _, data in run]
            parts.append(
                codec.decode(bytearray(b"".join(payload)), len(payload), self.block_shape, self.dtype)
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def purge(self, namespace_id: str) -> int:
        """Delete every block of ``namespace_id``, of this model and of any other model sharing this Redis
        (blocks a tenant cached before a model upgrade would otherwise stay until their TTL); returns how
        many.

        Raises:
            RemoteUnavailable: Redis failed part-way; some blocks may remain (a retry is safe).
        """
        erased = 0
        cursor = 0
        try:
            while True:  # one SCAN call per page, one erase call per model and chunk of the keys it found
                cursor, found = self.client.scan(
                    cursor, match=f"pg:kv:*:{_glob_escape(namespace_id)}:*", count=PURGE_SCAN_COUNT
                )
                by_model: dict[str, list] = {}
                for key in found:  # not "<ns>:x:<hash>" of namespace "<ns>:x", nor the books
                    prefix = _model_prefix(key, namespace_id)
                    if prefix is not None:
                        by_model.setdefault(prefix, []).append(key)
                for prefix, keys in by_model.items():
                    part = f"{prefix}:~quota:{namespace_id}"  # the block may be booked in either LRU
                    books = [f"{prefix}:lru", f"{prefix}:sizes", f"{prefix}:bytes"]
                    books += [f"{part}:lru", f"{part}:sizes", f"{part}:bytes"]
                    for start in range(0, len(keys), PURGE_CHUNK_KEYS):
                        with self._announce_lock:
                            gone = self._erase(
                                keys=[*books, *keys[start : start + PURGE_CHUNK_KEYS]], args=[2]
                            )
                            if prefix == self.prefix:  # another model's blocks are not in our events
                                self._announce_removed(gone)
                        erased += len(gone)
                if not cursor:
                    break
        except ERRORS as exc:
            self._failed(exc)
            raise RemoteUnavailable(f"Redis failed after erasing {erased} blocks: {exc}") from exc
        return erased

    def stats(self) -> dict[str, int]:
        return {"available": int(self.available), "budget_bytes": self.budget_bytes, **self.counters}


def _glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis glob (SCAN MATCH): a namespace id may not widen a purge."""
    return re.sub(r"([*?\[\]\\^])", r"\\\1", text)


def _is_block_key(key: bytes | str, head: str) -> bool:
    """Whether ``key`` is ``head`` followed by a block hash (not a key of another namespace or the books)."""
    text = key.decode() if isinstance(key, bytes) else key
    return text.startswith(head) and _HEX.fullmatch(text[len(head) :]) is not None


_MODEL_PREFIX = re.compile(r"pg:kv:[0-9a-f]{1,16}(?=:)")  # "pg:kv:<fingerprint>" of any model


def _model_prefix(key: bytes | str, namespace_id: str) -> str | None:
    """The model prefix of ``key`` when it is a block key of ``namespace_id`` (of any model), else None."""
    text = key.decode() if isinstance(key, bytes) else key
    found = _MODEL_PREFIX.match(text)
    if found is None or not _is_block_key(text, f"{found.group()}:{namespace_id}:"):
        return None
    return found.group()


def _hash_of(key: bytes | str) -> BlockHash:
    """The block hash at the end of a block key (``…:<namespace_id>:<hash hex>``)."""
    text = key.decode() if isinstance(key, bytes) else key
    return BlockHash(bytes.fromhex(text.rsplit(":", 1)[1]))
