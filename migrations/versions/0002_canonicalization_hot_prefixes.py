"""tenant canonicalization settings and promoted hot prefixes

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Server defaults fill the rows that exist already; the ORM sets the values on new rows. Plain
    # ALTER TABLE (SQLite >= 3.35 adds and drops columns in place): a batch "move and copy" of
    # `tenants` would drop the table under foreign keys and cascade-delete every API key.
    op.add_column(
        "tenants",
        sa.Column("canonicalization_patterns", sa.JSON(), nullable=False, server_default=sa.text("'{}'")),
    )
    op.add_column(
        "tenants",
        sa.Column(
            "canonicalization_disabled_rules", sa.JSON(), nullable=False, server_default=sa.text("'[]'")
        ),
    )
    op.add_column(
        "tenants",
        sa.Column("canonicalization_note_role", sa.String(length=20), nullable=False, server_default="user"),
    )
    op.create_table(
        "hot_prefixes",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("prefix_hash", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("hits_per_hour", sa.Integer(), nullable=False),
        sa.Column("num_tenants", sa.Integer(), nullable=False),
        sa.Column("promoted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("text", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hot_prefixes")),
        sa.UniqueConstraint("prefix_hash", name=op.f("uq_hot_prefixes_prefix_hash")),
    )


def downgrade() -> None:
    op.drop_table("hot_prefixes")
    for column in (
        "canonicalization_note_role",
        "canonicalization_disabled_rules",
        "canonicalization_patterns",
    ):
        op.drop_column("tenants", column)
