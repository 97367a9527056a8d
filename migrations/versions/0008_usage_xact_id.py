"""usage records carry the id of the transaction that wrote them: the per-request export's order

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# PostgreSQL shows a row when its transaction commits, not in id order: the export follows the writing
# transactions (tenancy.reports.export_requests). SQLite serializes writes and keeps 0: id order.
_PG_DEFAULT = "pg_current_xact_id()::text::bigint"  # PostgreSQL 13+; the 64-bit id, never wraps


def upgrade() -> None:
    # Rows already there read 0 (a constant default: no table rewrite) and come first, in id order.
    op.add_column(
        "usage_records", sa.Column("xact_id", sa.BigInteger(), nullable=False, server_default=sa.text("0"))
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE usage_records ALTER COLUMN xact_id SET DEFAULT ({_PG_DEFAULT})")
    op.drop_index("ix_usage_records_tenant_id_id", table_name="usage_records")
    op.create_index("ix_usage_records_xact_id", "usage_records", ["xact_id", "id"])
    op.create_index("ix_usage_records_tenant_xact_id", "usage_records", ["tenant_id", "xact_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_usage_records_tenant_xact_id", table_name="usage_records")
    op.drop_index("ix_usage_records_xact_id", table_name="usage_records")
    op.create_index("ix_usage_records_tenant_id_id", "usage_records", ["tenant_id", "id"])
    op.drop_column("usage_records", "xact_id")
