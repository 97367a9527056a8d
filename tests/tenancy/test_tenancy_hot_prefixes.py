"""Promotions and canonicalization settings in SQL, on SQLite and PostgreSQL."""

import pytest

from policies.promotion import PrefixHash, PromotedPrefix
from tenancy.cache import PolicyCache
from tenancy.db import create_engine, create_sessionmaker
from tenancy.hot_prefixes import HotPrefixRepository
from tenancy.policy import PolicyError, canonicalization_policy
from tenancy.repository import NotFound, TenantRepository

H1, H2 = PrefixHash("a" * 64), PrefixHash("b" * 64)


@pytest.fixture
async def repos(db_url):
    engine = create_engine(db_url)
    sessionmaker = create_sessionmaker(engine)
    yield TenantRepository(sessionmaker), HotPrefixRepository(sessionmaker)
    await engine.dispose()


def promoted(prefix_hash: PrefixHash, at: float = 1_800_000_000.0) -> PromotedPrefix:
    return PromotedPrefix(
        prefix_hash=prefix_hash, num_tokens=512, hits_per_hour=1200, num_tenants=4, promoted_at=at
    )


async def test_promote_list_show_revoke_and_the_snapshot(repos):
    tenants, hot = repos
    cache = PolicyCache(tenants)
    await cache.reload()
    marker = await tenants.change_marker()

    first = await hot.add(promoted(H1), model="m", text="<|bos|>system prompt")
    assert first is not None and first.id.startswith("hp_") and first.num_tokens == 512
    assert await hot.add(promoted(H1), model="m", text=None) is None  # another replica was first
    second = await hot.add(promoted(H2, at=1_800_000_100.0), model="m", text=None)
    assert await tenants.change_marker() == marker + 2  # replicas reload on every promotion

    assert [row.id for row in await hot.list()] == [second.id, first.id]  # newest first
    info, text = await hot.get(first.id)
    assert info == first and text == "<|bos|>system prompt"
    assert (await hot.get(second.id))[1] is None

    assert await cache.refresh_if_changed()
    assert cache.promoted_hashes == {H1, H2} and cache.known_hashes == {H1, H2}

    revoked = await hot.revoke(first.id)
    assert revoked.revoked_at is not None
    assert (await hot.revoke(first.id)).revoked_at == revoked.revoked_at  # idempotent
    assert [row.id for row in await hot.list()] == [second.id]
    assert {row.id for row in await hot.list(include_revoked=True)} == {first.id, second.id}
    await cache.refresh_if_changed()
    assert cache.promoted_hashes == {H2} and cache.known_hashes == {H1, H2}  # revoked stays known
    with pytest.raises(NotFound):
        await hot.revoke("hp_missing")

    actions = [row.action for row in await tenants.audit_log()]
    assert actions == ["hot_prefix.revoke", "hot_prefix.promote", "hot_prefix.promote"]
    assert all(row.tenant_id is None for row in await tenants.audit_log())


async def test_canonicalization_settings_round_trip_and_validate(repos):
    tenants, _ = repos
    patterns = {"ticket": r"ticket #(?P<v>[A-Z]{2}\d{3,6})", "order": r"ORD-\d{6,10}"}
    policy, _ = await tenants.create_tenant(
        {
            "name": "acme",
            "canonicalization": "on",
            "canonicalization_patterns": patterns,
            "canonicalization_disabled_rules": ["time", "date_slash", "time"],
            "canonicalization_note_role": "system",
        }
    )
    assert policy.canonicalization_patterns == tuple(patterns.items())
    assert policy.canonicalization_disabled_rules == ("date_slash", "time")
    assert (await tenants.get_tenant(policy.tenant_id))[0] == policy
    compiled = canonicalization_policy(policy)
    assert compiled.mode == "on" and compiled.note_role == "system"
    names = [rule.name for rule in compiled.rules]
    assert "ticket" in names and "order" in names and "time" not in names

    default, _ = await tenants.create_tenant({"name": "plain"})
    assert default.canonicalization_patterns == () and default.canonicalization_note_role == "user"

    for field, value, message in (
        ("canonicalization_patterns", {"order": r"ORD-\d+"}, "unbounded repeat"),
        ("canonicalization_patterns", {"Bad Name": "x"}, "must match"),
        ("canonicalization_patterns", ["x"], "must be an object"),
        ("canonicalization_patterns", {"p": "(a"}, "does not compile"),
        ("canonicalization_disabled_rules", ["nope"], "unknown built-in rules"),
        ("canonicalization_disabled_rules", "time", "list of rule names"),
        ("canonicalization_note_role", "assistant", "must be one of"),
        ("canonicalization_note_role", None, "may not be null"),
    ):
        with pytest.raises(PolicyError, match=message) as raised:
            await tenants.update_tenant(policy.tenant_id, {field: value})
        assert raised.value.param == field
    assert (await tenants.get_tenant(policy.tenant_id))[0] == policy
