"""One usage record the database refuses, in a batch of 500: how long the flush (under the writer's
lock, so every tenant's billing waits) takes, with main's fallback (one insert per record) and with
bisection (hostile-input review, finding 1).

    PREFIXGATE_TEST_POSTGRES_URL=postgresql+asyncpg://postgres@127.0.0.1:5432/test \
        python -m bench.usage_poison

Creates a scratch database on that server (dropped at the end). The last line printed is JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import tempfile
import time
from pathlib import Path

from sqlalchemy.engine import make_url

import tenancy.usage
from migrations import upgrade_database_async
from tenancy.db import create_engine, create_sessionmaker
from tenancy.spool import UsageSpool
from tenancy.usage import UsageWriter, insert_usage, is_content_error
from tenancy.usage_types import UsageEvent
from tests.tenancy.db_support import _pg_admin

BATCH = 500


class MainFallbackWriter(UsageWriter):
    """main's ``_insert``: after a refused batch, one insert per record."""

    async def _insert(self, events):  # type: ignore[no-untyped-def]
        try:
            await self._call(lambda: insert_usage(self._sessionmaker, events))
            return []
        except Exception as exc:
            if not is_content_error(exc) and not await self._database_reachable():
                raise
        refused = []
        for event in events:
            try:
                await self._call(lambda event=event: insert_usage(self._sessionmaker, [event]))
            except Exception:
                refused.append(event)
        return refused


def _event(request_id: str, **kwargs) -> UsageEvent:  # type: ignore[no-untyped-def]
    values = {"tenant_id": "tn_b", "model": "m", "endpoint": "chat.completions", "status": 200, **kwargs}
    return UsageEvent(request_id=request_id, **values)


async def _flush_s(writer: UsageWriter, tag: str, poison: bool) -> float:
    for i in range(BATCH - 1 if poison else BATCH):
        writer.submit(_event(f"{tag}-{i}"))
    if poison:
        writer.submit(_event(f"{tag}-poison", tenant_id="tn_a", prompt_tokens=2**40))  # beyond int4
    started = time.perf_counter()
    await writer.flush()
    return time.perf_counter() - started


async def main() -> None:
    base = os.environ["PREFIXGATE_TEST_POSTGRES_URL"]
    name = f"prefixgate_bench_{secrets.token_hex(4)}"
    await _pg_admin(base, f'CREATE DATABASE "{name}"')
    url = make_url(base).set(database=name).render_as_string(hide_password=False)
    results: dict[str, dict[str, float]] = {}
    try:
        await upgrade_database_async(url)
        engine = create_engine(url)
        maker = create_sessionmaker(engine)
        tenancy.usage.log.disabled = True  # 500 "rejected" lines would time the logger
        with tempfile.TemporaryDirectory() as tmp:
            for label, cls in (("main", MainFallbackWriter), ("now", UsageWriter)):
                writer = cls(maker, UsageSpool(Path(tmp) / f"{label}.jsonl"))
                await _flush_s(writer, f"{label}-warm", False)
                clean = min([await _flush_s(writer, f"{label}-c{r}", False) for r in range(3)])
                poisoned = min([await _flush_s(writer, f"{label}-p{r}", True) for r in range(3)])
                results[label] = {"clean_s": round(clean, 4), "one_refused_s": round(poisoned, 4)}
                print(
                    f"{label:5} flush of {BATCH} clean {clean:.3f} s, "
                    f"{BATCH - 1} clean + 1 refused {poisoned:.3f} s"
                )
        await engine.dispose()
    finally:
        await _pg_admin(base, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    ratio = results["main"]["one_refused_s"] / results["now"]["one_refused_s"]
    print(
        json.dumps(
            {
                **results,
                "one_refused_main_to_now": round(ratio, 1),
                "loadavg": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
