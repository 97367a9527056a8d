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

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import blake3
import orjson

from gateway.config import OpenAIUpstreamConfig
from gateway.errors import (
    APIError,
    InvalidRequest,
    NotFoundError,
    PayloadTooLarge,
    Unavailable,
    UpstreamError,
)

log = logging.getLogger(__name__)


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
        return str(message), None if code is None else str(code), None if param is None else str(param)
    if isinstance(error, str):
        return error, None, None
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
        self._down_until: dict[str, float] = {}  # url -> time.monotonic() until which it is skipped

    def isolation_fields(self, namespace_key: bytes, client_key: str | None) -> dict[str, Any]:
        return FLAVOURS[self.config.flavour](self.name, namespace_key, client_key)

    @property
    def continuous_usage(self) -> bool:
        return self.config.flavour in CONTINUOUS_USAGE_FLAVOURS

    def urls_for(self, key: bytes) -> list[str]:
        """Rendezvous order, URLs found down (refused a connection lately) last."""
        now = time.monotonic()
        ordered = rendezvous_order(key, self.config.urls)
        return [u for u in ordered if self._down_until.get(u, 0) <= now] + [
            u for u in ordered if self._down_until.get(u, 0) > now
        ]

    def _headers(self, x_request_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": x_request_id}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    @contextlib.asynccontextmanager
    async def _open(
        self, urls: list[str], path: str, body: dict[str, Any], x_request_id: str
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The successful response of the first URL that takes the request. Leaving the block early
        (an error, the client gone) closes the connection instead of pooling it."""
        data = orjson.dumps(body)
        response: aiohttp.ClientResponse | None = None
        for url in urls:
            try:
                response = await self._session.post(
                    url + path, data=data, headers=self._headers(x_request_id), timeout=self._timeout
                )
                break
            except aiohttp.ClientConnectorError as exc:
                self._down_until[url] = time.monotonic() + self.config.down_s
                log.warning("upstream %s: %s refused the connection (%s)", self.name, url, type(exc).__name__)
            except aiohttp.ClientError as exc:
                raise UpstreamError(
                    f"upstream '{self.name}' connection lost: {type(exc).__name__}",
                    code="upstream_disconnected",
                ) from exc
            except TimeoutError as exc:
                raise Unavailable(
                    f"upstream '{self.name}' did not answer in time", code="upstream_timeout"
                ) from exc
        if response is None:
            raise UpstreamNotStarted(f"upstream '{self.name}' is unreachable", code="upstream_unreachable")
        finished = False
        try:
            if response.status >= 400:
                error_body = await response.read()
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
            raw = await response.read()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            raise UpstreamError(f"upstream '{self.name}' sent an unreadable answer", code="upstream_error")
        return data

    async def stream(
        self, route: UpstreamRoute, path: str, body: dict[str, Any], x_request_id: str
    ) -> AsyncIterator[dict[str, Any]]:
        """The upstream's SSE chunks as dicts (``[DONE]`` ends it). Closing the iterator early (client
        gone) closes the connection, which vLLM/SGLang/OpenAI treat as an abort. An ``{"error"}`` chunk
        or a broken connection raises ``UpstreamError``."""
        async with self._open(route.urls, path, body, x_request_id) as response:
            async for line in response.content:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue  # blank lines, ": keep-alive" comments, "event:" lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    raise UpstreamError(
                        f"upstream '{self.name}' sent an unreadable stream chunk", code="upstream_error"
                    ) from None
                if not isinstance(chunk, dict):
                    continue
                if chunk.get("error"):
                    message, _, _ = _upstream_message(data, 500)
                    raise UpstreamError(f"upstream '{self.name}' error: {message}", code="upstream_error")
                yield chunk


class UpstreamRegistry:
    """The configured external upstreams, by the model ids tenants use."""

    def __init__(
        self, configs: tuple[OpenAIUpstreamConfig, ...], session: aiohttp.ClientSession | None
    ) -> None:
        self.upstreams = [OpenAIUpstream(config, session) for config in configs] if session else []
        self._by_model = {model: up for up in self.upstreams for model, _ in up.config.models}

    @property
    def model_ids(self) -> list[str]:
        return sorted(self._by_model)

    def upstream_for(self, model_id: str) -> OpenAIUpstream | None:
        return self._by_model.get(model_id)

    def route(self, model_id: str, key: bytes) -> UpstreamRoute:
        upstream = self._by_model[model_id]
        model = upstream.config.upstream_model(model_id) or model_id
        return UpstreamRoute(upstream=upstream, model=model, urls=upstream.urls_for(key))
