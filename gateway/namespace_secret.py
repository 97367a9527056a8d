"""One namespace secret for the whole deployment.

Every gateway replica must derive the same namespace keys and ids from a tenant, or purges miss blocks
and caches split between replicas. The secret therefore lives in the database (``namespace_secrets``):
the first replica to start creates it, every other one reads it. An explicit ``namespace_salt`` in
the configuration still wins (then every replica must be given the same one). A data dir's older
``namespace_salt`` file seeds the database's first secret, so an upgraded deployment keeps its
namespaces.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.state import CONFIG, SESSIONMAKER
from tenancy.namespace_secret import NamespaceSecretRepository

log = logging.getLogger(__name__)

LEGACY_SALT_FILE = "namespace_salt"


async def resolve_namespace_secret(
    config: GatewayConfig, repository: NamespaceSecretRepository
) -> GatewayConfig:
    """``config`` with ``namespace_salt`` set: its own, or the database's secret in force."""
    if config.namespace_salt:
        return config
    legacy = config.data_dir / LEGACY_SALT_FILE
    seed = legacy.read_text().strip() if legacy.exists() else None
    in_force = await repository.get_or_create(seed=seed)
    log.info("namespace secret: epoch %d from the database", in_force.epoch)
    return dataclasses.replace(config, namespace_salt=in_force.secret)


async def namespace_secret_ctx(app: web.Application) -> AsyncIterator[None]:
    """Runs after the database is open and before anything derives a namespace."""
    app[CONFIG] = await resolve_namespace_secret(app[CONFIG], NamespaceSecretRepository(app[SESSIONMAKER]))
    yield
