"""The test Redis for the KV tiers (worker.tiers.remote), shared by the worker and gateway tests."""

from __future__ import annotations

import pytest

from tests.tenancy.db_support import REDIS_ENV, service_url


@pytest.fixture
def kv_redis_url() -> str:
    """The test Redis URL, with the KV tier's keys (``pg:kv:*``) of earlier tests removed."""
    url = service_url(REDIS_ENV, "Redis for the KV tier tests")
    import redis

    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(match="pg:kv:*"):
            client.delete(key)
    finally:
        client.close()
    return url
