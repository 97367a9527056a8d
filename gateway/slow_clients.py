"""Slow or lying clients cannot hold the gateway's connections (slowloris, a body that never comes).

- A connection must deliver a complete request head within ``header_timeout_s`` of opening, or it is
  closed (``start_site``: aiohttp has no header timeout of its own).
- What aiohttp refuses in a request head is answered with OpenAI's error JSON (``JSONErrorRequestHandler``).
- A request body must arrive within ``read_timeout_s`` (408), and a ``Content-Length`` above the body
  limit is refused before anything is read (413) (``read_body_middleware``).
- No body is read before its request is authorized from its headers (401 at once); an unknown route
  (404), a wrong method (405) or a route that authorizes nothing never has its body read. The bodies
  being read at once hold at most ``max_reading_bytes`` between them, and one tenant (or the admin) at
  most half of it (503 past either): slow uploads cannot fill the gateway's memory, nor starve others.
- A streamed answer's client must accept each chunk within ``stream_write_timeout_s`` (``ClientStream``):
  one that stops reading fills the socket buffers and would block the write, and with it the request's
  admission slots, its usage record and the generation, for as long as it keeps the socket open. It is
  cut instead (the connection aborted, ``StalledClient``), as a client that hung up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from aiohttp import web

from gateway.errors import APIError, PayloadTooLarge, Unavailable

log = logging.getLogger(__name__)

STARTED = web.AppKey("started_transports", weakref.WeakSet)  # transports that delivered a request head


class RequestTimeout(APIError):
    status = 408
    code = "request_timeout"


def read_body_middleware(  # type: ignore[no-untyped-def]
    read_timeout_s: float,
    max_body_bytes: int,
    max_reading_bytes: int,
    authorize: Callable[[web.Request], str | None],
):
    """Read each body up front, within the limits above. ``authorize(request)`` raises (401, 403) when
    the request's headers do not authorize its route, and returns who is asking (a tenant, the admin), or
    None for a route that authorizes nothing: such a route takes no body, and none is read for it. A body
    of unknown length counts as the limit. One principal holds at most half of ``max_reading_bytes``
    (503 past it), except that its first body is always let in under the overall bound."""
    reading_bytes = 0  # bodies being read now (by Content-Length): this app's, not a module global
    reading_by: dict[str, int] = {}  # the same, per principal
    share = max_reading_bytes // 2

    @web.middleware
    async def middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
        nonlocal reading_bytes
        if request.transport is not None:
            request.config_dict[STARTED].add(request.transport)
        if not request.body_exists:
            return await handler(request)
        length = request.content_length
        if length is not None and length > max_body_bytes:
            raise PayloadTooLarge(f"request body too large (limit {max_body_bytes} bytes)")
        if request.match_info.http_exception is not None:  # 404, 405: answered without reading
            return await handler(request)
        principal = authorize(request)
        if principal is None:  # a route that takes no body (/healthz, /metrics): its body is never read
            return await handler(request)
        held = max_body_bytes if length is None else length
        mine = reading_by.get(principal, 0)
        if reading_bytes + held > max_reading_bytes or (mine and mine + held > share):
            raise Unavailable(
                "too many request bodies are being uploaded at once; retry shortly", code="server_busy"
            )
        reading_bytes += held
        reading_by[principal] = mine + held
        try:
            async with asyncio.timeout(read_timeout_s):
                await request.read()  # cached: handlers' read() returns it
        except TimeoutError:
            raise RequestTimeout(f"the request body did not arrive within {read_timeout_s:g} s") from None
        finally:
            reading_bytes -= held
            left = reading_by[principal] - held
            if left:
                reading_by[principal] = left
            else:
                del reading_by[principal]
        return await handler(request)

    return middleware


class StalledClient(ConnectionResetError):
    """A stream's client accepted no chunk within the write timeout: handled as a client that hung up."""


class ClientStream:
    """A prepared streaming response whose every write must be taken by the client within ``timeout_s``.

    A write waits only while the connection's buffers are full (the client is not reading); past the
    deadline the connection is aborted (``close`` would wait to flush them) and ``StalledClient`` is
    raised, so the handler ends and gives back what it holds."""

    __slots__ = ("request", "response", "timeout_s")

    def __init__(self, request: web.Request, response: web.StreamResponse, timeout_s: float) -> None:
        self.request, self.response, self.timeout_s = request, response, timeout_s

    async def write(self, data: bytes) -> None:
        await self._within(self.response.write(data))

    async def write_eof(self) -> None:
        await self._within(self.response.write_eof())

    async def _within(self, sending: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await sending
        except TimeoutError:
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            log.info(
                "cut a %s stream to %s: the client accepted nothing for %g s",
                self.request.path,
                self.request.remote,
                self.timeout_s,
            )
            raise StalledClient(f"the client accepted nothing for {self.timeout_s:g} s") from None


class JSONErrorRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, answering what it refuses before any middleware runs (a header
    line over 8190 bytes, more than 100 headers, a bad Content-Length) with OpenAI's error JSON instead
    of plain text. Same slots: ``start_site`` switches each new handler's class to this one."""

    __slots__ = ()

    def handle_error(  # type: ignore[override]
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a response was sent
        client_error = 400 <= status < 500
        error = {
            "message": (message or HTTPStatus(status).phrase) if client_error else "internal server error",
            "type": "invalid_request_error" if client_error else "api_error",
            "param": None,
            "code": "invalid_http_request" if client_error else None,
        }
        response = web.Response(
            status=status, text=json.dumps({"error": error}), content_type="application/json"
        )
        response.force_close()
        return response


async def start_site(runner: web.AppRunner, host: str, port: int, header_timeout_s: float) -> asyncio.Server:
    """Listen like ``web.TCPSite``, closing connections whose first request head is not complete within
    ``header_timeout_s``. Close the returned server before ``runner.cleanup()``."""
    loop = asyncio.get_running_loop()
    server = runner.server
    started = runner.app[STARTED]
    if server is None:
        raise RuntimeError("call runner.setup() first")

    def close_if_silent(handler: web.RequestHandler) -> None:
        transport = handler.transport
        if transport is not None and not transport.is_closing() and transport not in started:
            transport.close()

    def factory() -> web.RequestHandler:
        handler = server()
        handler.__class__ = JSONErrorRequestHandler
        loop.call_later(header_timeout_s, close_if_silent, handler)
        return handler

    return await loop.create_server(factory, host, port, reuse_address=True)
