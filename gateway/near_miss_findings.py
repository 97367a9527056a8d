"""Near-miss findings (diverging spans), per tenant: in this process, or in Redis shared by every replica.

A finding is where one of a tenant's prompts parted from a similar earlier one of the same tenant: a
candidate canonicalization rule (``/v1/prompt-lint``, ``GET /admin/v1/tenants/{id}/near-miss``). Each
tenant keeps its ``limit`` newest findings, one per (model, position); the key is the tenant id, so no
tenant ever reads another's. With Redis (``redis_url``) the replicas share them: a finding seen through
one replica is listed by all. In Redis each finding is filed under the tenant's namespace id (derived
from the deployment's namespace secret) within the tenant's keys: after a secret rotation (every
namespace changes) a replica restarted on the new secret lists only the findings of the new one, newer
findings push the old ones out, and a purge, invalidation or deletion still erases them all. Redis is
never on a request's path (findings are recorded in the background) and its failure is not fatal: the
replica keeps its own copy and serves that meanwhile.

A finding carries the tenant epoch its request was prepared at. A forget (purge, invalidation, deletion)
leaves the tenant's new epoch behind in Redis, and a write from an older epoch is refused atomically
(one Lua script): a background write that lands after the forget, from this replica or from one that
has not seen the new epoch yet, cannot bring the forgotten findings back.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from policies.isolation import tenant_namespace_id

log = logging.getLogger(__name__)

SUGGESTION = (
    "if this span varies per request (an id, a date, a counter), move it after the shared prefix or add "
    "a canonicalization pattern for it"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DivergingSpan:
    """Where a prompt parted from a similar one of the same tenant: a canonicalization candidate."""

    model_id: str
    position_token: int  # first token that differs
    before_text: str  # a few tokens before it (shared)
    request_text: str  # the request's tokens from there
    other_text: str  # the similar prompt's tokens from there
    tokens_after: int  # tokens after the divergence that could not be reused
    seen_at: float  # unix time

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "position_token": self.position_token,
            "before": self.before_text,
            "request": self.request_text,
            "other": self.other_text,
            "tokens_after_divergence": self.tokens_after,
            "suggestion": SUGGESTION,
            "seen_at": self.seen_at,
        }


class LocalFindings:
    """This replica's findings: a bounded deque per tenant."""

    def __init__(self, limit: int = 20) -> None:
        self.limit = limit
        self._by_tenant: dict[str, deque[DivergingSpan]] = {}

    async def record(self, tenant_id: str, span: DivergingSpan, *, epoch: int = 0) -> bool:
        """Keep ``span`` unless its (model, position) is kept already; True if it is new. ``epoch``
        (the tenant's when the request was prepared) is checked by the caller, on this event loop."""
        spans = self._by_tenant.setdefault(tenant_id, deque(maxlen=self.limit))
        if any(s.position_token == span.position_token and s.model_id == span.model_id for s in spans):
            return False
        spans.append(span)
        return True

    async def recent(self, tenant_id: str) -> list[dict[str, Any]]:
        """The tenant's findings, newest first."""
        return [span.to_json() for span in reversed(self._by_tenant.get(tenant_id, ()))]

    async def forget(self, tenant_id: str, *, epoch: int | None = None) -> None:
        self.forget_local(tenant_id)

    def forget_local(self, tenant_id: str) -> None:
        """Drop this replica's findings of the tenant (the shared store, if any, is left alone)."""
        self._by_tenant.pop(tenant_id, None)

    async def close(self) -> None:
        pass


# Add a finding unless its (model, position) is known or its epoch is older than the tenant's last forget,
# then keep the `limit` newest. KEYS: spans hash, order zset, forgotten epoch (same hash tag). ARGV:
# field, json, seen_at, limit, ttl_ms, epoch.
_RECORD = """
local forgotten = tonumber(redis.call('GET', KEYS[3]) or '-1')
if tonumber(ARGV[6]) < forgotten then return 0 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
  local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
  if extra > 0 then
    local oldest = redis.call('ZPOPMIN', KEYS[2], extra)
    for i = 1, #oldest, 2 do redis.call('HDEL', KEYS[1], oldest[i]) end
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return 1
"""

# Forget a tenant's findings and keep the newest epoch forgotten (for as long as a finding could live).
# KEYS: spans hash, order zset, forgotten epoch. ARGV: epoch (-1: none known), ttl_ms.
_FORGET = """
redis.call('DEL', KEYS[1], KEYS[2])
local epoch = tonumber(ARGV[1])
if epoch >= 0 and epoch > tonumber(redis.call('GET', KEYS[3]) or '-1') then
  redis.call('SET', KEYS[3], epoch, 'PX', ARGV[2])
end
return 1
"""


class RedisFindings:
    """Findings shared by every replica through Redis, with this replica's copy as the fallback."""

    def __init__(
        self,
        redis_url: str,
        *,
        salt: bytes,
        limit: int = 20,
        ttl_s: float = 7 * 24 * 3600.0,
        key_prefix: str = "prefixgate:near-miss",
        timeout_s: float = 0.5,
    ) -> None:
        import redis.asyncio as redis

        self._redis = redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._record = self._redis.register_script(_RECORD)
        self._forget = self._redis.register_script(_FORGET)
        self._local = LocalFindings(limit)
        self.limit = limit
        self._ttl_ms = int(ttl_s * 1000)
        self._prefix = key_prefix
        self._salt = salt  # the namespace secret in use: a rotation changes every namespace id
        self._warned_at = 0.0

    def _keys(self, tenant_id: str) -> tuple[str, str, str]:
        """The tenant's spans, their order and the newest epoch forgotten (one hash tag: one slot)."""
        base = f"{self._prefix}:{{{tenant_id}}}"
        return f"{base}:spans", f"{base}:order", f"{base}:forgotten-epoch"

    def _namespace(self, tenant_id: str) -> str:
        """The start of the tenant's fields under the namespace secret in use."""
        return tenant_namespace_id(self._salt, tenant_id) + "\0"

    def _warn(self, what: str, error: Exception) -> None:
        if time.monotonic() - self._warned_at > 60:
            self._warned_at = time.monotonic()
            log.warning("near-miss findings: Redis %s failed (%s); serving this replica's own", what, error)

    async def record(self, tenant_id: str, span: DivergingSpan, *, epoch: int = 0) -> bool:
        """As ``LocalFindings.record``; Redis refuses it if the tenant was forgotten at a newer epoch."""
        if not await self._local.record(tenant_id, span):
            return False  # this replica wrote it already (the same spot recurs with every near miss)
        field = f"{self._namespace(tenant_id)}{span.model_id}\0{span.position_token}"
        try:
            await self._record(
                keys=list(self._keys(tenant_id)),
                args=[field, json.dumps(asdict(span)), span.seen_at, self.limit, self._ttl_ms, epoch],
            )
        except Exception as error:  # redis.RedisError, OSError, timeouts: the local copy stands
            self._warn("write", error)
        return True

    async def recent(self, tenant_id: str) -> list[dict[str, Any]]:
        """Every replica's findings for the tenant under the namespace secret in use, newest first."""
        spans_key, order_key, _ = self._keys(tenant_id)
        namespace = self._namespace(tenant_id).encode()
        try:
            fields = await self._redis.zrevrange(order_key, 0, self.limit - 1)
            fields = [field for field in fields if field.startswith(namespace)]
            values = await self._redis.hmget(spans_key, fields) if fields else []
        except Exception as error:
            self._warn("read", error)
            return await self._local.recent(tenant_id)
        return [DivergingSpan(**json.loads(value)).to_json() for value in values if value is not None]

    def forget_local(self, tenant_id: str) -> None:
        """Drop this replica's copy only (another replica that took the purge clears Redis)."""
        self._local.forget_local(tenant_id)

    async def forget(self, tenant_id: str, *, epoch: int | None = None) -> None:
        """Drop the tenant's findings here and in Redis, where a write from before ``epoch`` (the
        tenant's new one) is refused from now on."""
        self._local.forget_local(tenant_id)
        try:
            await self._forget(
                keys=list(self._keys(tenant_id)), args=[-1 if epoch is None else epoch, self._ttl_ms]
            )
        except Exception as error:
            self._warn("delete", error)

    async def close(self) -> None:
        await self._redis.aclose()
