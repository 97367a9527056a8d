"""Client of external OpenAI-compatible upstreams (vLLM, SGLang, llama.cpp, Ollama, OpenAI, another
prefixgate): where a request goes, what isolation field it carries, and how upstream errors map.

- **Isolation.** The tenant's namespace key (server-derived: secret salt, tenant, epoch) becomes an
  opaque per-upstream value: vLLM's and SGLang's ``cache_salt`` (their prefix caches are keyed by it),
  or OpenAI's ``prompt_cache_key`` (its cache-routing hint; mixed with the client's own key, so a client
  key only ever splits its tenant's namespace). The raw namespace key never leaves the gateway, and a
  client-sent ``cache_salt``/``prompt_cache_key`` never reaches the upstream as such.
- **Routing.** Among one upstream's URLs, rendezvous hashing of an affinity key derived inside the
  tenant's namespace (the canonical prompt head, or the client's ``prompt_cache_key``): one tenant's
  prompts with the same head go to the same replica, where its prefix is cached. A URL that refuses a
  connection is skipped for ``down_s`` and the request goes to the next URL (it never started there).
- **Errors.** Upstream 4xx keep their message (400, or 404/413 as sent); 401/403 (the gateway's own
  credentials) and 5xx are 502; 429 (the shared upstream is saturated, not the tenant's limit) and
  refused connections or timeouts are 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import blake3
import orjson
from aiohttp.http_exceptions import LineTooLong
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from yarl import URL

from gateway.config import OpenAIUpstreamConfig
from gateway.errors import (
    APIError,
    InvalidRequest,
    NotFoundError,
    PayloadTooLarge,
    Unavailable,
    UpstreamError,
)
from gateway.upstream_health import CircuitBreaker

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 32 << 20  # a non-streamed answer larger than this is refused (502), not buffered
MAX_ERROR_BYTES = 64 << 10  # of an error body, only this much is read (its message)
_DONE = object()  # the end of an SSE stream


def _derived(label: bytes, upstream_name: str, namespace_key: bytes, extra: bytes = b"") -> str:
    """An opaque value of a tenant's namespace for one upstream: the key itself is never sent."""
    data = label + b"\0" + upstream_name.encode() + b"\0" + namespace_key + b"\0" + extra
    return blake3.blake3(data).hexdigest()[:48]


def _cache_salt(upstream_name: str, namespace_key: bytes, client_key: str | None) -> dict[str, Any]:
    return {"cache_salt": _derived(b"prefixgate/cache_salt", upstream_name, namespace_key)}


def _prompt_cache_key(upstream_name: str, namespace_key: bytes, client_key: str | None) -> dict[str, Any]:
    extra = b"" if client_key is None else client_key.encode()
    return {"prompt_cache_key": _derived(b"prefixgate/prompt_cache_key", upstream_name, namespace_key, extra)}


def _nothing(upstream_name: str, namespace_key: bytes, client_key: str | None) -> dict[str, Any]:
    return {}


IsolationField = Callable[[str, bytes, str | None], dict[str, Any]]

# flavour -> the fields carrying a tenant's namespace to that kind of server
FLAVOURS: dict[str, IsolationField] = {
    "vllm": _cache_salt,
    "sglang": _cache_salt,
    "openai": _prompt_cache_key,
    "none": _nothing,
}
# Fields a client may send that an upstream would read as a cache namespace: never forwarded as sent.
CLIENT_ISOLATION_FIELDS = ("cache_salt", "prompt_cache_key")
# Servers that report usage on every stream chunk when asked (exact billing of a cut stream).
CONTINUOUS_USAGE_FLAVOURS = frozenset({"vllm", "sglang"})


def affinity_key(namespace_key: bytes, head: bytes, client_key: str | None) -> bytes:
    """The routing key of a request, inside its tenant's namespace."""
    if client_key:
        return blake3.blake3(b"prompt-cache-key\0" + namespace_key + client_key.encode()).digest()
    return blake3.blake3(b"upstream-head\0" + namespace_key + b"\0" + head).digest()


def rendezvous_order(key: bytes, urls: tuple[str, ...]) -> list[str]:
    """URLs by descending highest-random-weight score for ``key``."""
    return sorted(urls, key=lambda url: blake3.blake3(key + b"\0" + url.encode()).digest(8), reverse=True)


class UpstreamNotStarted(Unavailable):
    """The upstream URL refused the connection: the request never reached it (try another URL)."""


def _upstream_message(body: bytes, status: int) -> tuple[str, str | None, str | None]:
    """message, code, param of an upstream error body (OpenAI's shape, FastAPI's ``detail``, text)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        text = body.decode(errors="replace").strip()[:500]
        return text or f"HTTP {status}", None, None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        message = error.get("message") or f"HTTP {status}"
        code, param = error.get("code"), error.get("param")
        code, param = None if code is None else str(code)[:100], None if param is None else str(param)[:100]
        return str(message)[:500], code, param
    if isinstance(error, str):
        return error[:500], None, None
    detail = data.get("detail") if isinstance(data, dict) else None
    if detail is not None:
        return (detail if isinstance(detail, str) else orjson.dumps(detail).decode())[:500], None, None
    return f"HTTP {status}", None, None


def map_upstream_error(name: str, status: int, body: bytes, headers: Mapping[str, str]) -> APIError:
    """The tenant-facing error for an upstream's HTTP error."""
    message, code, param = _upstream_message(body, status)
    if status in (401, 403):  # the gateway's credentials: nothing the tenant can fix
        log.error("upstream %s refused the gateway's credentials (HTTP %d): %s", name, status, message)
        return UpstreamError(f"upstream '{name}' refused the gateway's credentials", code="upstream_auth")
    if status == 429:
        try:
            retry_s = max(1, min(60, int(float(headers.get("Retry-After", "1")))))
        except ValueError:
            retry_s = 1
        return Unavailable(
            f"upstream '{name}' is saturated: {message}", code="upstream_overloaded", retry_after_s=retry_s
        )
    if 400 <= status < 500:
        kind: type[APIError] = {404: NotFoundError, 413: PayloadTooLarge}.get(status, InvalidRequest)
        return kind(message, code=code, param=param)
    return UpstreamError(f"upstream '{name}' error (HTTP {status}): {message}", code="upstream_error")


@dataclass(frozen=True, kw_only=True, slots=True)
class UpstreamRoute:
    """Where one request goes: the upstream, its URLs in preference order, the upstream model name."""

    upstream: OpenAIUpstream
    model: str
    urls: list[str]


class OpenAIUpstream:
    """One external upstream (``OpenAIUpstreamConfig``) over a shared ``aiohttp.ClientSession`` that
    carries no gateway secret (the workers' bearer is never sent to a third party)."""

    def __init__(self, config: OpenAIUpstreamConfig, session: aiohttp.ClientSession) -> None:
        self.config = config
        self.name = config.name
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s, sock_connect=config.connect_timeout_s)
        self.health = CircuitBreaker(
            config.urls,
            failure_threshold=config.failure_threshold,
            cooldown_s=config.down_s,
            probe_window_s=config.connect_timeout_s,
        )

    def isolation_fields(self, namespace_key: bytes, client_key: str | None) -> dict[str, Any]:
        return FLAVOURS[self.config.flavour](self.name, namespace_key, client_key)

    @property
    def continuous_usage(self) -> bool:
        return self.config.flavour in CONTINUOUS_USAGE_FLAVOURS

    def urls_for(self, key: bytes) -> list[str]:
        """Rendezvous order (``_open`` skips the URLs whose circuit breaker is open)."""
        return rendezvous_order(key, self.config.urls)

    def _headers(self, x_request_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": x_request_id}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    def _failed(self, url: str, kind: str) -> None:
        if self.health.failure(url, kind):
            log.warning("upstream %s: %s is skipped for a while after %s", self.name, _label(url), kind)

    async def _post(
        self, url: str, path: str, data: bytes, x_request_id: str
    ) -> aiohttp.ClientResponse | None:
        """The response of ``url``, or None when the request never reached it (refused, connect timeout:
        the next URL may take it). Only those count against the URL's circuit breaker: they say the URL
        cannot take work whatever the request. A request that was sent and then timed out or lost its
        connection may be the request's own doing (one tenant's long generation); counting it would let
        that tenant open the URL for every tenant. A hung server is the active probe's to find."""
        try:
            response = await self._session.post(
                url + path, data=data, headers=self._headers(x_request_id), timeout=self._timeout
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            self._failed(url, type(exc).__name__)
            log.warning("upstream %s: %s did not take the connection (%s)", self.name, _label(url), exc)
            return None
        except aiohttp.ClientError as exc:  # sent (at least in part), then the connection was lost
            raise UpstreamError(
                f"upstream '{self.name}' connection lost: {type(exc).__name__}", code="upstream_disconnected"
            ) from exc
        except TimeoutError as exc:  # connected, sent, and no answer before the request's timeout
            raise Unavailable(
                f"upstream '{self.name}' did not answer in time", code="upstream_timeout"
            ) from exc
        self.health.success(url)  # any HTTP answer: the server is there
        return response

    @contextlib.asynccontextmanager
    async def _open(
        self, urls: list[str], path: str, body: dict[str, Any], x_request_id: str
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The successful response of the first URL that takes the request: URLs with an open circuit
        breaker are skipped, and tried last (in order) only when no other took it. Leaving the block
        early (an error, the client gone) closes the connection instead of pooling it."""
        data = orjson.dumps(body)
        response: aiohttp.ClientResponse | None = None
        skipped = []
        for url in urls:
            if not self.health.allow(url):
                skipped.append(url)
                continue
            if (response := await self._post(url, path, data, x_request_id)) is not None:
                break
        else:
            for url in skipped:  # every URL is down or skipped: try the open ones anyway
                if (response := await self._post(url, path, data, x_request_id)) is not None:
                    break
        if response is None:
            raise UpstreamNotStarted(f"upstream '{self.name}' is unreachable", code="upstream_unreachable")
        finished = False
        try:
            if response.status >= 400:
                error_body = await _read_capped(response, MAX_ERROR_BYTES, self.name, truncate=True)
                raise map_upstream_error(self.name, response.status, error_body, response.headers)
            yield response
            finished = True
        except aiohttp.ClientError as exc:
            raise UpstreamError(
                f"upstream '{self.name}' connection lost: {type(exc).__name__}", code="upstream_disconnected"
            ) from exc
        except TimeoutError as exc:
            raise Unavailable(
                f"upstream '{self.name}' did not finish in time", code="upstream_timeout"
            ) from exc
        finally:
            if finished:
                response.release()
            else:
                response.close()

    async def complete(
        self, route: UpstreamRoute, path: str, body: dict[str, Any], x_request_id: str
    ) -> dict[str, Any]:
        """A non-streamed answer (``path``: /chat/completions or /completions)."""
        async with self._open(route.urls, path, body, x_request_id) as response:
            raw = await _read_capped(response, MAX_ANSWER_BYTES, self.name)
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            log.warning("upstream %s sent an answer that is not a JSON object: %r", self.name, raw[:200])
            raise UpstreamError(f"upstream '{self.name}' sent an unreadable answer", code="upstream_error")
        return data

    async def stream(
        self, route: UpstreamRoute, path: str, body: dict[str, Any], x_request_id: str
    ) -> AsyncIterator[dict[str, Any]]:
        """The upstream's SSE chunks as dicts (``[DONE]`` ends it). Closing the iterator early (client
        gone) closes the connection, which vLLM/SGLang/OpenAI treat as an abort. An ``{"error"}`` chunk,
        an unreadable, malformed or oversized line, a stream without any chunk, or a broken connection
        raises ``UpstreamError``."""
        async with self._open(route.urls, path, body, x_request_id) as response:
            num_chunks = 0
            try:
                async for line in response.content:
                    chunk = self._sse_chunk(line.strip())
                    if chunk is _DONE:
                        break
                    if chunk is not None:
                        num_chunks += 1
                        yield chunk
            except (LineTooLong, ValueError) as exc:  # aiohttp: a line longer than its buffer
                log.warning("upstream %s sent an oversized stream line: %s", self.name, exc)
                raise UpstreamError(
                    f"upstream '{self.name}' sent an oversized stream line", code="upstream_error"
                ) from None
            if num_chunks == 0:  # not an SSE stream of chunks (an NDJSON server, an HTML page …)
                log.warning("upstream %s sent a stream without any data chunk", self.name)
                raise UpstreamError(
                    f"upstream '{self.name}' sent a stream without any data chunk", code="upstream_error"
                )

    def _sse_chunk(self, line: bytes) -> Any:
        """The chunk of one SSE line: a dict, ``_DONE``, or None (nothing to relay). Raises
        ``UpstreamError`` for an error event and for what is not an OpenAI chunk."""
        if not line.startswith(b"data:"):
            return None  # blank lines, ": keep-alive" comments, "event:" lines
        data = line[5:].strip()
        if data == b"[DONE]":
            return _DONE
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            chunk = _DONE  # a sentinel that is not a dict: refused below
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not isinstance(chunk, dict) or (
            choices is not None
            and not (isinstance(choices, list) and all(isinstance(choice, dict) for choice in choices))
        ):
            log.warning("upstream %s sent an unreadable stream chunk: %r", self.name, data[:200])
            raise UpstreamError(
                f"upstream '{self.name}' sent a malformed stream chunk", code="upstream_error"
            )
        if chunk.get("error"):
            message, _, _ = _upstream_message(data, 500)
            raise UpstreamError(f"upstream '{self.name}' error: {message}", code="upstream_error")
        return chunk

    async def probe(self, url: str) -> bool:
        """``GET /models`` on ``url`` within the connect timeout: any HTTP answer is alive."""
        timeout = aiohttp.ClientTimeout(total=self.config.connect_timeout_s)
        try:
            async with self._session.get(url + "/models", headers=self._headers("probe"), timeout=timeout):
                pass
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._failed(url, f"probe: {type(exc).__name__}")
            return False
        self.health.success(url)
        return True

    async def probe_forever(self) -> None:
        """The active health check: every ``probe_interval_s`` (jittered ±20 %), each URL in turn."""
        interval = self.config.probe_interval_s
        while True:
            await asyncio.sleep(interval * (0.8 + 0.4 * random.random()))
            await asyncio.gather(*(self.probe(url) for url in self.config.urls))


async def _read_capped(
    response: aiohttp.ClientResponse, limit: int, name: str, *, truncate: bool = False
) -> bytes:
    """The body, at most ``limit`` bytes: a larger answer is an ``UpstreamError`` (or, ``truncate``,
    cut at the limit: an error body only needs its message)."""
    parts, size = [], 0
    async for part in response.content.iter_chunked(1 << 16):
        parts.append(part)
        size += len(part)
        if size > limit:
            if truncate:
                break
            log.warning("upstream %s sent an answer over %d bytes", name, limit)
            raise UpstreamError(
                f"upstream '{name}' sent an answer over {limit // (1 << 20)} MiB", code="upstream_error"
            )
    return b"".join(parts)[:limit]


def _label(url: str) -> str:
    """A URL without credentials, for logs and metric labels."""
    return str(URL(url).with_user(None))


class UpstreamRegistry:
    """The configured external upstreams, by the model ids tenants use; runs their health probes."""

    def __init__(
        self, configs: tuple[OpenAIUpstreamConfig, ...], session: aiohttp.ClientSession | None
    ) -> None:
        self.upstreams = [OpenAIUpstream(config, session) for config in configs] if session else []
        self._by_model = {model: up for up in self.upstreams for model, _ in up.config.models}
        self._probes: list[asyncio.Task[None]] = []

    @property
    def model_ids(self) -> list[str]:
        return sorted(self._by_model)

    def upstream_for(self, model_id: str) -> OpenAIUpstream | None:
        return self._by_model.get(model_id)

    def route(self, model_id: str, key: bytes) -> UpstreamRoute:
        upstream = self._by_model[model_id]
        model = upstream.config.upstream_model(model_id) or model_id
        return UpstreamRoute(upstream=upstream, model=model, urls=upstream.urls_for(key))

    def start(self, registry: CollectorRegistry | None = None) -> None:
        """Export each URL's health on ``registry``; start the active probes that are configured."""
        if registry is not None and self.upstreams:
            registry.register(_HealthCollector(self.upstreams))
        self._probes = [
            asyncio.create_task(up.probe_forever(), name=f"upstream-probe-{up.name}")
            for up in self.upstreams
            if up.config.probe_interval_s > 0
        ]

    async def close(self) -> None:
        for task in self._probes:
            task.cancel()
        for task in self._probes:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._probes = []


class _HealthCollector(Collector):
    """``prefixgate_upstream_url_healthy{upstream,url}``: 1 while a URL's circuit breaker is closed."""

    def __init__(self, upstreams: list[OpenAIUpstream]) -> None:
        self._upstreams = upstreams

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "prefixgate_upstream_url_healthy",
            "1 while an external upstream URL's circuit breaker is closed, 0 while open or half-open",
            labels=["upstream", "url"],
        )
        for upstream in self._upstreams:
            for url in upstream.config.urls:
                family.add_metric([upstream.name, _label(url)], 1.0 if upstream.health.healthy(url) else 0.0)
        yield family
