"""The evaluation set: every family, held-out traces, compact prefixes."""

import json

import pytest

from bench.evalset import COMPACT_BLOCKS, evaluation_set


def test_every_generated_family_has_tuning_and_held_out_traces():
    traces = evaluation_set()
    assert len({t.name for t in traces}) == len(traces)
    families = {t.family for t in traces if t.spec is not None}
    assert families == {"chat", "rag", "mixed", "agent"}
    for family in families - {"rag"}:
        held = {t.held_out for t in traces if t.family == family}
        assert held == {True, False}, family
    (synthetic,) = (t for t in traces if t.name == "mooncake-synthetic")
    assert not synthetic.held_out


def test_fresh_held_out_traces_cover_chats_agents_and_a_public_trace():
    # Picked before the second round of tuning and replayed once, at the end (docs/eviction.md).
    fresh = {t.name: t for t in evaluation_set() if t.fresh}
    assert all(t.held_out for t in fresh.values())
    assert {t.family for t in fresh.values()} == {"chat", "agent", "mooncake"}
    (public,) = (t for t in fresh.values() if t.spec is None)
    requests = public.load()
    assert len(requests) == 1000
    assert sum(len(r.hash_ids) for r in requests) == 16853


def test_compact_traces_are_prefixes_within_the_block_budget():
    for trace in evaluation_set():
        if trace.spec is None:
            continue
        full, compact = trace.load(), trace.load(compact=True)
        assert 0 < len(compact) < len(full)
        assert full[: len(compact)] == compact
        assert sum(len(r.hash_ids) for r in compact) <= COMPACT_BLOCKS


def test_the_mooncake_trace_is_the_shared_one():
    (mooncake,) = (t for t in evaluation_set() if t.name == "mooncake-synthetic")
    requests = mooncake.load()
    assert len(requests) == 3993


def test_plot_margins_are_default_minus_the_better_textbook_policy(tmp_path):
    from bench.evalset_plot import margins, save_plot

    rows = [
        {"trace": "t", "held_out": True, "policy": p, "capacity": 0.05, "prefix_hit_ratio": r}
        for p, r in (("lru", 0.30), ("arc", 0.32), ("default", 0.31))
    ]
    cells, held_out = margins(["a table line", json.dumps({"results": rows})])
    assert cells == {("t", 0.05): pytest.approx(-0.01)}
    assert held_out == {"t": True}
    save_plot(cells, held_out, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
