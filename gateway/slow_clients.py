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
- An answer's client must keep taking its bytes (``ClientStream``): one that takes none for
  ``stream_write_timeout_s`` fills the socket buffers and would block the write, and with it the
  request's admission slots, its usage record and the generation, for as long as it keeps the socket
  open. It is cut instead (the connection aborted, ``StalledClient``), as a client that hung up. A
  client that reads, however slowly, is not cut (the deadline restarts whenever it takes a byte). A
  non-streamed answer is written inside its handler under the same deadline (``send_answer``): it
  cannot stay in the gateway's memory after its call was recorded. A cut stream is billed what left
  the gateway before the abort, not what the abort discarded (``ClientStream.delivered``).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import struct
import termios
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from aiohttp import web

from gateway.content_encoding import check_transfer_coding, content_coding, decode_body
from gateway.errors import APIError, PayloadTooLarge, Unavailable
from gateway.expect import is_unrouted, send_continue
from gateway.state import CONFIG, PIPELINE

if TYPE_CHECKING:
    from gateway.billing import TenantCall

log = logging.getLogger(__name__)

STARTED = web.AppKey("started_transports", weakref.WeakSet)  # transports that delivered a request head


class RequestTimeout(APIError):
    status = 408
    code = "request_timeout"


BODY = web.RequestKey("body", bytes)  # the body as read and decoded (``request_body``)


def admit_body(
    request: web.BaseRequest, max_body_bytes: int, authorize: Callable[[web.Request], str | None]
) -> str | None:
    """What a request's headers must pass before its body is read (and before ``Expect: 100-continue``
    invites it, ``gateway.expect``): a ``Content-Length`` within the limit (413), its route's credentials
    (``authorize``: 401, 403) and a ``Content-Encoding`` the gateway decodes (415). Returns who is
    asking, or None when no body will be read (no route, or a route that authorizes nothing). A
    ``Transfer-Encoding`` other than ``chunked`` is a 501 first: the body's framing is not understood."""
    check_transfer_coding(request)
    length = request.content_length
    if length is not None and length > max_body_bytes:
        raise PayloadTooLarge(f"request body too large (limit {max_body_bytes} bytes)")
    if is_unrouted(request):  # 404, 405: answered without reading
        return None
    principal = authorize(request)  # type: ignore[arg-type]
    if principal is not None:
        content_coding(request)
    return principal


async def request_body(request: web.Request) -> bytes:
    """The request's body, decoded from its ``Content-Encoding`` (``read_body_middleware`` read it)."""
    body = request.get(BODY)
    return await request.read() if body is None else body


def read_body_middleware(  # type: ignore[no-untyped-def]
    read_timeout_s: float,
    max_body_bytes: int,
    max_reading_bytes: int,
    authorize: Callable[[web.Request], str | None],
):
    """Read each body up front, within the limits above, once ``admit_body`` let it in, and decode it
    (``gateway.content_encoding``; handlers take it from ``request_body``). ``authorize(request)``
    raises (401, 403) when the request's headers do not authorize its route, and returns who is asking
    (a tenant, the admin), or None for a route that authorizes nothing: such a route takes no body, and
    none is read for it. A body of unknown length counts as the limit. One principal holds at most half
    of ``max_reading_bytes`` (503 past it), except that its first body is always let in under the
    overall bound."""
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
        principal = admit_body(request, max_body_bytes, authorize)
        if principal is None:  # no route, or one that takes no body (/healthz, /metrics): never read
            return await handler(request)
        length = request.content_length
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
                await send_continue(request)  # every check passed: only now is the body invited
                body = await request.read()
        except TimeoutError:
            raise RequestTimeout(f"the request body did not arrive within {read_timeout_s:g} s") from None
        finally:
            reading_bytes -= held
            left = reading_by[principal] - held
            if left:
                reading_by[principal] = left
            else:
                del reading_by[principal]
        coding = content_coding(request)
        if coding is not None:  # off the loop, in the asker's CPU-pool share (inflating 4 MiB: ~40 ms)
            owner = principal.removeprefix("tenant:")  # a tenant's share is keyed by its id
            run_cpu = request.config_dict[PIPELINE].run_cpu
            body = await run_cpu(decode_body, body, coding, max_body_bytes, owner=owner)
        request[BODY] = body
        return await handler(request)

    return middleware


class StalledClient(ConnectionResetError):
    """A client took no byte of its answer within the write timeout: handled as a client that hung up."""


class AnswerCut(ConnectionResetError):
    """An answer's client stopped taking it (or hung up) while it was written: a non-streamed answer's
    (``send_answer``), or an upstream's stream (``gateway.upstream_serve``). Recorded as the client's
    cancellation; the handler returns ``response`` (an exception would be logged as a server error)."""

    def __init__(self, response: web.Response) -> None:
        super().__init__("the client did not take its answer")
        self.response = response


M = TypeVar("M")


def num_unacked_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes in the kernel's send queue that the client's kernel has not acknowledged (Linux's
    SIOCOUTQ; 0 where it cannot be read)."""
    sock = transport.get_extra_info("socket")
    request = getattr(termios, "TIOCOUTQ", None)
    if sock is None or request is None:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0" * 4))[0])
    except (OSError, ValueError):
        return 0


class _Progress:
    """Fires ``scope`` once the client has taken no byte for ``timeout_s`` (checked every quarter of
    it): a client that takes a byte at least every ``timeout_s`` is never cut; one that stopped is,
    within 1.25 x ``timeout_s`` of the write. Progress is what the client's kernel acknowledged
    (``num_taken_bytes``): aiohttp's buffer alone moves only when the kernel's send buffer is half empty
    again (Linux wakes a writer then), which a slow reader takes minutes to do with megabytes of buffers.
    Nothing is measured before the first check: most writes never wait that long."""

    __slots__ = ("handle", "last_s", "num_taken_bytes", "scope", "stream")

    def __init__(self, stream: ClientStream[Any], scope: asyncio.Timeout) -> None:
        self.stream, self.scope = stream, scope
        self.num_taken_bytes = -1  # none measured yet
        self.last_s = 0.0
        self.handle = asyncio.get_running_loop().call_later(stream.timeout_s / 4, self.check)

    def check(self) -> None:
        loop = asyncio.get_running_loop()
        now, timeout_s = loop.time(), self.stream.timeout_s
        num_taken = self.stream.num_taken_bytes()
        if num_taken > self.num_taken_bytes:  # progress (or the first look): the deadline restarts
            self.num_taken_bytes, self.last_s = num_taken, now
        elif now - self.last_s >= timeout_s:
            self.scope.reschedule(now)  # TimeoutError in the writer
            return
        self.handle = loop.call_later(min(timeout_s / 4, self.last_s + timeout_s - now), self.check)

    def stop(self) -> None:
        self.handle.cancel()


class ClientStream(Generic[M]):
    """A prepared response whose client must keep taking its bytes: a write (or the end) may wait while
    the connection's buffers are full, but once no byte has left for ``timeout_s`` the connection is
    aborted (``close`` would wait to flush them) and ``StalledClient`` raised, so the handler ends and
    gives back what it holds. A slow client that keeps reading is never cut.

    ``mark(value)`` says what the client has once every byte written so far has left the gateway (a
    cumulative count: tokens, or a relay's state); ``delivered()`` is the value of the last mark whose
    bytes all left aiohttp's buffer (the kernel still sends them after an abort), or ``initial``: what
    a cut stream is billed, not what is still waiting in the buffer that ``abort`` discards."""

    __slots__ = ("_acked", "_frozen", "_marks", "request", "response", "timeout_s")

    def __init__(
        self, request: web.Request, response: web.StreamResponse, timeout_s: float, initial: M
    ) -> None:
        self.request, self.response, self.timeout_s = request, response, timeout_s
        self._marks: deque[tuple[int, M]] = deque()  # (bytes written up to it, value), oldest first
        self._acked = initial
        self._frozen = False  # aborted: the buffer's size no longer says what left

    def num_sent_bytes(self) -> int:
        """Bytes of this connection's answers that left aiohttp's buffer (into the kernel)."""
        transport = self.request.transport
        buffered = transport.get_write_buffer_size() if transport is not None else 0
        return self.request.writer.output_size - buffered

    def num_taken_bytes(self) -> int:
        """Bytes of this connection's answers that the client's kernel acknowledged (that left aiohttp's
        buffer, where the kernel's send queue cannot be read)."""
        transport = self.request.transport
        unacked = num_unacked_bytes(transport) if transport is not None else 0
        return self.num_sent_bytes() - unacked

    def mark(self, value: M) -> None:
        self._marks.append((self.request.writer.output_size, value))
        self._settle()

    def delivered(self) -> M:
        self._settle()
        return self._acked

    def _settle(self) -> None:
        transport = self.request.transport
        if self._frozen or transport is None or transport.is_closing():
            return  # a closed transport's buffer is gone: keep what was known to have left
        num_sent = self.num_sent_bytes()
        while self._marks and self._marks[0][0] <= num_sent:
            self._acked = self._marks.popleft()[1]

    async def write(self, data: bytes) -> None:
        await self._within(self.response.write(data))

    async def write_eof(self) -> None:
        await self._within(self.response.write_eof())

    async def _within(self, sending: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(None) as scope:
                progress = _Progress(self, scope)
                try:
                    await sending
                finally:
                    progress.stop()
        except TimeoutError:
            self._settle()  # before the abort throws the buffer away
            self._frozen = True
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            log.info(
                "cut an answer to %s %s: the client took nothing for %g s",
                self.request.path,
                self.request.remote,
                self.timeout_s,
            )
            raise StalledClient(f"the client took nothing for {self.timeout_s:g} s") from None


async def send_answer(request: web.Request, call: TenantCall, response: web.Response) -> None:
    """Write a non-streamed answer inside its handler, under ``ClientStream``'s deadline: an answer
    that its client does not take is cut (``StalledClient``, recorded as the client's cancellation)
    instead of staying in the gateway's memory after the handler gave back its admission slots and
    recorded the call. A cut answer is billed whole (``TenantCall.bill_whole_answer``) and raises
    ``AnswerCut``: record the call as the client's cancellation, then return its ``response`` from the
    handler (there is nothing left to send; an exception would be logged as a server error)."""
    timeout_s = request.config_dict[CONFIG].stream_write_timeout_s
    try:
        await response.prepare(request)
        call.headers_sent = True  # a shutdown's cut keeps the answer's 200, as a stream's does
        await ClientStream(request, response, timeout_s, None).write_eof()
    except ConnectionResetError as exc:
        call.bill_whole_answer()
        raise AnswerCut(response) from exc
    except asyncio.CancelledError:  # the client went away (handler cancellation), or a shutdown
        call.bill_whole_answer()
        raise


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
