"""tenant backpressure limits: concurrent requests and tokens per minute

Revision ID: 0006
Revises: 0002
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: existing tenants stay unlimited (plain ALTER TABLE, as in 0002).
    op.add_column("tenants", sa.Column("max_concurrent_requests", sa.Integer(), nullable=True))
    op.add_column("tenants", sa.Column("rate_limit_tpm", sa.Integer(), nullable=True))


def downgrade() -> None:
    for column in ("rate_limit_tpm", "max_concurrent_requests"):
        op.drop_column("tenants", column)
