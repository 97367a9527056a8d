"""Isolation levels and server-side namespace derivation.

A tenant's namespace key is derived from a deployment secret (the salt), the tenant id and the tenant
epoch; nothing a client sends enters it. Bumping the epoch gives a fresh key, so nothing cached before
can be reused. The common and promoted pools' keys are derived from the salt too, so a rotation of the
secret invalidates every cached block. The namespace *id* is a stable, non-secret tag of the owner used
to purge and to apply quotas; it does not change with the epoch, but does with the secret (a purge
reaches the ids under every secret still on record).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import blake3

from policies.hashing import NamespaceKey, NamespaceSegment

GLOBAL_NAMESPACE_ID = "global"
# Promoted hot prefixes have a pool of their own: `shared` tenants that did not opt in never reach them
# (had they lived in the global pool, every shared tenant would have read them).
PROMOTED_NAMESPACE_ID = "promoted"
# A promoted prefix's identity (its ``prefix_hash`` in the counters and in SQL) is hashed under this
# constant key, so promotions outlive a rotation of the namespace secret; its KV is hashed under
# ``promoted_namespace_key(salt)``, which a rotation changes like every other key.
PROMOTION_IDENTITY_KEY = NamespaceKey(blake3.blake3(b"prefixgate/promoted-hot-prefixes").digest())


def _salt_key(salt: bytes) -> bytes:
    """blake3's keyed mode takes exactly 32 bytes; any secret length is accepted."""
    return blake3.blake3(salt, derive_key_context="prefixgate 2026 namespace salt").digest()


@functools.lru_cache(maxsize=4)  # per request (namespace_segments); one entry per secret in use
def global_namespace_key(salt: bytes) -> NamespaceKey:
    """Key of the common pool of ``shared`` tenants; derived from the secret so a rotation invalidates it."""
    return NamespaceKey(blake3.blake3(b"global-namespace", key=_salt_key(salt)).digest())


@functools.lru_cache(maxsize=4)
def promoted_namespace_key(salt: bytes) -> NamespaceKey:
    """Key of the promoted hot prefixes' KV; derived from the secret so a rotation invalidates it."""
    return NamespaceKey(blake3.blake3(b"promoted-hot-prefixes", key=_salt_key(salt)).digest())


def tenant_namespace_key(salt: bytes, tenant_id: str, epoch: int) -> NamespaceKey:
    """Secret per-tenant, per-epoch key that enters the block hash chain."""
    message = b"tenant-namespace\0" + tenant_id.encode() + b"\0" + str(epoch).encode()
    return NamespaceKey(blake3.blake3(message, key=_salt_key(salt)).digest())


def tenant_namespace_id(salt: bytes, tenant_id: str) -> str:
    """Stable opaque tag of a tenant's namespace (same across epochs; reveals nothing of the key)."""
    digest = blake3.blake3(b"tenant-tag\0" + tenant_id.encode(), key=_salt_key(salt)).digest()
    return "t-" + digest[:12].hex()


@dataclass(frozen=True, kw_only=True, slots=True)
class IsolationLevel:
    """How one isolation level maps a tenant to namespace segments."""

    name: str
    uses_global_namespace: bool  # the whole prompt is hashed in the shared pool
    reserved_capacity: bool  # the tenant gets its own block quota in every tier
    may_share_hot_prefixes: bool  # may read/feed promoted global prefixes if the tenant opts in


ISOLATION_LEVELS: Mapping[str, IsolationLevel] = {
    "shared": IsolationLevel(
        name="shared", uses_global_namespace=True, reserved_capacity=False, may_share_hot_prefixes=True
    ),
    "namespace": IsolationLevel(
        name="namespace", uses_global_namespace=False, reserved_capacity=False, may_share_hot_prefixes=True
    ),
    "dedicated": IsolationLevel(
        name="dedicated", uses_global_namespace=False, reserved_capacity=True, may_share_hot_prefixes=False
    ),
}
DEFAULT_ISOLATION = "namespace"


def namespace_segments(
    *,
    level: str,
    salt: bytes,
    tenant_id: str,
    epoch: int,
    reserved_blocks: int = 0,
    promoted_prefix_tokens: int = 0,
) -> list[NamespaceSegment]:
    """Namespace segments for one request of one tenant.

    Args:
        level: the tenant's isolation level (a key of ``ISOLATION_LEVELS``).
        salt: the deployment's secret salt.
        tenant_id, epoch: the authenticated tenant and its current epoch.
        reserved_blocks: the tenant's quota per tier when its level reserves capacity.
        promoted_prefix_tokens: length of a promoted hot prefix (block-aligned) to hash in the
            promoted namespace; ignored for levels that may not share hot prefixes. Pass it only for
            tenants that opted in (``promotion.hot_prefix_access``).
    """
    isolation = ISOLATION_LEVELS[level]
    start = promoted_prefix_tokens if isolation.may_share_hot_prefixes else 0
    if isolation.uses_global_namespace:
        own = NamespaceSegment(
            start_token=start, namespace_id=GLOBAL_NAMESPACE_ID, key=global_namespace_key(salt)
        )
    else:
        own = NamespaceSegment(
            start_token=start,
            namespace_id=tenant_namespace_id(salt, tenant_id),
            key=tenant_namespace_key(salt, tenant_id, epoch),
            reserved_blocks=reserved_blocks if isolation.reserved_capacity else 0,
        )
    if start > 0:
        promoted = NamespaceSegment(
            start_token=0, namespace_id=PROMOTED_NAMESPACE_ID, key=promoted_namespace_key(salt)
        )
        return [promoted, own]
    return [own]
