"""Gateway configuration: defaults < TOML file < ``PREFIXGATE_*`` environment < command-line flags.

``load_config`` only reads; ``prepare_data_dir`` creates the data dir and generates (and stores, mode
0600) the admin token when none is given. The namespace secret is the deployment's, from the database
(``gateway.namespace_secret``), unless ``namespace_salt`` is configured.

Upstreams: ``worker_urls`` are bundled workers (``worker/``); ``openai_upstreams`` are external
OpenAI-compatible servers (vLLM, SGLang, llama.cpp, Ollama, OpenAI), each an ``OpenAIUpstreamConfig``
given as a TOML array of tables, or as JSON in ``PREFIXGATE_OPENAI_UPSTREAMS`` / ``--openai-upstream``
(docs/upstreams.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policies.promotion import PromotionPolicy

ENV_PREFIX = "PREFIXGATE_"

# How a tenant's server-derived namespace reaches an external upstream (gateway.upstream_openai.FLAVOURS).
UPSTREAM_FLAVOURS = ("vllm", "sglang", "openai", "none")


@dataclass(frozen=True, kw_only=True, slots=True)
class OpenAIUpstreamConfig:
    """One external OpenAI-compatible upstream: one or more replicas serving the same models."""

    name: str  # for logs, metrics and error messages (never the URL's credentials)
    urls: tuple[str, ...]  # base URLs as an OpenAI SDK's base_url, e.g. http://vllm:8000/v1
    models: tuple[tuple[str, str], ...]  # (model id tenants use, the upstream's model name)
    flavour: str = "none"  # vllm/sglang: cache_salt; openai: prompt_cache_key; none: no isolation field
    api_key: str | None = field(default=None, repr=False)  # sent as the bearer; never logged
    timeout_s: float = 600.0  # a whole request (streams included)
    connect_timeout_s: float = 5.0
    down_s: float = 5.0  # cool-down of a URL's open circuit breaker (gateway.upstream_health)
    failure_threshold: int = 2  # consecutive connect failures/timeouts that open a URL's breaker
    probe_interval_s: float = 10.0  # active health probe (GET /v1/models) of each URL; 0: off

    def upstream_model(self, model_id: str) -> str | None:
        return dict(self.models).get(model_id)


_UPSTREAM_KEYS = {"name", "url", "urls", "models", "flavour", "api_key", "api_key_env", "timeout_s"}
_UPSTREAM_KEYS |= {"connect_timeout_s", "down_s", "failure_threshold", "probe_interval_s"}


def parse_upstream(raw: Mapping[str, Any], env: Mapping[str, str], index: int = 0) -> OpenAIUpstreamConfig:
    """An upstream from its TOML table / JSON object. ``models`` is a list of names (served under the
    same name) or a table ``{tenant-facing id = upstream name}``; ``api_key_env`` names an environment
    variable holding the key (keeps it out of config files)."""
    unknown = set(raw) - _UPSTREAM_KEYS
    if unknown:
        raise ValueError(f"unknown openai_upstreams key(s): {', '.join(sorted(unknown))}")
    urls = raw.get("urls") or ([raw["url"]] if raw.get("url") else [])
    if isinstance(urls, str):
        urls = urls.split(",")
    urls = tuple(str(url).strip().rstrip("/") for url in urls if str(url).strip())
    if not urls:
        raise ValueError("an openai upstream needs 'url' or 'urls'")
    models = raw.get("models") or {}
    pairs = models.items() if isinstance(models, Mapping) else ((str(m), str(m)) for m in models)
    models = tuple((str(public), str(upstream)) for public, upstream in pairs)
    if not models:
        raise ValueError("an openai upstream needs 'models' (the model ids it serves)")
    flavour = str(raw.get("flavour", "none"))
    if flavour not in UPSTREAM_FLAVOURS:
        raise ValueError(f"openai upstream flavour must be one of {UPSTREAM_FLAVOURS}, not {flavour!r}")
    api_key = raw.get("api_key")
    if raw.get("api_key_env"):
        api_key = env.get(str(raw["api_key_env"])) or None
    return OpenAIUpstreamConfig(
        name=str(raw.get("name") or f"upstream-{index}"),
        urls=urls,
        models=models,
        flavour=flavour,
        api_key=None if api_key in (None, "") else str(api_key),
        timeout_s=float(raw.get("timeout_s", 600.0)),
        connect_timeout_s=float(raw.get("connect_timeout_s", 5.0)),
        down_s=float(raw.get("down_s", 5.0)),
        failure_threshold=max(1, int(raw.get("failure_threshold", 2))),
        probe_interval_s=max(0.0, float(raw.get("probe_interval_s", 10.0))),
    )


def parse_upstreams(value: Any, env: Mapping[str, str] | None = None) -> tuple[OpenAIUpstreamConfig, ...]:
    """``openai_upstreams`` from TOML (a list of tables) or JSON text (a list of objects, or one)."""
    env = os.environ if env is None else env
    items = value if isinstance(value, list | tuple) else [value]
    raws: list[Any] = []
    for item in items:
        if isinstance(item, OpenAIUpstreamConfig):
            raws.append(item)
            continue
        if isinstance(item, str):
            if not item.strip():
                continue
            item = json.loads(item)
        raws.extend(item if isinstance(item, list) else [item])
    upstreams = tuple(
        raw if isinstance(raw, OpenAIUpstreamConfig) else parse_upstream(raw, env, index)
        for index, raw in enumerate(raws)
    )
    public = [model for upstream in upstreams for model, _ in upstream.models]
    duplicated = sorted({model for model in public if public.count(model) > 1})
    if duplicated:
        raise ValueError(f"model id(s) served by more than one openai upstream: {', '.join(duplicated)}")
    return upstreams


@dataclass(frozen=True, kw_only=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    data_dir: Path = Path("data")
    database_url: str | None = None  # None: SQLite file in the data dir
    worker_urls: tuple[str, ...] = ("http://127.0.0.1:8081",)  # bundled workers ("" for none)
    openai_upstreams: tuple[OpenAIUpstreamConfig, ...] = ()  # external OpenAI-compatible servers
    admin_token: str | None = None  # None: admin API disabled (prepare_data_dir generates one)
    namespace_salt: str | None = field(default=None, repr=False)  # None: the database's (one per deployment)
    max_body_bytes: int = 4 * 1024 * 1024
    max_reading_body_bytes: int = 256 * 1024 * 1024  # bodies being read at once (Content-Length); 503 past it
    max_prompt_chars: int = 1_000_000  # characters of messages / prompt, checked before rendering (413)
    # n × max_tokens × (1 + top_logprobs) a non-streamed answer may hold (built whole in memory); more is a
    # 400 that says to stream. 262,144 serves every plain answer of a 32k window at n = 8 (0: no limit)
    max_answer_units: int = 262_144
    max_in_flight: int = 512  # tenant requests in flight on this replica; more get 503 at once (0: no bound)
    tenant_in_flight_share: float = 0.5  # of max_in_flight one tenant may hold (429 past it); 1.0: no share
    cpu_threads: int = 4  # threads for render, canonicalize, tokenize, hash (off the event loop)
    cpu_queue_max: int = 64  # requests waiting for those threads; more get 503 at once
    header_timeout_s: float = 10.0  # a connection's first request head must be complete by then
    read_timeout_s: float = 30.0  # a request body must have arrived by then (408)
    stream_write_timeout_s: float = 30.0  # an answer's client taking no byte for this long is cut
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
    kv_events_max_bytes: int = 16 << 20  # a KV-event answer past this is refused unread (4,096 events: ~1 MB)
    kv_index_max_remote_ttl_s: float = 86400.0  # a worker's reported Redis TTL is trusted up to this
    near_miss_min_blocks: int = 4  # near-miss tenants: consult FAISS when the exact index finds fewer
    near_miss_max_wait_ms: float = 0.0  # > 0: FAISS on, a request waits at most this for its embedding
    near_miss_embedding: str = "auto"  # "auto": int8 ONNX graph (else fp32), or "sentence-transformers"
    near_miss_cache_dir: str = ""  # where the exported ONNX graph is kept ("": <data_dir>/embeddings)
    worker_health_interval_s: float = 2.0
    worker_health_timeout_s: float = 2.0  # a worker that does not answer /healthz in this is lost (hung)
    worker_timeout_s: float = 600.0
    price_input_per_mtok: float = 1.0  # defaults for tenants without their own prices
    price_cached_input_per_mtok: float = 0.1
    price_output_per_mtok: float = 2.0
    promotion_min_hits: int = 1000  # hot-prefix promotion: hits per hour (PREFIXGATE_PROMOTION_MIN_HITS)
    promotion_min_tenants: int = 3  # and distinct opted-in tenants (raised to 3 if set lower)
    promotion_store_text: bool = False  # keep a promoted prefix's text for admins (off: hashes only)
    promotion_pause_s: float = 5.0  # promotion pauses this long after a counter (Redis) error
    ratelimit_pause_s: float = 5.0  # Redis rate limits pause (local limits) this long after an error
    purge_timeout_s: float = 120.0  # per worker, for POST /admin/v1/tenants/{id}/purge
    # A delete fences the tenant (keys revoked), waits for the other replicas' policy polls, then purges:
    # min(2 × policy_refresh_s + 0.5, delete_fence_max_s) seconds (docs/security.md).
    delete_fence_max_s: float = 10.0  # below the CLI's 30 s admin timeout
    worker_secret: str | None = field(default=None, repr=False)  # bearer for the workers' API (worker.auth)
    metrics_token: str | None = field(default=None, repr=False)  # bearer for /metrics (None: admin token)
    metrics_tenant_labels: str = "id"  # "id" or "hash" (the tenant's opaque namespace id)
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        PromotionPolicy(
            min_hits_per_hour=self.promotion_min_hits, min_tenants=self.promotion_min_tenants
        ).check_threshold()

    @property
    def delete_fence_s(self) -> float:
        """How long a delete waits between fencing the tenant and purging: two of every replica's policy
        polls (replicas share this config) plus a reload, bounded by ``delete_fence_max_s``."""
        return max(0.0, min(2 * self.policy_refresh_s + 0.5, self.delete_fence_max_s))

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


def _coerce(name: str, value: Any, env: Mapping[str, str] | None = None) -> Any:
    default = _FIELDS[name].default
    if name == "openai_upstreams":
        return parse_upstreams(value, env)
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
        values.update({name: _coerce(name, value, env) for name, value in data.items()})
    for name in _FIELDS:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = _coerce(name, raw, env)
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = _coerce(name, value, env)
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
