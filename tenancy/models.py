"""SQLAlchemy 2.0 typed ORM: tenants, API keys, the admin audit log, hot prefixes and usage records.

Only a SHA-256 hash of an API key is stored. Usage records keep the tenant id as plain text (no
foreign key) so that billing history survives the deletion of a tenant.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # "tn_" + random hex
    name: Mapped[str] = mapped_column(String(200), unique=True)
    isolation: Mapped[str] = mapped_column(String(20), default="namespace")
    reserved_blocks: Mapped[int] = mapped_column(Integer, default=0)  # dedicated quota per tier
    canonicalization: Mapped[str] = mapped_column(String(10), default="report")  # on|report|off
    # Extra fragment patterns (name -> regex), built-in rules turned off, role of the trailing note.
    canonicalization_patterns: Mapped[dict] = mapped_column(JSON, default=dict)
    canonicalization_disabled_rules: Mapped[list] = mapped_column(JSON, default=list)
    canonicalization_note_role: Mapped[str] = mapped_column(String(20), default="user")
    share_hot_prefixes: Mapped[bool] = mapped_column(Boolean, default=False)
    near_miss_routing: Mapped[bool] = mapped_column(Boolean, default=False)  # FAISS near-miss fallback
    epoch: Mapped[int] = mapped_column(Integer, default=0)  # bumped by `invalidate`: fresh namespace key
    price_input_per_mtok: Mapped[float | None] = mapped_column(Float, nullable=True)  # None: default
    price_cached_input_per_mtok: Mapped[float | None] = mapped_column(Float, nullable=True)
    price_output_per_mtok: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_tokens_limit: Mapped[int | None] = mapped_column(Integer, nullable=True)  # cap on max_tokens
    rate_limit_rpm: Mapped[int | None] = mapped_column(Integer, nullable=True)  # per gateway replica
    rate_limit_tpm: Mapped[int | None] = mapped_column(Integer, nullable=True)  # prompt + max_tokens
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer, nullable=True)  # per replica
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    keys: Mapped[list[ApiKey]] = relationship(
        back_populates="tenant", lazy="raise_on_sql", cascade="all, delete-orphan", passive_deletes=True
    )


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # "key_" + random hex
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret key
    key_prefix: Mapped[str] = mapped_column(String(16))  # first characters, to recognise a key
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    tenant: Mapped[Tenant] = relationship(back_populates="keys", lazy="raise_on_sql")


class PolicyVersion(Base):
    """One row, bumped by every admin change: the marker replicas poll to reload tenant policies.

    Not the audit log's max id: with concurrent transactions ids are not assigned in commit order, so a
    change could commit below a max id a replica has already seen. The row lock of this update orders
    admin changes by commit instead.
    """

    __tablename__ = "policy_version"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # always 1
    version: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), default=0)


class AuditLog(Base):
    """One row per admin change."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    actor: Mapped[str] = mapped_column(String(100))
    action: Mapped[str] = mapped_column(String(50))
    tenant_id: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True)
    details: Mapped[dict] = mapped_column(JSON, default=dict)  # never holds keys or tokens


class HotPrefix(Base):
    """A promoted hot prefix: hashed in the global namespace for every opted-in tenant.

    Never records which tenants sent it. ``text`` (optional) is shown to an admin only on request by id.
    A revoked row stays, so that the prefix is not promoted straight back.
    """

    __tablename__ = "hot_prefixes"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # "hp_" + random hex
    prefix_hash: Mapped[str] = mapped_column(String(64), unique=True)  # global-form hash, hex
    model: Mapped[str] = mapped_column(String(200))  # model id it was seen with (the hash covers it)
    num_tokens: Mapped[int] = mapped_column(Integer)  # block-aligned prefix length
    hits_per_hour: Mapped[int] = mapped_column(Integer)  # at promotion
    num_tenants: Mapped[int] = mapped_column(Integer)  # distinct tenants at promotion (capped)
    promoted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    text: Mapped[str | None] = mapped_column(Text, nullable=True)  # the decoded prefix, if stored


class UsageRecord(Base):
    __tablename__ = "usage_records"
    __table_args__ = (
        Index("ix_usage_records_tenant_hour", "tenant_id", "created_hour"),
        Index("ix_usage_records_hour", "created_hour"),
        # The per-request export's order and cursor, for all tenants and for one.
        Index("ix_usage_records_xact_id", "xact_id", "id"),
        Index("ix_usage_records_tenant_xact_id", "tenant_id", "xact_id", "id"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    request_id: Mapped[str] = mapped_column(String(80), unique=True)  # idempotent replay key
    tenant_id: Mapped[str] = mapped_column(String(40))
    tenant_name: Mapped[str | None] = mapped_column(String(200), nullable=True)  # when it ran
    key_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    end_user: Mapped[str | None] = mapped_column(String(200), nullable=True)  # the `user` field
    model: Mapped[str] = mapped_column(String(200))
    endpoint: Mapped[str] = mapped_column(String(40))
    status: Mapped[int] = mapped_column(Integer)  # HTTP status returned to the tenant
    # Who ended it (tenancy.usage_types.OUTCOMES); NULL only on rows older than migration 0003.
    outcome: Mapped[str | None] = mapped_column(String(20), nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_l1_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_l2_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_l3_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_remote_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    prefill_ms: Mapped[float] = mapped_column(Float, default=0.0)
    saved_prefill_ms: Mapped[float] = mapped_column(Float, default=0.0)
    # Unit prices (per million tokens) and cost frozen when the request ran: reports never re-price.
    price_input_per_mtok: Mapped[float] = mapped_column(Float, default=0.0)
    price_cached_input_per_mtok: Mapped[float] = mapped_column(Float, default=0.0)
    price_output_per_mtok: Mapped[float] = mapped_column(Float, default=0.0)
    cost_uncached_input: Mapped[float] = mapped_column(Float, default=0.0)
    cost_cached_input: Mapped[float] = mapped_column(Float, default=0.0)
    cost_output: Mapped[float] = mapped_column(Float, default=0.0)
    cost_total: Mapped[float] = mapped_column(Float, default=0.0)
    # False: the tokens were used but nothing was delivered (format_error): kept to be seen, cost 0.
    billable: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    created_hour: Mapped[int] = mapped_column(Integer)  # hours since the Unix epoch: portable grouping
    # The writing transaction's id, set by PostgreSQL (migration 0008; never sent): the export's order.
    # 0 on SQLite, which serializes writes, and on rows older than 0008.
    xact_id: Mapped[int] = mapped_column(BigInteger, server_default="0")


class NamespaceSecret(Base):
    """The deployment's namespace secret, one row per epoch; the highest epoch is in force.

    Every gateway replica derives tenants' namespace keys and ids from it, so all replicas agree on
    namespaces (purges reach every block, caches do not split). Rotating adds a row: every namespace
    key changes, which invalidates every cached block at once.
    """

    __tablename__ = "namespace_secrets"

    epoch: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    secret: Mapped[str] = mapped_column(String(200))  # url-safe random text; never logged or returned
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
