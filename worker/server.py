"""The worker's HTTP API (docs/worker-api.md): an aiohttp app around one ``Engine``."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from worker.admission import Overloaded
from worker.auth import auth_middleware, check_bind
from worker.config import WorkerConfig
from worker.engine import Engine, RequestError
from worker.kv_events import engine_capacity, engine_load
from worker.metrics import render as render_metrics
from worker.openapi import worker_openapi_spec
from worker.protocol import BadRequest, parse_generate, parse_namespace_id

log = logging.getLogger("prefixgate.worker")

ENGINE = web.AppKey("engine", Engine)
WORKER_ID = web.AppKey("worker_id", str)
MAX_BODY_BYTES = 64 << 20


def error_body(message: str, *, kind: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Map every failure to OpenAI's error JSON, once."""
    try:
        return await handler(request)
    except BadRequest as exc:
        return web.json_response(
            error_body(str(exc), kind="invalid_request_error", code=exc.code, param=exc.param), status=400
        )
    except RequestError as exc:
        return web.json_response(
            error_body(str(exc), kind="invalid_request_error", code="invalid_request"), status=400
        )
    except Overloaded as exc:  # shed load at once; the gateway retries elsewhere or maps it to the tenant
        return web.json_response(
            error_body(str(exc), kind="server_error", code="worker_overloaded"),
            status=503,
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return web.json_response(error_body(exc.reason, kind=kind, code=str(exc.status)), status=exc.status)
    except Exception:
        log.exception("unhandled error in %s", request.path)
        return web.json_response(
            error_body("internal worker error", kind="server_error", code="internal_error"), status=500
        )


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except json.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc.msg}", code="invalid_json") from None
    except ValueError:  # not UTF-8 (UnicodeDecodeError)
        raise BadRequest("the body is not UTF-8 JSON", code="invalid_json") from None
    except RecursionError:  # json.loads recurses once per nesting level
        raise BadRequest("malformed JSON: nested too deeply", code="invalid_json") from None


async def healthz(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    problem = engine.health_problem()
    if problem is not None:
        status = "down" if not engine.alive else "stuck"
        return web.json_response({"status": status, "reason": problem}, status=503)
    return web.json_response(
        {"status": "ok", "model_id": engine.loaded.model_id, "worker_id": request.app[WORKER_ID]}
    )


async def info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    tok = engine.tokenizer
    return web.json_response(
        {
            "worker_id": request.app[WORKER_ID],
            "model_id": engine.loaded.model_id,
            "model_fingerprint": engine.fingerprint.hex(),
            "block_size": engine.config.block_size,
            "max_model_len": engine.max_model_len,
            "dtype": engine.config.dtype,
            "device": str(engine.device),
            "tokenizer_json": tok.tokenizer_json,
            "chat_template": tok.chat_template,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "eos_token_ids": list(tok.eos_token_ids),
            "add_bos_token": tok.add_bos_token,
            "prefill_tokens_per_s": engine.prefill_tokens_per_s,
            "num_blocks": engine.block_manager.num_blocks,
        }
    )


async def tokenize(request: web.Request) -> web.Response:
    body = await _json(request)
    if not isinstance(body, dict) or not isinstance(body.get("text"), str):
        raise BadRequest("'text' must be a string", param="text")
    add_special = bool(body.get("add_special_tokens", False))
    ids = request.app[ENGINE].tokenizer.encode(body["text"], add_special_tokens=add_special)
    return web.json_response({"token_ids": ids})


async def detokenize(request: web.Request) -> web.Response:
    body = await _json(request)
    ids = body.get("token_ids") if isinstance(body, dict) else None
    tokenizer = request.app[ENGINE].tokenizer
    vocab_size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids
    ):
        raise BadRequest(f"'token_ids' must be a list of integers in [0, {vocab_size})", param="token_ids")
    return web.json_response({"text": tokenizer.decode(ids)})


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    req = parse_generate(await _json(request), engine.config.block_size)
    engine.validate(req.prompt_token_ids, req.sampling)
    engine.check_capacity(len(req.prompt_token_ids))  # before a stream's 200 goes out
    # A bad grammar is a 400 before any streaming starts; compiling drops the GIL, off the event loop.
    matcher = await asyncio.to_thread(engine.new_matcher, req.sampling) if req.sampling.grammar else None
    outputs = engine.generate(
        req.request_id,
        req.prompt_token_ids,
        req.sampling,
        req.segments,
        use_cache=req.use_cache,
        matcher=matcher,
        owner=req.owner,
    )
    if req.stream:
        return await _stream(request, f"{req.request_id} (x-request-id {req.x_request_id})", outputs)
    text, token_ids, logprobs = [], [], []
    async for out in outputs:
        if out.error:
            log.warning("%s (x-request-id %s) failed: %s", req.request_id, req.x_request_id, out.error)
            body = error_body(out.error, kind="server_error", code="engine_error")
            return web.json_response(body, status=503)
        text.append(out.text)
        token_ids += out.token_ids
        logprobs += out.logprobs or []
        if out.finished:
            result = {
                "request_id": req.request_id,
                "text": "".join(text),
                "token_ids": token_ids,
                "finish_reason": out.finish_reason,
                "usage": out.usage,
            }
            if req.sampling.logprobs is not None:
                result["logprobs"] = logprobs
            return web.Response(body=orjson.dumps(result), content_type="application/json")
    raise web.HTTPInternalServerError(reason="request ended without a result")


async def _stream(request: web.Request, label: str, outputs: AsyncIterator[Any]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    try:
        async for out in outputs:
            if out.error:
                line = {"type": "error", **error_body(out.error, kind="server_error", code="engine_error")}
            elif out.finished:
                line = {
                    "type": "final",
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason,
                    "usage": out.usage,
                }
            else:
                line = {"type": "delta", "text": out.text, "token_ids": out.token_ids}
                if out.usage:  # the first token's: the prompt's usage so far
                    line["usage"] = out.usage
            if out.logprobs:
                line["logprobs"] = out.logprobs
            await response.write(orjson.dumps(line) + b"\n")
    except (ConnectionResetError, ConnectionError):
        # Client gone: leaving the loop closes ``outputs``, which aborts the request and frees its blocks.
        log.info("client of %s disconnected", label)
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    await response.write_eof()
    return response


async def abort(request: web.Request) -> web.Response:
    body = await _json(request)
    request_id = body.get("request_id") if isinstance(body, dict) else None
    if not isinstance(request_id, str):
        raise BadRequest("'request_id' must be a string", param="request_id")
    engine = request.app[ENGINE]
    known = engine.is_running(request_id)
    engine.abort(request_id)
    return web.json_response({"aborted": known})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(worker_openapi_spec())


def _int_query(request: web.Request, name: str, default: int, upper: int) -> int:
    raw = request.query.get(name)
    try:
        value = default if raw is None else int(raw)
    except ValueError:
        raise BadRequest(f"'{name}' must be an integer", param=name) from None
    if not 0 <= value <= upper:
        raise BadRequest(f"'{name}' must be between 0 and {upper}", param=name)
    return value


async def kv_events(request: web.Request) -> web.Response:
    """KV events after ``since`` (long-polls up to ``wait_ms`` when there are none) and the load; a
    snapshot page instead when the events are gone from the ring or ``snapshot`` names the next page
    (``worker.kv_events``)."""
    engine = request.app[ENGINE]
    since = _int_query(request, "since", 0, 1 << 62)
    wait_ms = _int_query(request, "wait_ms", 0, 30_000)
    max_events = _int_query(request, "max_events", 4096, 65_536) or 1
    cursor = request.query.get("snapshot")
    if cursor is not None and (len(cursor) > 64 or not cursor.isascii()):
        raise BadRequest("'snapshot' must be the cursor of the previous page", param="snapshot")
    deadline = time.monotonic() + wait_ms / 1000
    batch = engine.kv_events.since(since, max_events=max_events) if cursor is None else None
    while batch is not None and not batch.events and not batch.reset and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        batch = engine.kv_events.since(since, max_events=max_events)
    if batch is None or batch.reset:  # a snapshot page; off the event loop: a new one copies the state
        batch = await asyncio.to_thread(engine.kv_events.read, since, cursor=cursor, max_events=max_events)
    body = {
        "worker_id": request.app[WORKER_ID],
        "last_seq": batch.last_seq,
        "reset": batch.reset,
        "events": [event.to_json() for event in batch.events],
        "load": engine_load(engine),
        "capacity_blocks": engine_capacity(engine),
        "remote_tier": engine.store.remote_tier() if engine.store is not None else None,
    }
    if batch.snapshot is not None:
        body["events"] = batch.snapshot.events
        body["snapshot"] = batch.snapshot.to_json()
    return web.json_response(body)


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].stats())


async def metrics(request: web.Request) -> web.Response:
    body = render_metrics(request.app[ENGINE].stats)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def purge(request: web.Request) -> web.Response:
    body = await _json(request)
    namespace_id = parse_namespace_id(body.get("namespace_id") if isinstance(body, dict) else None)
    erased, failed = await request.app[ENGINE].purge(namespace_id)
    body: dict[str, Any] = {"namespace_id": namespace_id, "blocks_erased": erased}
    if failed:  # a partial data deletion must not look like success
        reasons = "; ".join(f"{tier}: {why}" for tier, why in failed.items())
        body |= error_body(
            f"purge incomplete ({reasons}); retry", kind="server_error", code="purge_incomplete"
        )
        body["failed"] = failed
        return web.json_response(body, status=503)
    return web.json_response(body)


def create_app(config: WorkerConfig, engine: Engine | None = None) -> web.Application:
    """The worker app; the engine is built (model loaded) and started in the app's startup."""
    check_bind(config.host, config.shared_secret)
    middlewares = [errors_middleware]
    if config.shared_secret:
        middlewares.append(auth_middleware(config.shared_secret))
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[WORKER_ID] = uuid.uuid4().hex

    async def engine_lifetime(app: web.Application) -> AsyncIterator[None]:
        app[ENGINE] = engine or Engine(config)
        app[ENGINE].start()
        yield
        app[ENGINE].stop()

    app.cleanup_ctx.append(engine_lifetime)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/info", info)
    app.router.add_post("/v1/tokenize", tokenize)
    app.router.add_post("/v1/detokenize", detokenize)
    app.router.add_post("/v1/generate", generate)
    app.router.add_post("/v1/abort", abort)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/v1/kv_events", kv_events)
    app.router.add_post("/v1/purge", purge)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app
