"""Optional encryption at rest of the disk (L3) and Redis (remote) tiers: AES-256-GCM keyed per namespace.

An entry (``tiers.entry``: header with token ids, then KV payloads) is sealed whole::

    b"PGKE" | u16 namespace length | namespace id | 12-byte nonce | AES-GCM(entry, aad = magic ‖ namespace)

The key of a namespace is HKDF-SHA256 of the deployment's at-rest secret
(``PREFIXGATE_WORKER_AT_REST_KEY``) with the namespace id as info, so one tenant's key opens nothing of
another's, and a file moved into another namespace's directory fails authentication (it is then a miss
and is deleted like any damaged entry). The namespace id is in clear: the tier must know whose a file
is to index, purge and apply quotas; token ids and KV are not.
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from worker.tiers.entry import CorruptEntry

MAGIC = b"PGKE"
NONCE_BYTES = 12
MAX_CACHED_KEYS = 4096


def is_sealed(data: bytes | bytearray | memoryview) -> bool:
    return bytes(data[:4]) == MAGIC


class AtRestCipher:
    """Seals and opens tier entries; keys are derived per namespace and cached."""

    def __init__(self, secret: str | bytes) -> None:
        raw = secret.encode() if isinstance(secret, str) else secret
        if len(raw) < 16:
            raise ValueError("the at-rest secret must be at least 16 bytes")
        self._secret = raw
        self._keys: dict[str, AESGCM] = {}

    def _key(self, namespace_id: str) -> AESGCM:
        key = self._keys.get(namespace_id)
        if key is None:
            if len(self._keys) >= MAX_CACHED_KEYS:
                self._keys.clear()
            material = HKDF(
                algorithm=hashes.SHA256(),
                length=32,
                salt=b"prefixgate kv at rest v1",
                info=namespace_id.encode(),
            ).derive(self._secret)
            key = self._keys[namespace_id] = AESGCM(material)
        return key

    def seal(self, namespace_id: str, entry: bytes | bytearray) -> bytes:
        ns = namespace_id.encode()
        nonce = os.urandom(NONCE_BYTES)
        head = MAGIC + struct.pack("<H", len(ns)) + ns
        return head + nonce + self._key(namespace_id).encrypt(nonce, bytes(entry), MAGIC + ns)

    def open(self, sealed: bytes | bytearray | memoryview) -> tuple[str, bytes]:
        """``(namespace id, entry)``; raises CorruptEntry when the data is not a sealed entry of this
        deployment (wrong key, tampered, truncated, or stored in clear)."""
        view = memoryview(sealed)
        if len(view) < 6 + NONCE_BYTES or bytes(view[:4]) != MAGIC:
            raise CorruptEntry("entry is not encrypted at rest")
        (ns_len,) = struct.unpack_from("<H", view, 4)
        start = 6 + ns_len
        ns = bytes(view[6:start])
        nonce = bytes(view[start : start + NONCE_BYTES])
        try:
            namespace_id = ns.decode()
            entry = self._key(namespace_id).decrypt(nonce, view[start + NONCE_BYTES :], MAGIC + ns)
        except (InvalidTag, UnicodeDecodeError, ValueError):
            raise CorruptEntry("encrypted entry failed authentication") from None
        return namespace_id, entry
