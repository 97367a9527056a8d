"""Shares the workers' KV-event streams between gateway replicas through Redis.

For each worker, one replica holds a lease (``SET NX PX``, renewed while it follows) and is the only one
that long-polls that worker; it appends every batch it applies to a Redis stream (bounded, ~newest
``max_batches``), only while it still holds the lease (checked and appended in one script): a leader whose
poll outlived its lease does not append its late batch after the next leader's. The other replicas read
the stream into their own ``PrefixIndex``, so every replica routes on the same picture and a worker serves
one event consumer, not one per replica. When the leader goes away its lease expires and another replica
takes over from the last batch it read (the worker replays from that sequence number). A broken worker
stream is published as a ``dropped`` marker, so every replica forgets that worker at once.
"""

from __future__ import annotations

from typing import Any

import blake3
import orjson

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# Appends a batch only for the lease holder: ARGV = replica id, max stream length, the batch.
_PUBLISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return false
end
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'b', ARGV[3])
"""


class RedisKVRelay:
    def __init__(
        self,
        redis_url: str,
        *,
        replica_id: str,
        lease_ms: int = 5000,
        max_batches: int = 10_000,
        key_prefix: str = "prefixgate:kv",
        timeout_s: float = 5.0,
    ) -> None:
        import redis.asyncio as redis

        self._redis = redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=1.0)
        self._renew = self._redis.register_script(_RENEW)
        self._publish = self._redis.register_script(_PUBLISH)
        self.replica_id = replica_id
        self.lease_ms = lease_ms
        self._max_batches = max_batches
        self._prefix = key_prefix

    def _keys(self, url: str) -> tuple[str, str]:
        digest = blake3.blake3(url.encode()).hexdigest()[:24]
        return f"{self._prefix}:{digest}:lease", f"{self._prefix}:{digest}:events"

    async def lead(self, url: str) -> bool:
        """Take or renew the lease on following ``url``; True while this replica holds it."""
        lease, _ = self._keys(url)
        if await self._redis.set(lease, self.replica_id, nx=True, px=self.lease_ms):
            return True
        return bool(await self._renew(keys=[lease], args=[self.replica_id, self.lease_ms]))

    async def release(self, url: str) -> None:
        lease, _ = self._keys(url)
        if (await self._redis.get(lease)) == self.replica_id.encode():
            await self._redis.delete(lease)

    async def publish(self, url: str, batch: dict[str, Any]) -> str | None:
        """Append one applied batch (or ``{"dropped": true}``) while this replica holds the lease; returns
        its stream id, or None when the lease is another replica's (or expired): nothing was appended."""
        lease, stream = self._keys(url)
        entry_id = await self._publish(
            keys=[lease, stream], args=[self.replica_id, self._max_batches, orjson.dumps(batch)]
        )
        return None if entry_id is None else entry_id.decode()

    async def read(
        self, url: str, after_id: str, *, block_ms: int | None
    ) -> list[tuple[str, dict[str, Any]]]:
        """Batches after ``after_id`` ("0": from the oldest kept); waits up to ``block_ms`` for one."""
        _, stream = self._keys(url)
        answer = await self._redis.xread({stream: after_id}, count=256, block=block_ms)
        return [
            (entry_id.decode(), orjson.loads(fields[b"b"]))
            for _, entries in answer
            for entry_id, fields in entries
        ]

    async def close(self) -> None:
        await self._redis.aclose()
