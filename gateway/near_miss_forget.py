"""What near miss forgets of a tenant, and when: on the admin's purge, invalidation or deletion
(``forget_tenant``, with the tenant's new epoch), and on every replica once its policies show a newer
epoch, an opt-out or a deletion (``sweep``). Whatever was prepared at an older epoch (a request, a
background embedding or finding) is kept out by that number alone (``_stale``)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Protocol

from policies.isolation import GLOBAL_NAMESPACE_KEY
from tenancy.policy import TenantPolicy

if TYPE_CHECKING:
    from gateway.near_miss_findings import LocalFindings, RedisFindings
    from gateway.near_miss_memory import NamespaceVectors, Remembered


class PolicySource(Protocol):
    """What near miss reads of the tenant policies in force (``tenancy.cache.PolicyCache``)."""

    @property
    def ready(self) -> bool: ...

    def get(self, tenant_id: str) -> TenantPolicy | None: ...


class TenantForgetting:
    """``NearMissRouting``'s forgetting, over the state it keeps (set in its ``__init__``)."""

    _recent: dict[tuple[str, bytes], deque[Remembered]]
    _vectors: dict[tuple[str, bytes], NamespaceVectors]
    _keys_of: dict[str, set[tuple[str, bytes]]]
    _epoch_of: dict[str, int]
    _findings: LocalFindings | RedisFindings
    _policies: PolicySource | None
    _sweep_s: float

    async def forget_tenant(self, tenant_id: str, *, epoch: int | None = None) -> None:
        """Drop everything remembered of a tenant: its prompts, vectors and findings, here and in Redis.

        Called by the admin purge, invalidate and delete with the tenant's new ``epoch``: whatever is
        still on its way from an older one (a request prepared before, a background embedding) is kept
        out. None: the epoch moved past the newest seen here. Other replicas drop their own copies when
        they see the tenant's new epoch (``_observe_epoch``)."""
        known = self._epoch_of.get(tenant_id)
        if epoch is None and known is not None:
            epoch = known + 1
        if epoch is not None:
            self._epoch_of[tenant_id] = max(epoch, known if known is not None else epoch)
        self._forget_local(tenant_id)
        await self._findings.forget(tenant_id, epoch=epoch)

    def _stale(self, tenant_id: str, epoch: int) -> bool:
        """Whether something prepared at ``epoch`` is from before the tenant's latest purge, or its
        tenant was deleted or opted out since (the policies in force: nothing is kept per deletion)."""
        known = self._epoch_of.get(tenant_id)
        if known is not None and epoch < known:
            return True
        if self._policies is None or not self._policies.ready:
            return False
        current = self._policies.get(tenant_id)
        return current is None or not current.near_miss_routing or epoch < current.epoch

    def _observe_epoch(self, tenant: TenantPolicy) -> None:
        """A tenant whose epoch grew since its prompts were remembered was purged or invalidated
        through some replica: its old prompts can never be reused (their keys are gone), so drop them.
        (A request still carrying an older epoch changes nothing: ``_stale`` keeps it out.)"""
        known = self._epoch_of.get(tenant.tenant_id)
        if known is not None and tenant.epoch > known:
            self._forget_local(tenant.tenant_id)
        self._epoch_of[tenant.tenant_id] = max(tenant.epoch, known if known is not None else tenant.epoch)

    def _forget_local(self, tenant_id: str) -> None:
        for pair in self._keys_of.pop(tenant_id, ()):
            if pair[1] == GLOBAL_NAMESPACE_KEY:  # the shared pool's key stays: drop this tenant's prompts
                self._forget_shared(pair, tenant_id)
                continue
            self._recent.pop(pair, None)
            self._vectors.pop(pair, None)
        self._findings.forget_local(tenant_id)

    def _forget_shared(self, pair: tuple[str, bytes], tenant_id: str) -> None:
        recent = self._recent.get(pair)
        if recent is not None:
            kept = [entry for entry in recent if entry.tenant_id != tenant_id]
            self._recent[pair] = deque(kept, maxlen=recent.maxlen)
        vectors = self._vectors.get(pair)
        if vectors is not None:
            vectors.remove_tenant(tenant_id)

    def sweep(self) -> None:
        """Forget the remembered tenants whose epoch moved, who opted out or who were deleted."""
        if self._policies is None or not self._policies.ready:
            return
        for tenant_id in list(self._epoch_of):
            tenant = self._policies.get(tenant_id)
            if tenant is None or not tenant.near_miss_routing:  # deleted, or opted out
                self._forget_local(tenant_id)
                del self._epoch_of[tenant_id]
            else:
                self._observe_epoch(tenant)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_s)
            self.sweep()
