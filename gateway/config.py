"""Gateway configuration: defaults < TOML file < ``PREFIXGATE_*`` environment < command-line flags.

``load_config`` only reads; ``prepare_data_dir`` creates the data dir and generates (and stores, mode
0600) the admin token when none is given. The namespace secret is the deployment's, from the database
(``gateway.namespace_secret``), unless ``namespace_salt`` is configured.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_PREFIX = "PREFIXGATE_"


@dataclass(frozen=True, kw_only=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    data_dir: Path = Path("data")
    database_url: str | None = None  # None: SQLite file in the data dir
    worker_urls: tuple[str, ...] = ("http://127.0.0.1:8081",)
    admin_token: str | None = None  # None: admin API disabled (prepare_data_dir generates one)
    namespace_salt: str | None = field(default=None, repr=False)  # None: the database's (one per deployment)
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int = 1_000_000  # characters of messages / prompt, checked before rendering (413)
    max_in_flight: int = 512  # tenant requests in flight on this replica; more get 503 at once (0: no bound)
    cpu_threads: int = 4  # threads for render, canonicalize, tokenize, hash (off the event loop)
    cpu_queue_max: int = 64  # requests waiting for those threads; more get 503 at once
    header_timeout_s: float = 10.0  # a connection's first request head must be complete by then
    read_timeout_s: float = 30.0  # a request body must have arrived by then (408)
    default_max_tokens: int = 512  # when a request gives none (capped by the context window)
    policy_refresh_s: float = 0.5  # how often replicas poll for admin changes
    usage_flush_s: float = 0.5
    usage_batch_max: int = 512
    usage_spool_path: Path | None = None  # None: usage-spool.jsonl in the data dir
    usage_db_timeout_s: float = 5.0  # each usage write; a slower (hung) database means: spool it
    usage_rejected_retry_s: float = 300.0  # how often records the database refused are tried again
    # SIGTERM: requests in flight get this long, then are cut (recorded as "shutdown"); keep it under
    # the container's stop grace period minus usage_db_timeout_s (docker/compose.yaml: 20 s of 30 s).
    shutdown_grace_s: float = 20.0
    redis_url: str | None = None  # rate-limit and hot-prefix counters shared by replicas (None: per replica)
    router: str = "kv_aware"  # a key of gateway.routing.ROUTERS
    affinity_blocks: int = 4  # blocks hashed for prefix-affinity routing
    kv_index: bool = True  # follow the workers' KV events into a prefix index (gateway.kv_index)
    near_miss_min_blocks: int = 4  # near-miss tenants: consult FAISS when the exact index finds fewer
    near_miss_max_wait_ms: float = 15.0  # a request waits at most this for its head's embedding
    near_miss_embedding: str = "auto"  # "auto": int8 ONNX graph (else fp32), or "sentence-transformers"
    near_miss_cache_dir: str = ""  # where the exported ONNX graph is kept ("": <data_dir>/embeddings)
    worker_health_interval_s: float = 2.0
    worker_health_timeout_s: float = 2.0  # a worker that does not answer /healthz in this is lost (hung)
    worker_timeout_s: float = 600.0
    price_input_per_mtok: float = 1.0  # defaults for tenants without their own prices
    price_cached_input_per_mtok: float = 0.1
    price_output_per_mtok: float = 2.0
    promotion_min_hits: int = 1000  # hot-prefix promotion: hits per hour (PREFIXGATE_PROMOTION_MIN_HITS)
    promotion_min_tenants: int = 3  # and distinct opted-in tenants (raised to 2 if set lower)
    promotion_store_text: bool = False  # keep a promoted prefix's text for admins (off: hashes only)
    promotion_pause_s: float = 5.0  # promotion pauses this long after a counter (Redis) error
    ratelimit_pause_s: float = 5.0  # Redis rate limits pause (local limits) this long after an error
    purge_timeout_s: float = 120.0  # per worker, for POST /admin/v1/tenants/{id}/purge
    worker_secret: str | None = field(default=None, repr=False)  # bearer for the workers' API (worker.auth)
    metrics_token: str | None = field(default=None, repr=False)  # bearer for /metrics (None: admin token)
    metrics_tenant_labels: str = "id"  # "id" or "hash" (the tenant's opaque namespace id)
    log_level: str = "INFO"

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{(self.data_dir / 'prefixgate.db').resolve()}"

    @property
    def resolved_spool_path(self) -> Path:
        return self.usage_spool_path or self.data_dir / "usage-spool.jsonl"

    @property
    def salt_bytes(self) -> bytes:
        if not self.namespace_salt:
            raise ValueError("no namespace salt yet (the app reads the deployment's from the database)")
        return self.namespace_salt.encode()


_FIELDS = {f.name: f for f in dataclasses.fields(GatewayConfig)}


def _coerce(name: str, value: Any) -> Any:
    default = _FIELDS[name].default
    if name == "worker_urls":
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(item.strip().rstrip("/") for item in items if item.strip())
    if name in {"data_dir", "usage_spool_path"}:
        return None if value in (None, "") else Path(value)
    if isinstance(default, bool):
        return value if isinstance(value, bool) else str(value).lower() in {"1", "true", "yes", "on"}
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    return None if value == "" else value


def load_config(
    *,
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """Build the config. ``config_file`` defaults to ``$PREFIXGATE_CONFIG``; ``overrides`` (CLI flags)
    win, and None values in them are ignored."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
        data = data.get("gateway", data)
        unknown = set(data) - set(_FIELDS)
        if unknown:
            raise ValueError(f"unknown config key(s) in {path}: {', '.join(sorted(unknown))}")
        values.update({name: _coerce(name, value) for name, value in data.items()})
    for name in _FIELDS:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = _coerce(name, raw)
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = _coerce(name, value)
    return GatewayConfig(**values)


def _read_or_create_secret(path: Path, nbytes: int) -> str:
    if path.exists():
        return path.read_text().strip()
    value = secrets.token_urlsafe(nbytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    return value


def prepare_data_dir(config: GatewayConfig, *, generate_admin_token: bool = True) -> GatewayConfig:
    """Create the data dir; fill in a stored admin token when the config gives none.

    The namespace secret is not made here: a per-data-dir salt made replicas disagree on namespaces.
    """
    config.data_dir.mkdir(parents=True, exist_ok=True)
    changes: dict[str, Any] = {}
    if not config.admin_token and generate_admin_token:
        changes["admin_token"] = _read_or_create_secret(config.data_dir / "admin_token", 24)
    return dataclasses.replace(config, **changes) if changes else config
