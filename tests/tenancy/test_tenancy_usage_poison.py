"""A record the database refuses must cost the others little, and client-chosen text never makes a
record unstorable (hostile-input review, finding 1)."""

from pathlib import Path

from sqlalchemy import select

import tenancy.usage
from tenancy.db import create_engine, create_sessionmaker
from tenancy.models import UsageRecord
from tenancy.spool import UsageSpool
from tenancy.usage import UsageWriter
from tests.tenancy.test_tenancy_usage import count, event


async def test_nul_and_lone_surrogates_in_client_strings_are_stored_on_postgresql(pg_url, tmp_path: Path):
    engine = create_engine(pg_url)
    sessionmaker = create_sessionmaker(engine)
    writer = UsageWriter(sessionmaker, UsageSpool(tmp_path / "spool.jsonl"))
    writer.submit(event("nul", model="m\x00x", end_user="alice\x00", tenant_name="t\x00n"))
    writer.submit(event("surrogate", model="m\ud800", end_user="\udcff"))
    await writer.flush()
    assert writer.rejected.read() == [] and writer.spool.depth() == 0
    async with sessionmaker() as session:
        rows = {row.request_id: row for row in await session.scalars(select(UsageRecord))}
    assert rows["nul"].model == "m\ufffdx" and rows["nul"].end_user == "alice\ufffd"
    assert rows["nul"].tenant_name == "t\ufffdn" and rows["nul"].completion_tokens == 10
    assert rows["surrogate"].model == "m\ufffd"
    await engine.dispose()


async def test_one_refused_record_is_found_by_bisection_not_one_insert_per_record(
    pg_url, tmp_path: Path, monkeypatch
):
    """499 good records and one the database refuses: all good ones stored, the bad one set aside once,
    with O(log n) inserts instead of one per record (each under the writer's lock)."""
    engine = create_engine(pg_url)
    sessionmaker = create_sessionmaker(engine)
    writer = UsageWriter(sessionmaker, UsageSpool(tmp_path / "spool.jsonl"))
    calls = []
    real_insert = tenancy.usage.insert_usage

    async def counting_insert(maker, events):
        events = list(events)
        calls.append(len(events))
        await real_insert(maker, events)

    monkeypatch.setattr(tenancy.usage, "insert_usage", counting_insert)
    for i in range(499):
        writer.submit(event(f"good-{i}"))
        if i == 321:
            writer.submit(event("poison", prompt_tokens=2**40))  # out of int4 range: refused
    await writer.flush()
    assert await count(sessionmaker) == 499
    assert [e.request_id for e in writer.rejected.read()] == ["poison"]
    assert len(calls) <= 2 * 9 + 1, calls  # one batch, then two halves per level of a 500-record bisection
    calls.clear()
    assert await writer.retry_rejected() == (0, 1)  # still refused, kept, one call
    assert calls == [1]
    await engine.dispose()


async def test_two_refused_records_in_one_batch_are_both_set_aside(pg_url, tmp_path: Path):
    engine = create_engine(pg_url)
    sessionmaker = create_sessionmaker(engine)
    writer = UsageWriter(sessionmaker, UsageSpool(tmp_path / "spool.jsonl"))
    for i in range(40):
        writer.submit(event(f"ok-{i}"))
    writer.submit(event("bad-a", completion_tokens=2**40))
    writer.submit(event("bad-b", cached_tokens=-(2**40)))
    await writer.flush()
    assert await count(sessionmaker) == 40
    assert sorted(e.request_id for e in writer.rejected.read()) == ["bad-a", "bad-b"]
    await engine.dispose()
