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
from gateway.errors import ConflictError
from gateway.state import CONFIG, NAMESPACE_EPOCH, SESSIONMAKER
from tenancy.namespace_secret import NamespaceSecretRepository

log = logging.getLogger(__name__)

LEGACY_SALT_FILE = "namespace_salt"


CONFIGURED = -1  # NAMESPACE_EPOCH when the secret comes from the configuration, not the database


async def resolve_namespace_secret(
    config: GatewayConfig, repository: NamespaceSecretRepository
) -> tuple[GatewayConfig, int]:
    """``config`` with ``namespace_salt`` set (its own, or the database's secret in force) and the
    epoch of that secret (``CONFIGURED`` for a configured one)."""
    if config.namespace_salt:
        return config, CONFIGURED
    legacy = config.data_dir / LEGACY_SALT_FILE
    seed = legacy.read_text().strip() if legacy.exists() else None
    in_force = await repository.get_or_create(seed=seed)
    log.info("namespace secret: epoch %d from the database", in_force.epoch)
    return dataclasses.replace(config, namespace_salt=in_force.secret), in_force.epoch


async def namespace_secret_ctx(app: web.Application) -> AsyncIterator[None]:
    """Runs after the database is open and before anything derives a namespace."""
    repository = NamespaceSecretRepository(app[SESSIONMAKER])
    app[CONFIG], app[NAMESPACE_EPOCH] = await resolve_namespace_secret(app[CONFIG], repository)
    yield


def _epoch_json(epoch: int) -> int | None:
    return None if epoch == CONFIGURED else epoch


async def namespace_secret_status(request: web.Request) -> web.Response:
    """``GET /admin/v1/namespace-secret``: the epoch in force in the database and the one this replica
    uses (they differ after a rotation until the replica restarts). Never the secret."""
    in_use = request.config_dict[NAMESPACE_EPOCH]
    current = await NamespaceSecretRepository(request.config_dict[SESSIONMAKER]).current()
    return web.json_response(
        {
            "object": "namespace_secret",
            "source": "config" if in_use == CONFIGURED else "database",
            "epoch": None if current is None else current.epoch,
            "epoch_in_use": _epoch_json(in_use),
        }
    )


async def rotate_namespace_secret(request: web.Request) -> web.Response:
    """``POST /admin/v1/namespace-secret/rotate``: a fresh secret under the next epoch. Every namespace
    changes (all cached blocks are invalidated) once the replicas restart."""
    if request.config_dict[NAMESPACE_EPOCH] == CONFIGURED:
        raise ConflictError(
            "the namespace secret is configured (namespace_salt): change it there", code="secret_configured"
        )
    rotated = await NamespaceSecretRepository(request.config_dict[SESSIONMAKER]).rotate()
    log.warning("namespace secret rotated to epoch %d: restart every gateway replica", rotated.epoch)
    body = {
        "object": "namespace_secret",
        "source": "database",
        "epoch": rotated.epoch,
        "epoch_in_use": request.config_dict[NAMESPACE_EPOCH],
        "restart_required": True,
    }
    return web.json_response(body)
