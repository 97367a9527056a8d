"""``Expect`` (RFC 9110 §10.1.1): every route of the gateway answers it with ``expect_continue``.

aiohttp runs a route's expect handler before any middleware. Its default wrote ``100 Continue`` at once,
inviting the upload before the API key was checked (docs/operations.md: a bad key is a 401 without
reading the body), and refused any other expectation with a plain-text 417 without an ``x-request-id``.
Here the 100 is sent only once the headers pass what the body would be checked against
(``slow_clients.admit_body``: Content-Length limit, credentials, Content-Encoding); otherwise the error is
answered at once, as OpenAI's error JSON with the request id, and the connection closed (the client never
sends the body it was not invited to send). An unknown expectation is such an error: 417.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11

from gateway.errors import APIError, error_response
from gateway.request_id import assign_request_id, request_id_of

# The headers' checks before a body is read (``slow_clients.admit_body`` bound to the app's limit and
# credentials): raises an APIError, else returns who is asking (None: no body will be read).
BODY_GATE = web.AppKey("body_gate", Callable[[web.BaseRequest], str | None])


class ExpectationFailed(APIError):
    status = 417
    code = "expectation_failed"


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The expect handler of every route: None (go on to the middlewares and the handler) once ``100
    Continue`` was sent, or the error response."""
    if request.version != HttpVersion11:  # HTTP/1.0 has no 100 (Continue): the expectation is ignored
        return None
    expect = request.headers.get(hdrs.EXPECT, "")
    try:
        if expect.strip().lower() != "100-continue":
            raise ExpectationFailed(
                f"unsupported 'Expect: {expect[:100]}': only '100-continue' is supported", param="Expect"
            )
        request.config_dict[BODY_GATE](request)
    except APIError as exc:
        assign_request_id(request)
        response = error_response(exc, request_id_of(request))
        response.force_close()
        return response
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # as aiohttp's default handler: the answer has not started yet
    return None
