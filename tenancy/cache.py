"""In-memory policy cache: the hot path authenticates, reads policy and promoted hot prefixes without
touching SQL.

Each replica polls the one-row policy version (bumped by every admin change) every ``refresh_s`` and
reloads the whole snapshot when it moved, so an admin change made on any replica reaches all within
``refresh_s`` plus one reload.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from policies.promotion import PrefixHash
from tenancy.keys import hash_api_key
from tenancy.policy import TenantPolicy
from tenancy.repository import PolicySnapshot, TenantRepository

log = logging.getLogger(__name__)


class PolicyCache:
    def __init__(
        self,
        repository: TenantRepository,
        *,
        refresh_s: float = 0.5,
        on_reload: Callable[[Mapping[str, TenantPolicy]], object] | None = None,
    ) -> None:
        """``on_reload(tenants)`` is called with every snapshot's tenants once it is in force (the
        gateway drops the metric series of tenants that are gone)."""
        self._repository = repository
        self._refresh_s = refresh_s
        self._on_reload = on_reload
        self._snapshot: PolicySnapshot | None = None
        self._reloading = asyncio.Lock()  # overlapping reloads must not install an older snapshot
        self.last_refresh_monotonic: float | None = None

    @property
    def ready(self) -> bool:
        return self._snapshot is not None

    def authenticate(self, api_key: str) -> TenantPolicy | None:
        """The policy of the tenant owning this live key, or None (unknown, revoked or not loaded yet)."""
        snapshot = self._snapshot
        if snapshot is None:
            return None
        tenant_id = snapshot.key_hash_to_tenant_id.get(hash_api_key(api_key))
        return None if tenant_id is None else snapshot.tenants.get(tenant_id)

    def key_id(self, api_key: str) -> str | None:
        """The id of this live key (recorded on usage records), or None."""
        snapshot = self._snapshot
        return None if snapshot is None else snapshot.key_hash_to_key_id.get(hash_api_key(api_key))

    def get(self, tenant_id: str) -> TenantPolicy | None:
        snapshot = self._snapshot
        return None if snapshot is None else snapshot.tenants.get(tenant_id)

    @property
    def promoted_hashes(self) -> frozenset[PrefixHash]:
        """Hot prefixes in force (hashed in the global namespace for opted-in tenants)."""
        snapshot = self._snapshot
        return frozenset() if snapshot is None else snapshot.promoted_hashes

    @property
    def known_hashes(self) -> frozenset[PrefixHash]:
        """Hot prefixes promoted or revoked: counters never propose them again."""
        snapshot = self._snapshot
        return frozenset() if snapshot is None else snapshot.known_hashes

    def tenants(self) -> dict[str, TenantPolicy]:
        snapshot = self._snapshot
        return {} if snapshot is None else dict(snapshot.tenants)

    async def reload(self) -> None:
        async with self._reloading:
            snapshot = await self._repository.load_snapshot()
            current = self._snapshot
            if current is None or snapshot.marker >= current.marker:  # markers only grow
                self._snapshot = snapshot
                if self._on_reload is not None:
                    self._on_reload(snapshot.tenants)
            self.last_refresh_monotonic = time.monotonic()

    async def refresh_if_changed(self) -> bool:
        """Reload when the change marker moved (or nothing is loaded yet). Returns whether it reloaded."""
        if self._snapshot is not None:
            marker = await self._repository.change_marker()
            if marker == self._snapshot.marker:
                self.last_refresh_monotonic = time.monotonic()
                return False
        await self.reload()
        return True

    async def run(self) -> None:
        """Poll forever; a database outage keeps the last snapshot serving."""
        while True:
            try:
                await self.refresh_if_changed()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("policy refresh failed, serving the last snapshot: %s", exc)
            await asyncio.sleep(self._refresh_s)
