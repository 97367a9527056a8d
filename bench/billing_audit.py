"""Billing audit: mixed tenant traffic through faults, then every usage record checked against what the
clients received.

    python -m bench.billing_audit [--quick]

Starts a private PostgreSQL cluster (initdb in a temporary directory; PostgreSQL binaries required),
two worker processes (``random-tiny``) and the gateway in this process, then sends mixed traffic
(streamed and plain, short answers, long streams the client hangs up on) through these phases:

    normal → database stopped → database SIGSTOPped (hangs) → database flapping
    → spool disk full while the database is stopped (/dev/full) → a worker SIGKILLed mid-stream
    → gateway shutdown with streams in flight (drain, cut, flush)

then restarts a gateway that replays the spool, and compares, per request id the client saw:
exactly one record, completed answers billed the usage the client was sent, cut streams billed within
the tokens whose text the client received (byte-level tokenizer: ``len(text) <= tokens <=
len(text.encode())``; a client hang-up may be billed tokens still in flight to it). Requests that failed
before any output must cost 0. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from sqlalchemy import select

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.state import USAGE_WRITER
from gateway.up import free_port
from migrations import upgrade_database_async
from tenancy.db import create_engine, create_sessionmaker
from tenancy.models import UsageRecord
from tenancy.repository import TenantRepository
from tests.tenancy.private_postgres import PrivatePostgres, private_postgres
from tests.worker_process import worker_process

MODEL = "random-tiny"


@dataclass(slots=True)
class Sent:
    """What one client saw."""

    phase: str
    stream: bool
    max_tokens: int
    hang_up: bool  # the client closes the stream part-way
    http_status: int = 0
    request_id: str | None = None
    text: str = ""
    usage: dict[str, Any] | None = None  # the usage the client was sent (completed answers)
    cut: bool = False  # the stream ended without its final chunk


@dataclass(slots=True)
class Audit:
    sent: list[Sent] = field(default_factory=list)


def _prompt(rng: random.Random) -> str:
    return f"[{rng.getrandbits(64):x}] system rules " + " ".join(f"r{i}" for i in range(rng.randint(20, 60)))


async def one_request(
    session: aiohttp.ClientSession, base: str, key: str, sent: Sent, rng: random.Random
) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "system", "content": _prompt(rng)}, {"role": "user", "content": "go"}],
        "max_tokens": sent.max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "user": f"user-{rng.randint(1, 5)}",
    }
    if sent.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with session.post(f"{base}/v1/chat/completions", json=body, headers=headers) as response:
            sent.http_status = response.status
            if response.status != 200:
                await response.read()
                return
            if not sent.stream:
                data = await response.json()
                sent.request_id, sent.usage = response.headers["x-request-id"], data["usage"]
                sent.text = data["choices"][0]["message"]["content"]
                return
            await _read_stream(response, sent, rng)
    except (TimeoutError, aiohttp.ClientError):
        sent.cut = True


async def _read_stream(response: aiohttp.ClientResponse, sent: Sent, rng: random.Random) -> None:
    buffer, num_chunks, hang_up_after = b"", 0, rng.randint(5, 40)
    sent.cut = True
    try:
        async for line in response.content:
            buffer = line.strip()
            if not buffer.startswith(b"data: "):
                continue
            data = buffer[6:]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            sent.request_id = sent.request_id or response.headers["x-request-id"]  # the record's key
            if chunk.get("usage") and not chunk.get("choices"):
                sent.usage, sent.cut = chunk["usage"], False
            for choice in chunk.get("choices") or ():
                sent.text += (choice.get("delta") or {}).get("content") or ""
            num_chunks += 1
            if sent.hang_up and num_chunks >= hang_up_after:
                response.close()
                return
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):
        return


async def traffic(
    base: str, key: str, phase: str, n: int, audit: Audit, rng: random.Random, concurrency: int = 6
) -> None:
    queue = [
        Sent(
            phase=phase,
            stream=(stream := rng.random() < 0.7),
            hang_up=(hang := stream and rng.random() < 0.25),
            max_tokens=2000 if hang else rng.randint(4, 48),
        )
        for _ in range(n)
    ]
    audit.sent += queue
    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def run(sent: Sent) -> None:
            async with semaphore:
                await one_request(session, base, key, sent, rng)

        await asyncio.gather(*(run(sent) for sent in queue))


@dataclass(slots=True)
class Rig:
    pg: PrivatePostgres
    workers: list[str]
    data_dir: Path
    port: int = field(default_factory=free_port)
    runner: web.AppRunner | None = None

    def config(self) -> GatewayConfig:
        return GatewayConfig(
            host="127.0.0.1",
            port=self.port,
            data_dir=self.data_dir,
            database_url=self.pg.url,
            worker_urls=tuple(self.workers),
            admin_token="audit",
            namespace_salt="audit-salt",
            usage_flush_s=0.1,
            usage_db_timeout_s=1.0,
            shutdown_grace_s=1.0,
            worker_health_interval_s=0.5,
            policy_refresh_s=0.5,
        )

    async def start(self) -> web.Application:
        app = create_app(self.config())
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return app

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def worker_pid(url: str) -> int:
    wanted = ["-m", "worker", "--port", url.rsplit(":", 1)[1]]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().decode().split("\0")
                if any(argv[i : i + 4] == wanted for i in range(len(argv))):
                    return int(entry.name)
    raise LookupError(url)


async def flap(pg: PrivatePostgres, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.to_thread(pg.stop)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(pg.start)
        await asyncio.sleep(0.3)


async def run_phases(rig: Rig, key: str, audit: Audit, n: int, progress: Progress) -> dict[str, Any]:
    rng = random.Random(7)
    base = f"http://127.0.0.1:{rig.port}"
    app = await rig.start()
    spool_path = app[USAGE_WRITER].spool.path
    task = progress.add_task("phases", total=7)

    async def phase(name: str, *, during: Any = None) -> None:
        worker = asyncio.create_task(during()) if during else None
        await traffic(base, key, name, n, audit, rng)
        if worker is not None:
            await worker
        progress.advance(task)

    await phase("normal")
    await asyncio.to_thread(rig.pg.stop)
    await phase("db stopped")
    await asyncio.to_thread(rig.pg.start)
    await asyncio.sleep(0.5)
    rig.pg.pause()
    await phase("db hung (SIGSTOP)")
    rig.pg.resume()
    stop_flap = asyncio.Event()
    flapper = asyncio.create_task(flap(rig.pg, stop_flap))
    await phase("db flapping")
    stop_flap.set()
    await flapper
    await asyncio.to_thread(rig.pg.stop)
    spool_path.parent.mkdir(parents=True, exist_ok=True)
    aside = spool_path.with_name("spool-aside.jsonl")
    if spool_path.exists():
        os.replace(spool_path, aside)  # the records spooled so far, kept while the disk is "full"
    spool_path.symlink_to("/dev/full")
    await phase("spool disk full + db stopped")
    spool_path.unlink()  # space is back
    if aside.exists():
        with open(spool_path, "ab") as handle:  # one O_APPEND write: never interleaves a line
            handle.write(aside.read_bytes())
        aside.unlink()
    await asyncio.to_thread(rig.pg.start)

    async def kill_worker() -> None:
        await asyncio.sleep(0.4)
        os.kill(worker_pid(rig.workers[1]), signal.SIGKILL)

    await phase("worker SIGKILL", during=kill_worker)

    async def shutdown_mid_traffic() -> None:
        await asyncio.sleep(0.5)
        await rig.stop()  # drain 1 s, cut the rest, flush usage

    await phase("gateway shutdown", during=shutdown_mid_traffic)
    writer_stats = {"spool_depth_at_exit": app[USAGE_WRITER].spool_depth()}
    await rig.start()  # the next start replays the spool
    app2 = rig.runner.app if rig.runner else None
    for _ in range(200):
        if app2 is not None and app2[USAGE_WRITER].spool_depth() == 0 and app2[USAGE_WRITER].pending == 0:
            break
        await asyncio.sleep(0.1)
    await rig.stop()
    return writer_stats


async def load_records(url: str) -> list[UsageRecord]:
    engine = create_engine(url)
    async with create_sessionmaker(engine)() as session:
        rows = list(await session.scalars(select(UsageRecord)))
    await engine.dispose()
    return rows


def check(audit: Audit, rows: list[UsageRecord]) -> dict[str, Any]:
    by_id: dict[str, list[UsageRecord]] = {}
    for row in rows:
        by_id.setdefault(row.request_id, []).append(row)
    duplicates = sum(len(v) - 1 for v in by_id.values())
    seen = [s for s in audit.sent if s.request_id]
    lost = [s for s in seen if s.request_id not in by_id]
    wrong: list[str] = []
    expected_completion = recorded_completion = 0
    for sent in seen:
        if sent.request_id not in by_id:
            continue
        row = by_id[sent.request_id][0]
        if sent.usage is not None and not sent.cut:
            expected_completion += sent.usage["completion_tokens"]
            recorded_completion += row.completion_tokens
            if (row.completion_tokens, row.prompt_tokens) != (
                sent.usage["completion_tokens"],
                sent.usage["prompt_tokens"],
            ) or row.outcome != "completed":
                wrong.append(sent.request_id)
        elif sent.hang_up:  # the gateway may have sent more than this client read before closing
            if not len(sent.text) <= row.completion_tokens <= sent.max_tokens:
                wrong.append(sent.request_id)
        elif not len(sent.text) <= row.completion_tokens <= len(sent.text.encode()):
            wrong.append(sent.request_id)
    failed_rows = [r for r in rows if r.request_id not in {s.request_id for s in seen}]
    unbilled_failures = sum(r.cost_total == 0 and r.completion_tokens == 0 for r in failed_rows)
    phases: dict[str, dict[str, int]] = {}
    for sent in audit.sent:
        p = phases.setdefault(sent.phase, {"sent": 0, "answered": 0, "cut": 0, "failed": 0})
        p["sent"] += 1
        p["answered" if sent.request_id and not sent.cut else "cut" if sent.request_id else "failed"] += 1
    return {
        "requests_sent": len(audit.sent),
        "records_expected": len(seen),
        "records_found": sum(1 for s in seen if s.request_id in by_id),
        "records_total": len(rows),
        "lost": len(lost),
        "duplicates": duplicates,
        "wrong_tokens": len(wrong),
        "completion_tokens_expected": expected_completion,
        "completion_tokens_recorded": recorded_completion,
        "cut_streams_recorded": sum(1 for s in seen if s.cut and s.request_id in by_id),
        "failed_before_output_records": len(failed_rows),
        "failed_before_output_billed": len(failed_rows) - unbilled_failures,
        "phases": phases,
    }


async def main_async(quick: bool) -> dict[str, Any]:
    n = 24 if quick else 80
    with tempfile.TemporaryDirectory(prefix="billing-audit-") as tmp, private_postgres() as pg:
        await upgrade_database_async(pg.url)
        engine = create_engine(pg.url)
        _, new_key = await TenantRepository(create_sessionmaker(engine)).create_tenant(
            {"name": "audit", "price_input_per_mtok": 2.0, "price_output_per_mtok": 6.0}
        )
        await engine.dispose()
        args = ("--model", MODEL, "--num-blocks", "4096")
        with worker_process(*args) as w1, worker_process(*args) as w2:
            rig = Rig(pg=pg, workers=[w1, w2], data_dir=Path(tmp))
            audit = Audit()
            with Progress() as progress:
                stats = await run_phases(rig, new_key.api_key, audit, n, progress)
            rows = await load_records(pg.url)
    return {**check(audit, rows), **stats}


def report(result: dict[str, Any]) -> None:
    console = Console()
    table = Table(title="billing audit: requests by phase")
    for col in ("phase", "sent", "answered", "cut", "failed"):
        table.add_column(col, justify="right" if col != "phase" else "left")
    for name, p in result["phases"].items():
        table.add_row(name, *(str(p[k]) for k in ("sent", "answered", "cut", "failed")))
    console.print(table)
    summary = Table(title="records vs what the clients received")
    summary.add_column("check")
    summary.add_column("value", justify="right")
    for key, value in result.items():
        if key != "phases":
            summary.add_row(key, str(value))
    console.print(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per phase")
    args = parser.parse_args()
    started = time.monotonic()
    result = asyncio.run(main_async(args.quick))
    report(result)
    ok = result["lost"] == 0 and result["duplicates"] == 0 and result["wrong_tokens"] == 0
    ok = ok and result["failed_before_output_billed"] == 0
    print(
        json.dumps(
            {
                "bench": "billing_audit",
                "ok": ok,
                "seconds": round(time.monotonic() - started, 1),
                **{k: v for k, v in result.items() if k != "phases"},
            }
        )
    )


if __name__ == "__main__":
    main()
