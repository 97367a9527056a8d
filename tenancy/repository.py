"""Async repository of tenants and keys. Every change writes an audit row in the same transaction
and bumps the single-row policy version that gateway replicas poll to reload policies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from policies.promotion import PrefixHash
from tenancy.keys import hash_api_key, key_display_prefix, new_api_key, new_id
from tenancy.models import ApiKey, AuditLog, HotPrefix, PolicyVersion, Tenant
from tenancy.policy import TenantPolicy, validate_policy_fields


class NotFound(LookupError):
    pass


class Conflict(ValueError):
    pass


@dataclass(frozen=True, kw_only=True, slots=True)
class KeyInfo:
    id: str
    tenant_id: str
    key_prefix: str
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True, kw_only=True, slots=True)
class NewKey:
    """A key as returned once, at creation: ``api_key`` is never stored."""

    info: KeyInfo
    api_key: str


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicySnapshot:
    """Every tenant's policy and every live key, plus the change marker it was read at."""

    marker: int
    tenants: Mapping[str, TenantPolicy]  # tenant_id -> policy
    key_hash_to_tenant_id: Mapping[str, str]
    promoted_hashes: frozenset[PrefixHash] = frozenset()  # hot prefixes in force
    known_hashes: frozenset[PrefixHash] = frozenset()  # promoted or revoked: never proposed again
    key_hash_to_key_id: Mapping[str, str] = field(default_factory=dict)  # for usage records


def _now() -> datetime:
    return datetime.now(UTC)


async def record_change(
    session: AsyncSession, actor: str, action: str, tenant_id: str | None, details: dict
) -> None:
    """Log the change and bump the policy version (its row lock orders concurrent admin changes, so
    the version grows in commit order and a replica that saw version v has every change up to v)."""
    await session.execute(
        update(PolicyVersion).where(PolicyVersion.id == 1).values(version=PolicyVersion.version + 1)
    )
    session.add(AuditLog(at=_now(), actor=actor, action=action, tenant_id=tenant_id, details=details))


def _key_info(key: ApiKey) -> KeyInfo:
    return KeyInfo(
        id=key.id,
        tenant_id=key.tenant_id,
        key_prefix=key.key_prefix,
        created_at=key.created_at,
        revoked_at=key.revoked_at,
    )


class TenantRepository:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], *, actor: str = "admin") -> None:
        self._sessionmaker = sessionmaker
        self._actor = actor

    async def _audit(self, session: AsyncSession, action: str, tenant_id: str | None, details: dict) -> None:
        await record_change(session, self._actor, action, tenant_id, details)

    @staticmethod
    def _add_key(session: AsyncSession, tenant_id: str) -> NewKey:
        api_key = new_api_key()
        row = ApiKey(
            id=new_id("key"),
            tenant_id=tenant_id,
            key_hash=hash_api_key(api_key),
            key_prefix=key_display_prefix(api_key),
            created_at=_now(),
            revoked_at=None,
        )
        session.add(row)
        return NewKey(info=_key_info(row), api_key=api_key)

    async def _get_row(self, session: AsyncSession, tenant_id: str) -> Tenant:
        tenant = await session.get(Tenant, tenant_id)
        if tenant is None:
            raise NotFound(f"tenant {tenant_id!r} not found")
        return tenant

    @staticmethod
    async def _lock_tenant(session: AsyncSession, tenant_id: str) -> Tenant:
        """Open the change by locking the tenant's row (raises NotFound when it is gone).

        Every change of a tenant takes its locks in one order: the tenant row first, then its keys, then
        the policy version (``record_change``). Concurrent changes of one tenant so run one after the
        other, each reading what the previous one committed (one live key after concurrent rotations, one
        audit row for a revocation racing itself), never deadlock, and a change that comes after a delete
        finds no row: a 404, not a stale UPDATE or a foreign-key error. PostgreSQL: ``SELECT … FOR
        UPDATE``. SQLite has no row locks, and its driver starts a transaction only at the first write,
        so the session's reads would see no lock at all: ``BEGIN IMMEDIATE`` takes the database's write
        lock before the first read (others wait for it up to the busy timeout)."""
        if session.bind is not None and session.bind.dialect.name == "sqlite":
            await session.execute(text("BEGIN IMMEDIATE"))
        tenant = await session.scalar(select(Tenant).where(Tenant.id == tenant_id).with_for_update())
        if tenant is None:
            raise NotFound(f"tenant {tenant_id!r} not found")
        return tenant

    async def create_tenant(self, body: Mapping[str, Any]) -> tuple[TenantPolicy, NewKey]:
        """Create a tenant with its first API key. Raises PolicyError or Conflict (name taken)."""
        values = validate_policy_fields(body, require_name=True)
        now = _now()
        tenant = Tenant(id=new_id("tn"), epoch=0, created_at=now, updated_at=now, **values)
        async with self._sessionmaker() as session:
            session.add(tenant)
            await self._flush_or_conflict(session, values["name"])
            new_key = self._add_key(session, tenant.id)
            await self._audit(
                session, "tenant.create", tenant.id, {"fields": values, "key_id": new_key.info.id}
            )
            await session.commit()
        return TenantPolicy.from_row(tenant), new_key

    @staticmethod
    async def _flush_or_conflict(session: AsyncSession, name: Any) -> None:
        try:
            await session.flush()
        except IntegrityError as exc:
            raise Conflict(f"a tenant named {name!r} already exists") from exc

    async def list_tenants(self) -> list[tuple[TenantPolicy, datetime]]:
        async with self._sessionmaker() as session:
            rows = (await session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.id))).all()
        return [(TenantPolicy.from_row(row), row.created_at) for row in rows]

    async def get_tenant(self, tenant_id: str) -> tuple[TenantPolicy, datetime]:
        async with self._sessionmaker() as session:
            row = await self._get_row(session, tenant_id)
        return TenantPolicy.from_row(row), row.created_at

    async def find_by_name(self, name: str) -> TenantPolicy | None:
        async with self._sessionmaker() as session:
            row = await session.scalar(select(Tenant).where(Tenant.name == name))
        return None if row is None else TenantPolicy.from_row(row)

    async def update_tenant(self, tenant_id: str, body: Mapping[str, Any]) -> TenantPolicy:
        values = validate_policy_fields(body, require_name=False)
        async with self._sessionmaker() as session:
            row = await self._lock_tenant(session, tenant_id)
            for name, value in values.items():
                setattr(row, name, value)
            row.updated_at = _now()
            await self._flush_or_conflict(session, values.get("name"))
            await self._audit(session, "tenant.update", tenant_id, {"fields": values})
            await session.commit()
        return TenantPolicy.from_row(row)

    async def fence_tenant(self, tenant_id: str) -> int:
        """Before a delete: revoke every live key of the tenant and take it out of hot-prefix sharing, so
        that every replica refuses it (401) from its next policy poll, while its row (and so its
        namespace ids, and a retried delete) stays. Returns the number of keys revoked."""
        async with self._sessionmaker() as session:
            row = await self._lock_tenant(session, tenant_id)
            now = _now()
            revoked = await session.execute(
                update(ApiKey)
                .where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))
                .values(revoked_at=now)
            )
            row.share_hot_prefixes = False
            row.updated_at = now
            await self._audit(session, "tenant.delete_fence", tenant_id, {"keys_revoked": revoked.rowcount})
            await session.commit()
            return int(revoked.rowcount or 0)

    async def delete_tenant(self, tenant_id: str) -> None:
        async with self._sessionmaker() as session:
            row = await self._lock_tenant(session, tenant_id)
            await session.delete(row)
            await self._audit(session, "tenant.delete", tenant_id, {"name": row.name})
            await session.commit()

    async def invalidate(self, tenant_id: str) -> int:
        """Bump the tenant's epoch: its next request derives a fresh namespace key and reuses nothing."""
        async with self._sessionmaker() as session:
            await self._lock_tenant(session, tenant_id)
            await session.execute(
                update(Tenant).where(Tenant.id == tenant_id).values(epoch=Tenant.epoch + 1, updated_at=_now())
            )
            epoch = await session.scalar(select(Tenant.epoch).where(Tenant.id == tenant_id))
            await self._audit(session, "tenant.invalidate", tenant_id, {"epoch": epoch})
            await session.commit()
        return int(epoch or 0)

    async def record_purge(self, tenant_id: str, details: dict) -> None:
        """Audit a purge of the tenant's cached KV (the fan-out to workers happens in the gateway)."""
        async with self._sessionmaker() as session:
            await self._audit(session, "tenant.purge", tenant_id, details)
            await session.commit()

    async def list_keys(self, tenant_id: str) -> list[KeyInfo]:
        async with self._sessionmaker() as session:
            await self._get_row(session, tenant_id)
            rows = await session.scalars(
                select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at)
            )
            return [_key_info(row) for row in rows]

    async def create_key(self, tenant_id: str, *, revoke_others: bool) -> NewKey:
        """Add a key; with ``revoke_others`` (rotation) every other live key of the tenant is revoked."""
        async with self._sessionmaker() as session:
            await self._lock_tenant(session, tenant_id)
            revoked: list[str] = []
            if revoke_others:
                live = await session.scalars(
                    select(ApiKey).where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))
                )
                for key in live:
                    key.revoked_at = _now()
                    revoked.append(key.id)
            new_key = self._add_key(session, tenant_id)
            action = "key.rotate" if revoke_others else "key.create"
            await self._audit(
                session, action, tenant_id, {"key_id": new_key.info.id, "revoked_key_ids": revoked}
            )
            await session.commit()
        return new_key

    async def revoke_key(self, tenant_id: str, key_id: str) -> KeyInfo:
        async with self._sessionmaker() as session:
            await self._lock_tenant(session, tenant_id)  # a second revocation waits, then sees the first
            key = await session.get(ApiKey, key_id)
            if key is None or key.tenant_id != tenant_id:
                raise NotFound(f"key {key_id!r} of tenant {tenant_id!r} not found")
            if key.revoked_at is None:
                key.revoked_at = _now()
                await self._audit(session, "key.revoke", tenant_id, {"key_id": key_id})
            await session.commit()
            return _key_info(key)

    async def audit_log(self, *, tenant_id: str | None = None, limit: int = 100) -> list[AuditLog]:
        async with self._sessionmaker() as session:
            query = select(AuditLog).order_by(AuditLog.id.desc()).limit(limit)
            if tenant_id is not None:
                query = query.where(AuditLog.tenant_id == tenant_id)
            return list((await session.scalars(query)).all())

    async def change_marker(self) -> int:
        """The policy version: replicas reload when it moves."""
        async with self._sessionmaker() as session:
            return int(await session.scalar(select(PolicyVersion.version).where(PolicyVersion.id == 1)) or 0)

    async def load_snapshot(self) -> PolicySnapshot:
        """All tenants, live keys and hot prefixes, read in one transaction with the change marker."""
        async with self._sessionmaker() as session, session.begin():
            # The version is read first: a change committed after it only causes one extra reload.
            marker = int(
                await session.scalar(select(PolicyVersion.version).where(PolicyVersion.id == 1)) or 0
            )
            tenants = {row.id: TenantPolicy.from_row(row) for row in await session.scalars(select(Tenant))}
            keys = await session.execute(
                select(ApiKey.key_hash, ApiKey.tenant_id, ApiKey.id).where(ApiKey.revoked_at.is_(None))
            )
            live = [row for row in keys if row[1] in tenants]  # (key hash, tenant id, key id)
            key_map = {key_hash: tenant_id for key_hash, tenant_id, _ in live}
            hot = (await session.execute(select(HotPrefix.prefix_hash, HotPrefix.revoked_at))).all()
        return PolicySnapshot(
            marker=marker,
            tenants=tenants,
            key_hash_to_tenant_id=key_map,
            key_hash_to_key_id={key_hash: key_id for key_hash, _, key_id in live},
            promoted_hashes=frozenset(PrefixHash(h) for h, revoked_at in hot if revoked_at is None),
            known_hashes=frozenset(PrefixHash(h) for h, _ in hot),
        )
