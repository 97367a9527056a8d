"""Client of the worker HTTP API (docs/worker-api.md)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from yarl import URL

from gateway.errors import APIError, InvalidRequest, Unavailable, UpstreamError

log = logging.getLogger(__name__)


def _dumps(data: Any) -> bytes:
    return orjson.dumps(data)


async def _read_json(response: aiohttp.ClientResponse) -> Any:
    return orjson.loads(await response.read())


class WorkerNotStarted(Unavailable):
    """The worker did not take the request (unreachable, or its queue is full): nothing ran there, so
    the gateway may send it to another worker; with none left the tenant gets 503 and Retry-After."""


def _retry_after_s(response: aiohttp.ClientResponse) -> int:
    try:
        return max(1, min(60, int(float(response.headers.get("Retry-After", "1")))))
    except ValueError:
        return 1


async def _raise_for_worker_error(response: aiohttp.ClientResponse) -> None:
    """Map a worker error: 4xx keeps its message and code (the worker validated our request), 503 with
    Retry-After (its queue is full, the request never started) is ``WorkerNotStarted``, other 5xx
    (an engine error in the request, a partial purge) are 502."""
    if response.status < 400:
        return
    try:
        error = (await _read_json(response)).get("error", {})
    except (ValueError, AttributeError, aiohttp.ClientError):
        error = {}
    message = error.get("message") or f"worker returned HTTP {response.status}"
    if 400 <= response.status < 500:
        exc = InvalidRequest(message, code=error.get("code"), param=error.get("param"))
        exc.status = response.status
        raise exc
    if response.status == 503 and "Retry-After" in response.headers:  # queue full: not started there
        raise WorkerNotStarted(
            f"the model workers are saturated: {message}",
            code="server_overloaded",
            retry_after_s=_retry_after_s(response),
        )
    raise UpstreamError(f"worker error: {message}")


class KVEventsTooLarge(UpstreamError):
    """A ``GET /v1/kv_events`` answer over the gateway's ``kv_events_max_bytes``: refused unread (broken
    or hostile worker); the consumer treats it as a malformed batch."""


async def _read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The body, read chunk by chunk up to ``max_bytes``; past it (or a Content-Length over it) the
    connection is closed and ``KVEventsTooLarge`` raised, so no more than ``max_bytes`` is ever held."""
    declared = response.content_length
    if declared is not None and declared > max_bytes:
        response.close()
        raise KVEventsTooLarge(f"KV-event answer of {declared} bytes (over {max_bytes})")
    body = bytearray()
    async for chunk in response.content.iter_chunked(64 << 10):
        body += chunk
        if len(body) > max_bytes:
            response.close()
            raise KVEventsTooLarge(f"KV-event answer over {max_bytes} bytes")
    return bytes(body)


class WorkerDisconnected(Unavailable):
    """The connection broke before the worker answered: a stale keep-alive connection to a dead worker
    (the request never arrived) or a worker that died while working on it. The pipeline retries it
    elsewhere only once the worker is found dead."""


def _unreachable(exc: aiohttp.ClientError, *, answered: bool) -> Unavailable:
    """Refused connections never reached the worker; a connection lost later may have started work."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return WorkerNotStarted(f"worker unreachable: {exc.__class__.__name__}", code="worker_unreachable")
    if not answered and isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return WorkerDisconnected(
            f"worker connection lost: {exc.__class__.__name__}", code="worker_disconnected"
        )
    return Unavailable(f"worker connection lost: {exc.__class__.__name__}", code="worker_unreachable")


class WorkerClient:
    """One worker, over a shared ``aiohttp.ClientSession``."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        *,
        timeout_s: float = 600.0,
        health_timeout_s: float = 5.0,
        kv_events_max_bytes: int = 16 << 20,
    ) -> None:
        self.url = url.rstrip("/")
        self.kv_events_max_bytes = kv_events_max_bytes
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5)
        self._short = aiohttp.ClientTimeout(total=5)
        self._health = aiohttp.ClientTimeout(total=health_timeout_s)

    async def _get(self, path: str, timeout: aiohttp.ClientTimeout | None = None) -> dict[str, Any]:
        async with self._session.get(self.url + path, timeout=timeout or self._short) as response:
            await _raise_for_worker_error(response)
            return await _read_json(response)

    async def healthz(self) -> dict[str, Any]:
        """Raises when the worker is down, says it is unhealthy (503) or does not answer in time (hung)."""
        return await self._get("/healthz", self._health)

    async def info(self) -> dict[str, Any]:
        return await self._get("/v1/info")

    async def kv_events(self, *, since: int, wait_ms: int, snapshot: str | None = None) -> dict[str, Any]:
        """KV events after ``since`` (long poll of ``wait_ms``), or the snapshot page named by
        ``snapshot`` (``worker.kv_events``). An answer over ``kv_events_max_bytes`` raises
        ``KVEventsTooLarge`` having read no more than that."""
        timeout = aiohttp.ClientTimeout(total=wait_ms / 1000 + 5, sock_connect=2)
        params = {"since": str(since), "wait_ms": str(wait_ms)}
        if snapshot is not None:
            params["snapshot"] = snapshot
        async with self._session.get(self.url + "/v1/kv_events", params=params, timeout=timeout) as response:
            await _raise_for_worker_error(response)
            return orjson.loads(await _read_capped(response, self.kv_events_max_bytes))

    async def stats(self) -> dict[str, Any]:
        return await self._get("/v1/stats")

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Non-streamed generation; raises APIError subclasses."""
        answered = False
        try:
            async with self._session.post(
                self.url + "/v1/generate",
                data=_dumps(payload),
                timeout=self._timeout,
                headers={"Content-Type": "application/json"},
            ) as response:
                answered = True
                await _raise_for_worker_error(response)
                return await _read_json(response)
        except aiohttp.ClientError as exc:
            raise _unreachable(exc, answered=answered) from exc
        except TimeoutError as exc:
            raise Unavailable("the worker did not finish in time", code="worker_timeout") from exc

    async def generate_stream(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Streamed generation: the worker's NDJSON events. Closing the iterator early (client gone)
        closes the connection, which the worker treats as a cancellation."""
        answered = False
        try:
            async with self._session.post(
                self.url + "/v1/generate",
                data=_dumps({**payload, "stream": True}),
                timeout=self._timeout,
                headers={"Content-Type": "application/json"},
            ) as response:
                answered = True
                await _raise_for_worker_error(response)
                async for line in response.content:
                    if line.strip():
                        yield orjson.loads(line)
        except aiohttp.ClientError as exc:
            raise _unreachable(exc, answered=answered) from exc
        except TimeoutError as exc:
            raise Unavailable("the worker did not finish in time", code="worker_timeout") from exc

    async def purge(self, namespace_id: str, *, timeout_s: float = 120.0) -> dict[str, int]:
        """Erase a namespace from every tier of this worker; blocks erased per tier. Raises on failure."""
        async with self._session.post(
            self.url + "/v1/purge",
            data=_dumps({"namespace_id": namespace_id}),
            timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=5),
            headers={"Content-Type": "application/json"},
        ) as response:
            await _raise_for_worker_error(response)
            erased = (await _read_json(response)).get("blocks_erased") or {}
            return {str(tier): int(count) for tier, count in erased.items()}

    async def is_dead(self, timeout_s: float = 1.0) -> bool:
        """True when a fresh TCP connection to the worker is refused (no pooled connection is used)."""
        url = URL(self.url)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(url.host, url.port), timeout_s)
        except ConnectionRefusedError:
            return True
        except (OSError, TimeoutError):
            return False
        writer.close()
        return False

    async def abort(self, request_id: str) -> bool:
        try:
            async with self._session.post(
                self.url + "/v1/abort",
                data=_dumps({"request_id": request_id}),
                timeout=self._short,
                headers={"Content-Type": "application/json"},
            ) as response:
                if response.status >= 400:
                    return False
                return bool((await _read_json(response)).get("aborted"))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False


def error_from_event(event: dict[str, Any]) -> APIError:
    """An APIError from a worker stream's ``{"type": "error"}`` event."""
    error = event.get("error") or {}
    return UpstreamError(f"worker error: {error.get('message', 'unknown error')}")
