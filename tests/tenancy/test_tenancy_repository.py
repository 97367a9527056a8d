import pytest

from tenancy.cache import PolicyCache
from tenancy.db import create_engine, create_sessionmaker
from tenancy.keys import hash_api_key
from tenancy.policy import PolicyError
from tenancy.repository import Conflict, NotFound, TenantRepository


@pytest.fixture
async def repo(db_url):
    engine = create_engine(db_url)
    yield TenantRepository(create_sessionmaker(engine))
    await engine.dispose()


async def test_create_get_list_update_delete(repo):
    policy, new_key = await repo.create_tenant(
        {"name": "acme", "isolation": "dedicated", "reserved_blocks": 64}
    )
    assert policy.isolation == "dedicated" and policy.reserved_blocks == 64 and policy.epoch == 0
    assert policy.canonicalization == "report" and policy.share_hot_prefixes is False
    assert new_key.api_key.startswith("sk-pg-") and new_key.info.key_prefix == new_key.api_key[:12]

    got, created_at = await repo.get_tenant(policy.tenant_id)
    assert got == policy and created_at is not None
    default, _ = await repo.create_tenant({"name": "beta"})
    assert default.isolation == "namespace"
    assert [p.name for p, _ in await repo.list_tenants()] == ["acme", "beta"]

    updated = await repo.update_tenant(policy.tenant_id, {"isolation": "shared", "price_input_per_mtok": 3})
    assert updated.isolation == "shared" and updated.price_input_per_mtok == 3.0
    with pytest.raises(Conflict):
        await repo.update_tenant(policy.tenant_id, {"name": "beta"})
    await repo.delete_tenant(policy.tenant_id)
    with pytest.raises(NotFound):
        await repo.get_tenant(policy.tenant_id)
    actions = [row.action for row in await repo.audit_log()]
    assert actions == ["tenant.delete", "tenant.update", "tenant.create", "tenant.create"]


async def test_duplicate_name_conflicts(repo):
    await repo.create_tenant({"name": "acme"})
    with pytest.raises(Conflict):
        await repo.create_tenant({"name": "acme"})


@pytest.mark.parametrize(
    "body",
    [
        {"name": ""},
        {"name": "acme\x1b[2J"},  # control characters: terminal escapes in the admin CLI, logs and reports
        {"name": "ac\u0085me"},
        {"name": "x", "isolation": "private"},
        {"name": "x", "reserved_blocks": -1},
        {"name": "x", "reserved_blocks": True},
        {"name": "x", "canonicalization": "yes"},
        {"name": "x", "share_hot_prefixes": "true"},
        {"name": "x", "price_output_per_mtok": "1"},
        {"name": "x", "epoch": 3},
        {"name": "x", "api_key": "sk-mine"},
        {"isolation": "shared"},
    ],
)
async def test_invalid_policy_fields(repo, body):
    with pytest.raises(PolicyError):
        await repo.create_tenant(body)


async def test_keys_rotate_revoke_and_cache(repo):
    policy, first = await repo.create_tenant({"name": "acme"})
    cache = PolicyCache(repo, refresh_s=0.05)
    await cache.refresh_if_changed()
    assert cache.authenticate(first.api_key) == policy
    assert cache.authenticate("sk-pg-nope") is None

    second = await repo.create_key(policy.tenant_id, revoke_others=False)
    rotated = await repo.create_key(policy.tenant_id, revoke_others=True)
    assert await cache.refresh_if_changed() is True
    assert cache.authenticate(first.api_key) is None and cache.authenticate(second.api_key) is None
    assert cache.authenticate(rotated.api_key) == policy
    assert await cache.refresh_if_changed() is False

    await repo.revoke_key(policy.tenant_id, rotated.info.id)
    await cache.refresh_if_changed()
    assert cache.authenticate(rotated.api_key) is None
    keys = await repo.list_keys(policy.tenant_id)
    assert [k.revoked_at is not None for k in keys] == [True, True, True]
    with pytest.raises(NotFound):
        await repo.revoke_key("tn_other", keys[0].id)


async def test_only_key_hashes_are_stored(repo, db_url):
    from sqlalchemy import text

    _, new_key = await repo.create_tenant({"name": "acme"})
    engine = create_engine(db_url)
    async with engine.connect() as conn:
        dump = [
            tuple(row)
            for table in ("api_keys", "audit_log", "tenants")
            for row in (await conn.execute(text(f"SELECT * FROM {table}"))).all()
        ]
    await engine.dispose()
    flat = repr(dump)
    assert new_key.api_key not in flat and hash_api_key(new_key.api_key) in flat


async def test_invalidate_bumps_epoch(repo):
    policy, _ = await repo.create_tenant({"name": "acme"})
    assert await repo.invalidate(policy.tenant_id) == 1
    assert await repo.invalidate(policy.tenant_id) == 2
    assert (await repo.get_tenant(policy.tenant_id))[0].epoch == 2
    with pytest.raises(NotFound):
        await repo.invalidate("tn_missing")


async def test_policy_version_follows_commit_order(pg_url):
    """A second admin change waits for the first to commit, so replicas never skip a change."""
    import asyncio

    from sqlalchemy import update

    from tenancy.models import PolicyVersion

    engine = create_engine(pg_url)
    sessionmaker = create_sessionmaker(engine)
    repo = TenantRepository(sessionmaker)
    policy, _ = await repo.create_tenant({"name": "acme"})
    before = await repo.change_marker()
    async with sessionmaker() as in_flight:
        await in_flight.execute(update(PolicyVersion).values(version=PolicyVersion.version + 1))
        second = asyncio.create_task(repo.update_tenant(policy.tenant_id, {"isolation": "shared"}))
        await asyncio.sleep(0.3)
        assert not second.done() and await repo.change_marker() == before
        await in_flight.commit()
    await second
    assert await repo.change_marker() == before + 2
    await engine.dispose()
