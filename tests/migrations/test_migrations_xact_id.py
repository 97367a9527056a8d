"""Migration 0008: usage records carry the id of the transaction that wrote them (the per-request
export's order, tenancy.reports.export_requests)."""

import asyncio
import secrets

from alembic import command
from sqlalchemy.engine import make_url

from migrations import alembic_config, upgrade_database
from tests.migrations.test_migrations_schema import execute, schema_diff
from tests.tenancy.db_support import POSTGRES_ENV, _pg_admin, service_url

_USAGE_ROW = (
    "INSERT INTO usage_records (request_id, tenant_id, model, endpoint, status, prompt_tokens, cached_tokens,"
    " cached_l1_tokens, cached_l2_tokens, cached_l3_tokens, cached_remote_tokens, completion_tokens,"
    " prefill_ms, saved_prefill_ms, created_at, created_hour)"
    " VALUES ('{}', 'tn_1', 'm', 'chat.completions', 200, 1, 0, 0, 0, 0, 0, 1, 0, 0, '2026-01-01', 1)"
)


def test_0008_records_carry_their_writing_transaction_on_postgres():
    """Rows older than 0008 read 0 (they come first in the export); PostgreSQL stamps every later row with
    the id of the transaction that wrote it; 0008 goes down and up again."""
    base = service_url(POSTGRES_ENV, "PostgreSQL")
    name = f"prefixgate_test_{secrets.token_hex(4)}"
    asyncio.run(_pg_admin(base, f'CREATE DATABASE "{name}"'))
    url = make_url(base).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade_database(url, "0007")
        execute(url, _USAGE_ROW.format("before"))
        upgrade_database(url)
        rows = execute(url, _USAGE_ROW.format("after"), "SELECT pg_current_xact_id()::text::bigint")
        stamped = execute(url, "SELECT request_id, xact_id FROM usage_records ORDER BY id")
        assert stamped == [("before", 0), ("after", rows[0][0])]
        command.downgrade(alembic_config(url), "0007")
        upgrade_database(url)
        assert schema_diff(url) == []
    finally:
        asyncio.run(_pg_admin(base, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
