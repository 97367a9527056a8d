"""``x-request-id``: a client's (validated) or a generated one, on every response, error body and log line.

The id identifies the request to people (support tickets, log searches): it is echoed, put in error
bodies, logged, passed to the worker and stored with the usage record. It is never used as a key that
must be unique (the worker's request id and the usage record's key stay server-generated), so a client
reusing an id cannot collide with another tenant's request.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.errors import REQUEST_ID, REQUEST_ID_GENERATED, InvalidRequest, error_response

log = logging.getLogger("prefixgate.gateway.access")

HEADER = "x-request-id"
MAX_LENGTH = 64  # leaves room in the 80-character usage key (see usage_key)
_VALID = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_LENGTH}}}")


def new_request_id() -> str:
    return "req_" + secrets.token_hex(16)


def request_id_of(request: web.BaseRequest) -> str | None:
    return request.get(REQUEST_ID)


def request_id_generated(request: web.BaseRequest) -> bool:
    return request.get(REQUEST_ID_GENERATED, True)


def usage_key(request_id: str, generated: bool) -> str:
    """The usage record's unique key: the id itself when we generated it, else the client's id with a
    unique suffix (a client may reuse its ids; billing must not lose a record to a duplicate)."""
    return request_id if generated else f"{request_id}#{secrets.token_hex(6)}"


def assign_request_id(request: web.BaseRequest) -> bool:
    """Give ``request`` its id: the client's when it is well-formed, else a new one. False when the
    client sent a malformed one (the middleware answers it with a 400)."""
    given = request.headers.get(HEADER)
    valid = given is not None and _VALID.fullmatch(given) is not None
    request[REQUEST_ID] = given if given is not None and valid else new_request_id()
    request[REQUEST_ID_GENERATED] = not valid
    return given is None or valid


@web.middleware
async def request_id_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Outermost middleware: assigns the id, answers a malformed one with a 400, logs every tenant call."""
    if not assign_request_id(request):
        return error_response(
            InvalidRequest(
                f"'{HEADER}' must be 1 to {MAX_LENGTH} characters of letters, digits and . _ : -",
                param=HEADER,
                code="invalid_request_id",
            ),
            request_id=request[REQUEST_ID],
        )
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        if request.path.startswith("/v1/"):
            log.info(
                "%s %s %d %.1fms x-request-id=%s",
                request.method,
                request.path,
                status,
                (time.perf_counter() - started) * 1000,
                request[REQUEST_ID],
            )


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: echo the id on every response, streamed ones included."""
    request_id = request_id_of(request)
    if request_id is not None:
        response.headers[HEADER] = request_id
