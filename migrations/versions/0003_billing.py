"""billing: usage records carry who ended them, the key, the end user and their frozen prices and cost

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The gateway's default prices (gateway.config) when this migration was written: rows recorded before
# it are frozen at their tenant's prices of today, or at these when the tenant has none or is gone.
_DEFAULT_PRICES = {"input": 1.0, "cached": 0.1, "output": 2.0}
_PRICE_COLUMNS = ("price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok")
_COST_COLUMNS = ("cost_uncached_input", "cost_cached_input", "cost_output", "cost_total")


def upgrade() -> None:
    for name, length in (("tenant_name", 200), ("key_id", 40), ("end_user", 200)):
        op.add_column("usage_records", sa.Column(name, sa.String(length), nullable=True))
    op.add_column("usage_records", sa.Column("outcome", sa.String(20), nullable=True))
    for name in _PRICE_COLUMNS + _COST_COLUMNS:
        op.add_column(
            "usage_records", sa.Column(name, sa.Float(), nullable=False, server_default=sa.text("0"))
        )
    op.create_index("ix_usage_records_tenant_id_id", "usage_records", ["tenant_id", "id"])
    _freeze_existing_rows()


def _freeze_existing_rows() -> None:
    """Name, outcome, prices and cost of rows written before this revision (plain SQL: both dialects)."""
    tenant = "(SELECT {col} FROM tenants WHERE tenants.id = usage_records.tenant_id)"
    op.execute(f"UPDATE usage_records SET tenant_name = {tenant.format(col='name')}")
    op.execute(
        "UPDATE usage_records SET outcome = CASE WHEN status = 499 THEN 'client_cancelled' "
        "WHEN status >= 500 THEN 'server_error' WHEN status >= 400 THEN 'client_error' "
        "ELSE 'completed' END"
    )
    for column, default in zip(_PRICE_COLUMNS, _DEFAULT_PRICES.values(), strict=True):
        op.execute(f"UPDATE usage_records SET {column} = COALESCE({tenant.format(col=column)}, {default})")
    op.execute(
        "UPDATE usage_records SET "
        "cost_uncached_input = CASE WHEN prompt_tokens > cached_tokens "
        "THEN (prompt_tokens - cached_tokens) * price_input_per_mtok / 1000000.0 ELSE 0 END, "
        "cost_cached_input = cached_tokens * price_cached_input_per_mtok / 1000000.0, "
        "cost_output = completion_tokens * price_output_per_mtok / 1000000.0"
    )
    op.execute("UPDATE usage_records SET cost_total = cost_uncached_input + cost_cached_input + cost_output")


def downgrade() -> None:
    op.drop_index("ix_usage_records_tenant_id_id", table_name="usage_records")
    for name in ("tenant_name", "key_id", "end_user", "outcome", *_PRICE_COLUMNS, *_COST_COLUMNS):
        op.drop_column("usage_records", name)
