"""The workload as chat requests: the same plan as the block-id trace, timestamps and tools injected."""

import json
import re
from dataclasses import replace
from datetime import datetime, timedelta

from bench.chat_workload import TRACE_START, ChatSpec, chat_workload
from bench.workloads import WorkloadSpec, generate_workload, main
from policies.canonicalize import CanonicalizationPolicy, canonical_tools, canonicalize_request

SPEC = WorkloadSpec(num_requests=200, seed=5)
CHAT = ChatSpec(unit_chars=32)
STAMP = re.compile(r"Current time: (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")


def _body(request):
    return {"messages": request.messages, **({"tools": request.tools} if request.tools else {})}


def test_same_requests_tenants_and_times_as_the_block_id_trace():
    chat = chat_workload(SPEC, CHAT)
    trace = generate_workload(SPEC)
    assert chat == chat_workload(SPEC, CHAT)
    assert [(r.timestamp_ms, r.tenant) for r in chat] == [(r.timestamp_ms, r.tenant) for r in trace]
    assert {r.public for r in chat} == {True, False}
    for request in chat:
        assert request.messages[0]["role"] == "system"
        assert request.messages[-1]["role"] == "user"


def test_generated_text_has_no_dynamic_fragments():
    report = CanonicalizationPolicy(mode="report")
    for request in chat_workload(SPEC, CHAT):
        canon = canonicalize_request(_body(request), report)
        assert not canon.report.fragments and not canon.report.whitespace


def test_timestamps_carry_the_request_time_for_a_share_of_applications():
    assert not any(r.timestamped for r in chat_workload(SPEC, CHAT))
    requests = chat_workload(SPEC, replace(CHAT, timestamp_share=0.5))
    stamped = [r for r in requests if r.timestamped]
    assert 0.2 * len(requests) < len(stamped) < 0.8 * len(requests)
    for request in requests:
        match = STAMP.search(request.messages[0]["content"])
        assert bool(match) == request.timestamped
        if match:
            assert match.group(1) == _iso(TRACE_START + timedelta(milliseconds=request.timestamp_ms))
    # an application (tenant, system prompt) always or never sends the time
    by_app = {}
    for request in requests:
        by_app.setdefault((request.tenant, _without_stamp(request)), set()).add(request.timestamped)
    assert all(len(flags) == 1 for flags in by_app.values())


def test_shuffled_tools_are_the_same_tools_in_canonical_form():
    plain = chat_workload(SPEC, CHAT)
    shuffled = chat_workload(SPEC, replace(CHAT, tool_shuffle_share=1.0))
    assert any(a.tools != b.tools for a, b in zip(plain, shuffled, strict=True))
    for a, b in zip(plain, shuffled, strict=True):
        assert (a.tools is None) == (b.tools is None)
        if a.tools:
            assert canonical_tools(a.tools) == canonical_tools(b.tools)


def test_cli_writes_chat_requests(tmp_path, capsys):
    out = tmp_path / "out" / "chat.jsonl"
    main(
        ["--out", str(out), "--chat", "--num-requests", "30", "--timestamp-share", "1", "--unit-chars", "40"]
    )
    printed = capsys.readouterr().out
    assert "wrote 30 chat requests" in printed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 30
    summary = json.loads(printed.strip().splitlines()[-1])  # the last line printed is JSON
    assert summary == {"bench": "workloads", "out": str(out), "chat_requests": 30, "tenants": 8}
    assert {"timestamp", "tenant", "messages"} <= set(records[0])
    assert all(STAMP.search(r["messages"][0]["content"]) for r in records)


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _without_stamp(request) -> str:
    return STAMP.sub("", request.messages[0]["content"])
