"""``Expect`` (RFC 9110 §10.1.1): answered the same way for every request, routed or not.

aiohttp runs a route's expect handler before any middleware. Its default wrote ``100 Continue`` at once,
inviting the upload before the API key was checked (docs/operations.md: a bad key is a 401 without
reading the body), and refused any other expectation with a plain-text 417 without an ``x-request-id``.
Here (``expect_continue``, the expect handler of every route, ``route_everything``'s included) an
unknown expectation is OpenAI's 417 with the request id, and ``100 Continue`` is sent only when the body
is about to be read (``send_continue``, from ``slow_clients.read_body_middleware``): after every check the
headers get (request id, size, credentials, coding, the reading budget). A request answered without
its body being invited has its connection closed (``close_uninvited``): the client never sends it.

No path or method falls back on aiohttp's default: ``route_everything`` gives each resource a route for
any other method (405) and each app a last route for any other path (404), both with ``expect_continue``.
"""

from __future__ import annotations

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11

from gateway.errors import APIError, error_response
from gateway.request_id import assign_request_id, request_id_of

CONTINUED = web.RequestKey("continued", bool)  # 100 Continue was sent: the body was invited


class ExpectationFailed(APIError):
    status = 417
    code = "expectation_failed"


def _expects_continue(request: web.BaseRequest) -> bool:
    """True when the client waits for ``100 Continue`` before it sends the body (HTTP/1.0 has none)."""
    expect = request.headers.get(hdrs.EXPECT)
    return (
        expect is not None and request.version == HttpVersion11 and expect.strip().lower() == "100-continue"
    )


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The expect handler of every route: None (go on to the middlewares and the handler, nothing sent
    yet) for ``100-continue``, else OpenAI's 417, the connection closed."""
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version != HttpVersion11 or expect.strip().lower() == "100-continue":
        return None  # HTTP/1.0 has no 100 (Continue): the expectation is ignored
    assign_request_id(request)
    error = ExpectationFailed(
        f"unsupported 'Expect: {expect[:100]}': only '100-continue' is supported", param="Expect"
    )
    response = error_response(error, request_id_of(request))
    response.force_close()
    return response


async def send_continue(request: web.Request) -> None:
    """Invite the body (``100 Continue``) if its client waits for that: call right before reading it."""
    if _expects_continue(request) and not request.get(CONTINUED):
        request[CONTINUED] = True
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's default handler: the answer has not started yet


async def close_uninvited(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: a request answered before its body was invited closes its connection
    (the client will not send the body, or sends it only after giving up waiting)."""
    if request.body_exists and _expects_continue(request) and not request.get(CONTINUED):
        response.force_close()
        response.headers[hdrs.CONNECTION] = "close"  # the headers were made before this hook


async def _not_found(request: web.Request) -> web.StreamResponse:
    raise web.HTTPNotFound()


async def _method_not_allowed(request: web.Request) -> web.StreamResponse:
    resource = request.match_info.route.resource
    allowed = {route.method for route in resource or () if route.method != hdrs.METH_ANY}
    raise web.HTTPMethodNotAllowed(request.method, allowed)


def is_unrouted(request: web.BaseRequest) -> bool:
    """True for a request no route takes (404, 405): it is answered without reading its body."""
    match_info = request.match_info
    return match_info.http_exception is not None or match_info.handler in (_not_found, _method_not_allowed)


def route_everything(app: web.Application, *, sub_app: bool = False) -> None:
    """Call once every route of ``app`` is added: each resource gets a route for any other method (a
    405) and ``app`` a last route for any other path (a 404; for a sub-app, its prefix itself too), so
    every request meets ``expect_continue`` instead of aiohttp's default expect handler."""
    for resource in list(app.router.resources()):
        if isinstance(resource, web.Resource) and all(route.method != hdrs.METH_ANY for route in resource):
            resource.add_route(hdrs.METH_ANY, _method_not_allowed, expect_handler=expect_continue)
    for path in ("", "/{tail:.*}") if sub_app else ("/{tail:.*}",):
        app.router.add_route(hdrs.METH_ANY, path, _not_found, expect_handler=expect_continue)
