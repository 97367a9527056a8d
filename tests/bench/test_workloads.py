"""The synthetic multi-tenant workload: chained ids, tenants, shared public prompts, sessions."""

import itertools
import json
from dataclasses import replace

from bench.trace import load_trace
from bench.workloads import WorkloadSpec, generate_workload, main, plan_workload

SPEC = WorkloadSpec(num_requests=800, seed=11)


def test_same_spec_same_trace_and_seed_matters():
    assert generate_workload(SPEC) == generate_workload(SPEC)
    assert generate_workload(SPEC) != generate_workload(replace(SPEC, seed=12))


def test_ids_are_prefix_chained():
    parent_of, position_of = {}, {}
    for request in generate_workload(SPEC):
        parent = None
        for position, block_id in enumerate(request.hash_ids):
            assert parent_of.setdefault(block_id, parent) == parent
            assert position_of.setdefault(block_id, position) == position
            parent = block_id


def test_requests_are_ordered_and_tagged():
    requests = generate_workload(SPEC)
    assert len(requests) == SPEC.num_requests
    assert [r.timestamp_ms for r in requests] == sorted(r.timestamp_ms for r in requests)
    assert {r.tenant for r in requests} <= {f"t{i}" for i in range(SPEC.num_tenants)}
    assert len({r.tenant for r in requests}) > 1
    for r in requests:
        assert (
            (len(r.hash_ids) - 1) * SPEC.block_tokens < r.input_length <= len(r.hash_ids) * SPEC.block_tokens
        )


def test_public_prompts_are_the_only_blocks_tenants_share():
    def tenants_of_first_blocks(spec):
        owners = {}
        for r in generate_workload(spec):
            owners.setdefault(r.hash_ids[0], set()).add(r.tenant)
        return owners

    assert any(len(t) > 1 for t in tenants_of_first_blocks(SPEC).values())
    private = replace(SPEC, public_prompts=0)
    assert all(len(t) == 1 for t in tenants_of_first_blocks(private).values())


def test_later_turns_extend_earlier_prompts():
    requests = generate_workload(SPEC)
    prompts = {r.hash_ids for r in requests}
    extensions = sum(any(r.hash_ids[:k] in prompts for k in range(1, len(r.hash_ids))) for r in requests)
    assert extensions > len(requests) // 4


def test_cli_writes_a_loadable_trace(tmp_path, capsys):
    out = tmp_path / "out" / "w.jsonl"  # like bench/out/, which a fresh checkout does not have
    main(["--out", str(out), "--num-requests", "50", "--num-tenants", "3", "--message-blocks", "1", "2"])
    requests = load_trace(out)
    assert len(requests) == 50
    printed = capsys.readouterr().out
    assert "wrote 50 requests" in printed
    # Like every bench, the last line printed is one JSON object (DESIGN.md, "bench/").
    summary = json.loads(printed.strip().splitlines()[-1])
    assert summary == {
        "bench": "workloads",
        "out": str(out),
        "requests": 50,
        "blocks": sum(len(r.hash_ids) for r in requests),
        "unique_blocks": len({b for r in requests for b in r.hash_ids}),
        "tenants": 3,
    }
    assert set(json.loads(out.read_text().splitlines()[0])) == {
        "timestamp",
        "tenant",
        "input_length",
        "output_length",
        "hash_ids",
    }


def test_tool_agents_append_a_tool_result_after_each_answer():
    agent = replace(
        SPEC, tool_result_blocks=(2, 2), answer_blocks=(0, 0), message_blocks=(1, 1), mean_turns=6.0
    )
    plans = plan_workload(agent)
    by_session: dict[int, list] = {}
    for plan in plans:
        by_session.setdefault(plan.session_id, []).append(plan)
    multi_turn = [turns for turns in by_session.values() if len(turns) > 2]
    assert multi_turn
    for turns in multi_turn:
        for earlier, later in itertools.pairwise(turns):
            assert later.parts[: len(earlier.parts)] == earlier.parts  # a strict extension
            added = later.parts[len(earlier.parts) :]
            assert [p.kind for p in added] == ["answer", "tool", "message"]
            assert added[1].num_blocks == 2
    assert all(p.kind != "tool" for plan in plan_workload(SPEC) for p in plan.parts)  # off by default
