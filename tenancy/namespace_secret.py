"""The deployment's namespace secret in SQL: created once, read by every replica, rotated by epoch."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenancy.models import NamespaceSecret
from tenancy.repository import record_change

SECRET_BYTES = 32


@dataclass(frozen=True, kw_only=True, slots=True)
class SecretInForce:
    epoch: int
    secret: str  # never logged, never returned by an API

    def __repr__(self) -> str:
        return f"SecretInForce(epoch={self.epoch}, secret=<hidden>)"


class NamespaceSecretRepository:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def current(self) -> SecretInForce | None:
        async with self._sessionmaker() as session:
            row = await session.scalar(
                select(NamespaceSecret).order_by(NamespaceSecret.epoch.desc()).limit(1)
            )
        return None if row is None else SecretInForce(epoch=row.epoch, secret=row.secret)

    async def all_epochs(self) -> list[SecretInForce]:
        """Every secret on record, newest first: a tenant had one namespace id under each, and a purge
        must reach them all (blocks cached under an older secret stay on the workers until purged)."""
        async with self._sessionmaker() as session:
            rows = await session.scalars(select(NamespaceSecret).order_by(NamespaceSecret.epoch.desc()))
            return [SecretInForce(epoch=row.epoch, secret=row.secret) for row in rows]

    async def _insert(self, epoch: int, secret: str, *, actor: str = "gateway") -> bool:
        try:
            async with self._sessionmaker.begin() as session:
                session.add(NamespaceSecret(epoch=epoch, secret=secret, created_at=datetime.now(UTC)))
                await record_change(session, actor, "namespace_secret.create", None, {"epoch": epoch})
            return True
        except IntegrityError:  # another replica wrote this epoch first: theirs is in force
            return False

    async def get_or_create(self, *, seed: str | None = None) -> SecretInForce:
        """The secret in force; the first replica to start creates epoch 0 (from ``seed`` if given,
        e.g. the salt file of a data dir that predates this table, so its namespaces survive)."""
        found = await self.current()
        if found is not None:
            return found
        await self._insert(0, seed or secrets.token_urlsafe(SECRET_BYTES))
        found = await self.current()
        assert found is not None
        return found

    async def rotate(self, *, actor: str = "admin") -> SecretInForce:
        """A fresh secret under the next epoch (every namespace key changes: a global invalidation)."""
        while True:
            async with self._sessionmaker() as session:
                last = await session.scalar(select(func.max(NamespaceSecret.epoch)))
            epoch = 0 if last is None else last + 1
            if await self._insert(epoch, secrets.token_urlsafe(SECRET_BYTES), actor=actor):
                found = await self.current()
                assert found is not None
                return found
