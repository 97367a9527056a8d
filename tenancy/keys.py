"""API keys and ids: keys are shown once, only their SHA-256 hash is stored.

Keys carry 256 random bits, so an unsalted SHA-256 is enough to make a stolen table useless and lets a
gateway find the tenant with one dictionary lookup.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "sk-pg-"


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def key_display_prefix(api_key: str) -> str:
    return api_key[: len(KEY_PREFIX) + 6]


def new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(8)}"


def tokens_equal(given: str, expected: str) -> bool:
    """Constant-time comparison of two secrets of any length."""
    return hmac.compare_digest(
        hashlib.sha256(given.encode()).digest(), hashlib.sha256(expected.encode()).digest()
    )
