"""Who may call the worker API.

The worker executes whatever token ids it is sent and erases namespaces on request, so it must only
answer the gateways. It binds to loopback by default; bound anywhere else it needs a shared secret
(``--shared-secret`` / ``PREFIXGATE_WORKER_SHARED_SECRET``, the gateway's ``PREFIXGATE_WORKER_SECRET``)
and every call but ``GET /healthz`` must carry it as a bearer token.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable

from aiohttp import web

OPEN_PATHS = frozenset({"/healthz", "/openapi.json"})  # liveness probes and the API's description


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def check_bind(host: str, shared_secret: str | None) -> None:
    """Refuse to serve beyond loopback without a shared secret."""
    if not shared_secret and not is_loopback(host):
        raise ValueError(
            f"the worker API would listen on {host!r} without authentication: set "
            "PREFIXGATE_WORKER_SHARED_SECRET (and the gateway's PREFIXGATE_WORKER_SECRET), "
            "or bind to 127.0.0.1"
        )


def auth_middleware(shared_secret: str) -> Callable:
    expected = shared_secret.encode()

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            given = token.strip().encode("utf-8", "surrogateescape")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, expected):
                body = {
                    "error": {
                        "message": "the worker API needs 'Authorization: Bearer <shared secret>'",
                        "type": "authentication_error",
                        "code": "invalid_worker_secret",
                        "param": None,
                    }
                }
                return web.json_response(body, status=401)
        return await handler(request)

    return middleware
