"""Running the gateway: ``prefixgate gateway`` and the embedded default ``prefixgate up`` (its worker
process is supervised by ``gateway.supervisor``)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys

from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig, prepare_data_dir
from gateway.slow_clients import start_site
from gateway.state import POLICY_CACHE, REPOSITORY, WORKER_POOL
from gateway.supervisor import DataDirInUse, DataDirLock, WorkerSupervisor

log = logging.getLogger("prefixgate")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)  # one line per migration step otherwise


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Serving:
    """The gateway's runner and its listening server (closed together)."""

    def __init__(self, runner: web.AppRunner, server: asyncio.AbstractServer) -> None:
        self.runner = runner
        self.server = server

    async def cleanup(self) -> None:
        self.server.close()
        await self.runner.cleanup()


async def _serve(app: web.Application, config: GatewayConfig) -> _Serving:
    # shutdown_timeout: aiohttp waits this long for requests in flight, then cancels them (and waits as
    # long again for them to end: they end at once). Default 60 s, longer than a container allows.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=75.0,
        shutdown_timeout=config.shutdown_grace_s,
    )
    await runner.setup()
    try:
        server = await start_site(runner, config.host, config.port, config.header_timeout_s)
    except OSError:
        await runner.cleanup()  # the port is taken: close the database and background tasks again
        raise
    return _Serving(runner, server)


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run_gateway(config: GatewayConfig) -> int:
    """Serve the gateway until SIGINT/SIGTERM (migrations are ``prefixgate db upgrade``'s job)."""
    _setup_logging(config.log_level)
    config = prepare_data_dir(config)

    async def main() -> None:
        stop = _stop_event()
        runner = await _serve(create_app(config), config)
        log.info(
            "gateway listening on http://%s:%d (workers: %s)",
            config.host,
            config.port,
            ", ".join(config.worker_urls),
        )
        await stop.wait()
        await runner.cleanup()

    asyncio.run(main())
    return 0


def _banner(
    config: GatewayConfig,
    model_id: str,
    api_key: str | None,
    admin_token_from_env: bool,
    *,
    admin_token_created: bool = False,
) -> str:
    """What ``prefixgate up`` prints once ready. The admin token is shown only when this start generated
    it (terminal scrollback and logs keep what is printed on every start)."""
    base = f"http://{'127.0.0.1' if config.host in ('0.0.0.0', '::') else config.host}:{config.port}"
    key = api_key or "$PREFIXGATE_API_KEY"
    lines = ["", f"prefixgate is up: {base}/v1  (model {model_id!r}, data in {config.data_dir.resolve()})"]
    if api_key:
        lines.append(f"  demo tenant API key (shown once): {api_key}")
    else:
        lines.append("  demo tenant exists; get a fresh key with: prefixgate tenant rotate-key demo")
    if not admin_token_from_env and admin_token_created:
        lines.append(f"  admin token (stored in {config.data_dir / 'admin_token'}): {config.admin_token}")
    elif not admin_token_from_env:
        lines.append(f"  admin token: in {config.data_dir / 'admin_token'} (shown only when it was created)")
    lines += [
        "",
        "Try it with curl:",
        f"  curl {base}/v1/chat/completions -H 'Authorization: Bearer {key}' \\",
        "    -H 'Content-Type: application/json' \\",
        f'    -d \'{{"model": "{model_id}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        '"max_tokens": 32}\'',
        "",
        "or with the openai SDK:",
        "  from openai import OpenAI",
        f"  client = OpenAI(base_url='{base}/v1', api_key='{key}')",
        f"  reply = client.chat.completions.create(model='{model_id}', "
        "messages=[{'role': 'user', 'content': 'Hello!'}], max_tokens=32)",
        "  print(reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens)",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


async def _wait_ready(app: web.Application, worker: WorkerSupervisor, stop: asyncio.Event) -> str | None:
    """The served model id once the worker is healthy; None if the worker died or we were stopped."""
    pool = app[WORKER_POOL]
    while not stop.is_set() and worker.process is not None and worker.process.returncode is None:
        if pool.models:
            return next(iter(pool.models))
        await asyncio.sleep(0.2)
    return None


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def run_up(config: GatewayConfig, *, model: str = "builtin", worker_port: int | None = None) -> int:
    """Embedded default: SQLite in the data dir, one supervised worker process, the gateway, a demo tenant.

    One ``up`` per data dir (a second one refuses); the worker is restarted with backoff when it dies
    and dies with this process."""
    from migrations import upgrade_database

    _setup_logging(config.log_level)
    admin_token_from_env = bool(config.admin_token)
    admin_token_created = not admin_token_from_env and not (config.data_dir / "admin_token").exists()
    config = prepare_data_dir(config)
    lock = DataDirLock(config.data_dir)
    try:
        lock.acquire()
    except DataDirInUse as exc:
        log.error("%s", exc)
        return 2
    try:
        if worker_port is not None and _port_in_use("127.0.0.1", worker_port):
            log.error("worker port %d is in use (an orphaned worker?); stop it or pick another", worker_port)
            return 2
        upgrade_database(config.resolved_database_url)
        worker_port = worker_port or free_port()
        config = dataclasses.replace(config, worker_urls=(f"http://127.0.0.1:{worker_port}",))
        return asyncio.run(_up(config, model, worker_port, admin_token_from_env, admin_token_created))
    finally:
        lock.release()


async def _up(
    config: GatewayConfig, model: str, worker_port: int, admin_token_from_env: bool, admin_token_created: bool
) -> int:
    stop = _stop_event()
    app = create_app(config)
    try:
        runner = await _serve(app, config)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, exc.strerror or exc)
        return 2
    argv = [sys.executable, "-m", "worker", "--host", "127.0.0.1", "--port", str(worker_port)]
    argv += ["--model", model, "--data-dir", str(config.data_dir / "worker")]
    worker = WorkerSupervisor(argv=argv, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        process = await worker.start()
        log.info(
            "gateway on http://%s:%d; waiting for the worker (pid %d) to load its model",
            config.host,
            config.port,
            process.pid,
        )
        model_id = await _wait_ready(app, worker, stop)
        if model_id is None:
            if process.returncode is not None:
                log.error("the worker exited with status %s before it was ready", process.returncode)
                return 1
            return 0
        repo = app[REPOSITORY]
        api_key = None
        if await repo.find_by_name("demo") is None:
            # The demo shows canonicalization at work: timestamps and ids leave the prefix.
            _, new_key = await repo.create_tenant({"name": "demo", "canonicalization": "on"})
            api_key = new_key.api_key
            await app[POLICY_CACHE].reload()
        banner = _banner(
            config, model_id, api_key, admin_token_from_env, admin_token_created=admin_token_created
        )
        print(banner, flush=True)
        await worker.supervise(stop)  # until SIGINT/SIGTERM, restarting the worker when it dies
        return 0
    finally:
        log.info("stopping")
        try:
            await runner.cleanup()
        finally:  # never orphan the worker, whatever the cleanup raised
            await worker.stop()
