"""OpenAI-style errors, mapped to JSON once, in middleware."""

from __future__ import annotations

import json
import logging

from aiohttp import web

log = logging.getLogger(__name__)

# The request's x-request-id (gateway.request_id sets both before any handler runs).
REQUEST_ID = web.RequestKey("request_id", str)
REQUEST_ID_GENERATED = web.RequestKey("request_id_generated", bool)  # False: the client chose it


class APIError(Exception):
    """An error returned to the client as ``{"error": {"message", "type", "param", "code"}}``."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None
    retry_after_s: int | None = None  # sent as Retry-After (429 and 503)

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})  # extra response headers (x-ratelimit-*)

    def response_headers(self) -> dict[str, str]:
        retry = {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}
        return {**self.headers, **retry}

    def to_json(self, request_id: str | None = None) -> dict:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if request_id is not None:
            error["request_id"] = request_id  # the x-request-id, for support and log searches
        return {"error": error}


class InvalidRequest(APIError):
    pass


class ContextLengthExceeded(APIError):
    code = "context_length_exceeded"


class AuthenticationError(APIError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(APIError):
    status = 403
    type = "permission_error"


class NotFoundError(APIError):
    status = 404
    type = "not_found_error"


class ModelNotFound(NotFoundError):
    code = "model_not_found"


class ConflictError(APIError):
    status = 409
    type = "conflict_error"


class PayloadTooLarge(APIError):
    status = 413
    code = "request_too_large"


class RateLimited(APIError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    retry_after_s = 1


class ResponseFormatError(APIError):
    """The worker answered, but the gateway could not turn the answer into an OpenAI response."""

    status = 500
    type = "api_error"
    code = "response_format_failed"


class UpstreamError(APIError):
    status = 502
    type = "upstream_error"


class Unavailable(APIError):
    status = 503
    type = "service_unavailable"
    retry_after_s = 1


def error_response(error: APIError, request_id: str | None = None) -> web.Response:
    return web.json_response(error.to_json(request_id), status=error.status, headers=error.response_headers())


_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


@web.middleware
async def error_middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
    request_id = request.get(REQUEST_ID)
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(exc, request_id)
    except web.RequestPayloadError as exc:  # a body aiohttp cannot decode (corrupt gzip/deflate, bad chunks)
        cause = exc.__cause__ or exc.__context__
        detail = getattr(cause, "message", None) or str(cause or exc)
        return error_response(
            InvalidRequest(f"the request body could not be read: {detail}", code="invalid_body"), request_id
        )
    except web.HTTPRequestEntityTooLarge:
        limit = request.app._client_max_size
        return error_response(PayloadTooLarge(f"request body too large (limit {limit} bytes)"), request_id)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason if exc.status != 404 else f"no route for {request.method} {request.path}"
        body = {
            "error": {
                "message": message,
                "type": _HTTP_TYPES.get(exc.status, "api_error"),
                "param": None,
                "code": None,
                "request_id": request_id,
            }
        }
        return web.Response(
            status=exc.status, text=json.dumps(body), content_type="application/json", headers=_allow(exc)
        )
    except ConnectionResetError:
        raise  # the client went away mid-response: nothing to answer, nothing to log as a fault
    except Exception:
        log.exception("unhandled error on %s %s (x-request-id %s)", request.method, request.path, request_id)
        body = {
            "error": {
                "message": "internal server error",
                "type": "api_error",
                "param": None,
                "code": None,
                "request_id": request_id,
            }
        }
        return web.json_response(body, status=500)


def _allow(exc: web.HTTPException) -> dict[str, str]:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else {}
