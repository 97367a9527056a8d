"""Promoted hot prefixes in SQL: the gateway records promotions, admins list and revoke them.

Every change bumps the policy version (``repository.record_change``), so every gateway replica picks up
a promotion or a revocation with its next policy reload (``PolicySnapshot.promoted_hashes``). Rows never
name a tenant. A revoked row is kept: its hash stays *known* and is not promoted again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from policies.promotion import PrefixHash, PromotedPrefix
from tenancy.keys import new_id
from tenancy.models import HotPrefix
from tenancy.repository import NotFound, record_change


@dataclass(frozen=True, kw_only=True, slots=True)
class HotPrefixInfo:
    """A promotion as admins see it in lists: no tenants, no text."""

    id: str
    prefix_hash: PrefixHash
    model: str
    num_tokens: int
    hits_per_hour: int  # at promotion
    num_tenants: int  # at promotion
    promoted_at: datetime
    revoked_at: datetime | None


def _utc(moment: datetime | None) -> datetime | None:
    """SQLite gives naive datetimes back; every time stored here is UTC."""
    return moment if moment is None or moment.tzinfo else moment.replace(tzinfo=UTC)


def _info(row: HotPrefix) -> HotPrefixInfo:
    return HotPrefixInfo(
        id=row.id,
        prefix_hash=PrefixHash(row.prefix_hash),
        model=row.model,
        num_tokens=row.num_tokens,
        hits_per_hour=row.hits_per_hour,
        num_tenants=row.num_tenants,
        promoted_at=_utc(row.promoted_at),
        revoked_at=_utc(row.revoked_at),
    )


class HotPrefixRepository:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def add(self, promoted: PromotedPrefix, *, model: str, text: str | None) -> HotPrefixInfo | None:
        """Record a promotion (actor ``gateway``); None when the hash is already known (another replica
        promoted it first, or an admin revoked it)."""
        row = HotPrefix(
            id=new_id("hp"),
            prefix_hash=promoted.prefix_hash,
            model=model[:200],
            num_tokens=promoted.num_tokens,
            hits_per_hour=promoted.hits_per_hour,
            num_tenants=promoted.num_tenants,
            promoted_at=datetime.fromtimestamp(promoted.promoted_at, UTC),
            revoked_at=None,
            text=text,
        )
        async with self._sessionmaker() as session:
            session.add(row)
            try:
                await session.flush()
            except IntegrityError:
                return None
            details = {"id": row.id, "prefix_hash": row.prefix_hash, "num_tokens": row.num_tokens}
            await record_change(session, "gateway", "hot_prefix.promote", None, details)
            await session.commit()
        return _info(row)

    async def list(self, *, include_revoked: bool = False) -> list[HotPrefixInfo]:
        """Newest first."""
        query = select(HotPrefix).order_by(HotPrefix.promoted_at.desc(), HotPrefix.id)
        if not include_revoked:
            query = query.where(HotPrefix.revoked_at.is_(None))
        async with self._sessionmaker() as session:
            return [_info(row) for row in await session.scalars(query)]

    async def get(self, hot_prefix_id: str) -> tuple[HotPrefixInfo, str | None]:
        """The promotion and its stored text (None when text storage is off)."""
        async with self._sessionmaker() as session:
            row = await self._row(session, hot_prefix_id)
            return _info(row), row.text

    async def revoke(self, hot_prefix_id: str, *, actor: str = "admin") -> HotPrefixInfo:
        """Revoke a promotion (idempotent). Its hash stays known, so it is not promoted straight back."""
        async with self._sessionmaker() as session:
            row = await self._row(session, hot_prefix_id)
            if row.revoked_at is None:
                row.revoked_at = datetime.now(UTC)
                details = {"id": row.id, "prefix_hash": row.prefix_hash}
                await record_change(session, actor, "hot_prefix.revoke", None, details)
            await session.commit()
            return _info(row)

    @staticmethod
    async def _row(session: AsyncSession, hot_prefix_id: str) -> HotPrefix:
        row = await session.get(HotPrefix, hot_prefix_id)
        if row is None:
            raise NotFound(f"hot prefix {hot_prefix_id!r} not found")
        return row
