"""The dedicated owners' Redis reservations, as every worker of one model sharing the Redis sees them.

The quotas (each a partition of the Redis budget that others' writes never evict) are max-min fair shares
of half the budget among the owners asking. Computed from one worker's requests alone, workers granting
different dedicated tenants each gave away their own half: two of them held 1.5 times the budget between
them. So every worker records what it asks for in Redis itself (``<prefix>:~requests``, one field per
worker and namespace, each with a lease in ``<prefix>:~requests:leases``) and grants from the whole
table: what an owner asks is the most any live worker asks for it. A worker renews its leases whenever it
syncs (on its writer thread, at least every ``sync_s`` while it writes or idles); a worker gone for a
lease (``lease_s``) no longer counts, and the partitions its owners lose are trimmed by the next worker
that notices. Every partition written is marked in ``<prefix>:~partitions``, so a partition no live
request names is emptied even by a worker that never saw the request (its owner's worker died before this
one started). Time is Redis's own (``TIME``), so workers' clocks need not agree.
"""

from __future__ import annotations

import os
import threading
import time

import redis

# KEYS[1]: hash '<worker id>|<namespace>' -> bytes asked; KEYS[2]: sorted set of those fields by lease end;
# KEYS[3]: set of the namespaces that have a partition (``mark_partitions``). ARGV[1]: lease (ms);
# ARGV[2]: '<worker id>|'; ARGV[3]: a partition's key prefix less its namespace; then this worker's whole
# table, namespace and bytes pairs. Drops lapsed leases and this worker's fields it no longer lists, renews
# its own; forgets the partitions no live request names that are empty (their books deleted). Returns the
# table and the namespaces of the partitions no live request names that still hold keys (to empty).
_SYNC_SCRIPT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
for _, field in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('HDEL', KEYS[1], field)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local mine = {}
for i = 4, #ARGV, 2 do mine[ARGV[2] .. ARGV[i]] = ARGV[i + 1] end
for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
  if string.sub(field, 1, #ARGV[2]) == ARGV[2] and mine[field] == nil then
    redis.call('HDEL', KEYS[1], field)
    redis.call('ZREM', KEYS[2], field)
  end
end
for field, num_bytes in pairs(mine) do
  redis.call('HSET', KEYS[1], field, num_bytes)
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), field)
end
local requests = redis.call('HGETALL', KEYS[1])
local live = {}
for i = 1, #requests, 2 do
  local bar = string.find(requests[i], '|', 1, true)
  if bar then live[string.sub(requests[i], bar + 1)] = true end
end
local orphans = {}
for _, namespace in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  if not live[namespace] then
    local part = ARGV[3] .. namespace
    if redis.call('ZCARD', part .. ':lru') == 0 then
      redis.call('DEL', part .. ':lru', part .. ':sizes', part .. ':bytes')
      redis.call('SREM', KEYS[3], namespace)
    else
      orphans[#orphans + 1] = namespace
    end
  end
end
return {requests, orphans}
"""


class SharedRequests:
    """This worker's reservation requests and the other live workers' (as of the last ``sync``)."""

    def __init__(
        self, client: redis.Redis, prefix: str, *, sync_s: float = 1.0, lease_s: float = 60.0
    ) -> None:
        self.worker_id = os.urandom(8).hex()
        self.keys = [f"{prefix}:~requests", f"{prefix}:~requests:leases", f"{prefix}:~partitions"]
        self.partition_prefix = f"{prefix}:~quota:"  # + '<namespace>:lru' (and ':sizes', ':bytes')
        self.sync_s, self.lease_ms = sync_s, int(lease_s * 1000)
        self.mine: dict[str, int] = {}  # namespace -> bytes this worker asks for (engine thread writes)
        self.others: dict[str, int] = {}  # namespace -> the most another live worker asks for
        self._script = client.register_script(_SYNC_SCRIPT)
        self._lock = threading.Lock()
        self._due = 0.0  # monotonic time of the next sync (0: now: ``mine`` changed since the last)

    def ask(self, namespace_id: str, num_bytes: int) -> bool:
        """Record this worker's request (0: none any more); False when it is unchanged."""
        with self._lock:
            if self.mine.get(namespace_id, 0) == max(0, num_bytes):
                return False
            if num_bytes > 0:
                self.mine[namespace_id] = num_bytes
            else:
                self.mine.pop(namespace_id, None)
            self._due = 0.0
            return True

    def asked(self) -> dict[str, int]:
        """What each owner asks for, every live worker together (this worker's latest, others' as synced)."""
        with self._lock:
            merged = dict(self.others)
            for namespace_id, num_bytes in self.mine.items():
                merged[namespace_id] = max(merged.get(namespace_id, 0), num_bytes)
            return merged

    @property
    def due(self) -> bool:
        return time.monotonic() >= self._due

    def sync(self) -> list[str]:
        """Publish this worker's requests, renew their leases and read the others' (one round trip; writer
        thread); returns the namespaces whose partitions no live worker asks for but still hold keys (the
        caller empties them: a worker that died with its partition full leaves it to whoever syncs next).
        Raises redis errors (the caller pauses the tier)."""
        with self._lock:
            pairs = [part for item in sorted(self.mine.items()) for part in item]
            self._due = time.monotonic() + self.sync_s
        mark = f"{self.worker_id}|"
        try:
            flat, orphans = self._script(
                keys=self.keys, args=[self.lease_ms, mark, self.partition_prefix, *pairs]
            )
        except BaseException:
            self._due = 0.0
            raise
        others: dict[str, int] = {}
        for field, value in zip(flat[0::2], flat[1::2], strict=True):
            text = field.decode() if isinstance(field, bytes) else field
            if not text.startswith(mark):
                namespace_id = text.partition("|")[2]
                others[namespace_id] = max(others.get(namespace_id, 0), int(value))
        with self._lock:
            self.others = others
        return [ns.decode() if isinstance(ns, bytes) else ns for ns in orphans]
