"""the deployment's namespace secret (one row per epoch), shared by every gateway replica;
tenants' near-miss routing opt-in

Revision ID: 0005
Revises: 0002
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "tenants",
        sa.Column("near_miss_routing", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.create_table(
        "namespace_secrets",
        sa.Column("epoch", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("secret", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("epoch", name=op.f("pk_namespace_secrets")),
    )


def downgrade() -> None:
    op.drop_table("namespace_secrets")
    op.drop_column("tenants", "near_miss_routing")
