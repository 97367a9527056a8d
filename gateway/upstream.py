"""Client of the worker HTTP API (docs/worker-api.md)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from gateway.errors import APIError, InvalidRequest, Unavailable, UpstreamError

log = logging.getLogger(__name__)


def _dumps(data: Any) -> bytes:
    return orjson.dumps(data)


async def _read_json(response: aiohttp.ClientResponse) -> Any:
    return orjson.loads(await response.read())


async def _raise_for_worker_error(response: aiohttp.ClientResponse) -> None:
    """Map a worker error: 4xx keeps its message and code (the worker validated our request), 5xx is 502."""
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
    raise UpstreamError(f"worker error: {message}")


class WorkerClient:
    """One worker, over a shared ``aiohttp.ClientSession``."""

    def __init__(self, url: str, session: aiohttp.ClientSession, *, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5)
        self._short = aiohttp.ClientTimeout(total=5)

    async def _get(self, path: str) -> dict[str, Any]:
        async with self._session.get(self.url + path, timeout=self._short) as response:
            await _raise_for_worker_error(response)
            return await _read_json(response)

    async def healthz(self) -> dict[str, Any]:
        return await self._get("/healthz")

    async def info(self) -> dict[str, Any]:
        return await self._get("/v1/info")

    async def kv_events(self, *, since: int, wait_ms: int) -> dict[str, Any]:
        """KV events after ``since`` (long poll of ``wait_ms``; ``worker.kv_events``)."""
        timeout = aiohttp.ClientTimeout(total=wait_ms / 1000 + 5, sock_connect=2)
        params = {"since": str(since), "wait_ms": str(wait_ms)}
        async with self._session.get(self.url + "/v1/kv_events", params=params, timeout=timeout) as response:
            await _raise_for_worker_error(response)
            return await _read_json(response)

    async def stats(self) -> dict[str, Any]:
        return await self._get("/v1/stats")

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Non-streamed generation; raises APIError subclasses."""
        try:
            async with self._session.post(
                self.url + "/v1/generate",
                data=_dumps(payload),
                timeout=self._timeout,
                headers={"Content-Type": "application/json"},
            ) as response:
                await _raise_for_worker_error(response)
                return await _read_json(response)
        except aiohttp.ClientError as exc:
            raise Unavailable(f"worker unreachable: {exc.__class__.__name__}") from exc

    async def generate_stream(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Streamed generation: the worker's NDJSON events. Closing the iterator early (client gone)
        closes the connection, which the worker treats as a cancellation."""
        try:
            async with self._session.post(
                self.url + "/v1/generate",
                data=_dumps({**payload, "stream": True}),
                timeout=self._timeout,
                headers={"Content-Type": "application/json"},
            ) as response:
                await _raise_for_worker_error(response)
                async for line in response.content:
                    if line.strip():
                        yield orjson.loads(line)
        except aiohttp.ClientError as exc:
            raise Unavailable(f"worker unreachable: {exc.__class__.__name__}") from exc

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
