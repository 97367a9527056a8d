"""usage records store whether they are billable (format_error keeps the worker's tokens at cost 0)

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "usage_records",
        sa.Column("billable", sa.Boolean(), nullable=False, server_default=sa.true()),
    )
    # Before, only ``format_error`` records with nothing delivered were written unbillable: they kept the
    # worker's tokens at a cost of 0. Under non-zero prices that is what tells them apart (a zero-priced
    # row costs 0 either way: it stays billable, as nothing can tell).
    op.execute(
        "UPDATE usage_records SET billable = false WHERE outcome = 'format_error' AND cost_total = 0"
        " AND prompt_tokens + completion_tokens > 0"
        " AND price_input_per_mtok + price_cached_input_per_mtok + price_output_per_mtok > 0"
    )


def downgrade() -> None:
    op.drop_column("usage_records", "billable")
