"""``PromotionCounter`` in Redis, so that gateway replicas count hot prefixes together.

Same semantics as ``policies.promotion.SlidingWindowCounter``: a one-hour window of one-minute
buckets and at most ``max_tenants`` tenant tags per prefix (the least recently seen goes first).
Per prefix, two keys:

- ``<prefix>:<digest>:h``, a hash of ``<tenant tag>|<bucket index>`` → hits (``HINCRBY``), so each
  tenant's hits can be capped at its share (``max_hits_per_tenant_per_hour``);
- ``<prefix>:<digest>:t``, a sorted set of tenant tag → last bucket seen.

One Lua script per request does everything for all of the request's prefixes atomically: drop the
buckets and tags that left the window, count the hit, cap the tags, refresh both TTLs (one window)
and return hits and tenant counts. Keys expire an hour after a prefix's last hit, which bounds memory.

``<digest>`` is a keyed blake3 of the prefix hash under the deployment's namespace salt: a global-form
hash can be recomputed by anyone who guesses the text, the digest cannot, so reading Redis does not
confirm guesses about what tenants send. Every call has a short timeout; errors propagate (the
gateway pauses promotion and serves the request as usual).
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import blake3

from policies.promotion import (
    HOUR_S,
    MIN_TENANTS_FLOOR,
    PrefixHash,
    PrefixStats,
    TenantTag,
    hits_cap,
)

_SCRIPT = """
local bucket = tonumber(ARGV[1])
local oldest = bucket - tonumber(ARGV[2])
local ttl_s = tonumber(ARGV[3])
local max_tenants = tonumber(ARGV[4])
local tag = ARGV[5]
local cap = tonumber(ARGV[6])
local out = {}
for i = 1, #KEYS, 2 do
  local hits_key, tenants_key = KEYS[i], KEYS[i + 1]
  redis.call('ZREMRANGEBYSCORE', tenants_key, '-inf', oldest)
  local fields = redis.call('HGETALL', hits_key)
  local per = {}
  for j = 1, #fields, 2 do
    local who, b = string.match(fields[j], '^(.*)|(%d+)$')
    if tonumber(b) <= oldest then
      redis.call('HDEL', hits_key, fields[j])
    else
      per[who] = (per[who] or 0) + tonumber(fields[j + 1])
    end
  end
  if tag ~= '' then
    redis.call('HINCRBY', hits_key, tag .. '|' .. bucket, 1)
    per[tag] = (per[tag] or 0) + 1
    local seen = redis.call('ZSCORE', tenants_key, tag)
    if not seen and redis.call('ZCARD', tenants_key) >= max_tenants then
      local gone = redis.call('ZPOPMIN', tenants_key)[1]
      per[gone] = nil
      for j = 1, #fields, 2 do
        if string.match(fields[j], '^(.*)|%d+$') == gone then
          redis.call('HDEL', hits_key, fields[j])
        end
      end
    end
    if not seen or tonumber(seen) < bucket then
      redis.call('ZADD', tenants_key, bucket, tag)
    end
    redis.call('EXPIRE', hits_key, ttl_s)
    redis.call('EXPIRE', tenants_key, ttl_s)
  end
  local hits = 0
  for who, n in pairs(per) do
    if redis.call('ZSCORE', tenants_key, who) then
      if cap > 0 and n > cap then n = cap end
      hits = hits + n
    end
  end
  out[#out + 1] = hits
  out[#out + 1] = redis.call('ZCARD', tenants_key)
end
return out
"""


class RedisPromotionCounter:
    """Sliding-window hot-prefix counter shared through Redis."""

    def __init__(
        self,
        redis_url: str,
        *,
        salt: bytes,
        window_s: float = HOUR_S,
        bucket_s: float = 60.0,
        max_tenants: int = 64,
        key_prefix: str = "prefixgate:promo",
        timeout_s: float = 0.25,
    ) -> None:
        import redis.asyncio as redis

        if bucket_s <= 0 or window_s < bucket_s:
            raise ValueError("need 0 < bucket_s <= window_s")
        if max_tenants < MIN_TENANTS_FLOOR:
            raise ValueError(f"max_tenants must be at least {MIN_TENANTS_FLOOR}")
        self._redis = redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._script = self._redis.register_script(_SCRIPT)
        self._key = blake3.blake3(salt, derive_key_context="prefixgate 2026 hot-prefix counter keys").digest()
        self._prefix = key_prefix
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.num_buckets = int(window_s // bucket_s)
        self.max_tenants = max_tenants

    def keys(self, prefix_hash: PrefixHash) -> tuple[str, str]:
        """The hits hash and the tenant-tag sorted set of one prefix."""
        digest = blake3.blake3(prefix_hash.encode(), key=self._key).hexdigest()[:32]
        return f"{self._prefix}:{digest}:h", f"{self._prefix}:{digest}:t"

    async def _run(
        self, prefix_hashes: Sequence[PrefixHash], tag: str, now: float, cap: int | None = None
    ) -> list[PrefixStats]:
        if not prefix_hashes:
            return []
        keys = [key for prefix_hash in prefix_hashes for key in self.keys(prefix_hash)]
        bucket = int(now // self.bucket_s)
        args = [bucket, self.num_buckets, int(self.window_s) + 1, self.max_tenants, tag, cap or 0]
        counts = await self._script(keys=keys, args=args)
        window_s = self.num_buckets * self.bucket_s
        return [
            PrefixStats(
                prefix_hash=h, hits=int(counts[2 * i]), num_tenants=int(counts[2 * i + 1]), window_s=window_s
            )
            for i, h in enumerate(prefix_hashes)
        ]

    async def record(
        self,
        prefix_hashes: Sequence[PrefixHash],
        tenant_tag: TenantTag,
        now: float,
        *,
        max_hits_per_tenant_per_hour: float | None = None,
    ) -> list[PrefixStats]:
        if not tenant_tag or "|" in tenant_tag:
            raise ValueError("tenant_tag must be non-empty and free of '|'")
        cap = hits_cap(max_hits_per_tenant_per_hour, self.num_buckets * self.bucket_s)
        return await self._run(prefix_hashes, tenant_tag, now, cap)

    async def counted(
        self,
        prefix_hash: PrefixHash,
        now: float,
        *,
        among: Container[TenantTag],
        max_hits_per_tenant_per_hour: float | None = None,
    ) -> tuple[PrefixStats, frozenset[TenantTag]]:
        oldest = int(now // self.bucket_s) - self.num_buckets
        hits_key, tenants_key = self.keys(prefix_hash)
        async with self._redis.pipeline(transaction=True) as pipe:  # one consistent read of both keys
            pipe.zrangebyscore(tenants_key, f"({oldest}", "+inf")
            pipe.hgetall(hits_key)
            tags, fields = await pipe.execute()
        per_tenant = {TenantTag(t): 0 for t in map(_text, tags) if TenantTag(t) in among}
        for field, hits in fields.items():
            tag, _, bucket = _text(field).rpartition("|")
            if tag in per_tenant and int(bucket) > oldest:
                per_tenant[TenantTag(tag)] += int(hits)
        window_s = self.num_buckets * self.bucket_s
        cap = hits_cap(max_hits_per_tenant_per_hour, window_s)
        stats = PrefixStats(
            prefix_hash=prefix_hash,
            hits=sum(n if cap is None else min(n, cap) for n in per_tenant.values()),
            num_tenants=len(per_tenant),
            window_s=window_s,
        )
        return stats, frozenset(per_tenant)

    async def stats(self, prefix_hashes: Sequence[PrefixHash], now: float) -> list[PrefixStats]:
        return await self._run(prefix_hashes, "", now)

    async def forget(self, prefix_hash: PrefixHash) -> None:
        await self._redis.delete(*self.keys(prefix_hash))

    async def close(self) -> None:
        await self._redis.aclose()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
