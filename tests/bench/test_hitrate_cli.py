"""python -m bench.hitrate end to end: table, plot, and the JSON line last."""

import json

import pytest

from bench.hitrate import main
from bench.trace import write_trace
from bench.workloads import WorkloadSpec, generate_workload


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "small.jsonl"
    write_trace(path, generate_workload(WorkloadSpec(num_requests=300, seed=2)))
    return path


def _results(capsys) -> list[dict]:
    lines = capsys.readouterr().out.strip().splitlines()
    return json.loads(lines[-1])["results"]


def test_sweep_reports_every_combination(trace, tmp_path, capsys):
    plot = tmp_path / "hitrate.png"
    main(
        [
            *("--trace", str(trace), "--capacity", "0.05,0.1", "--plot", str(plot)),
            *(
                "--policy",
                "lru,adaptive,default,belady",
                "--isolation",
                "shared,namespace",
                "--mode",
                "prefix,flat",
            ),
        ]
    )
    results = _results(capsys)
    assert len(results) == 2 * 4 * 2 * 2
    assert {r["trace"] for r in results} == {"small.jsonl"}
    assert {r["capacity"] for r in results} == {0.05, 0.1}
    for r in results:
        assert 0.0 <= r["prefix_hit_ratio"] <= r["hit_ratio"] <= 1.0
    by_key = {(r["policy"], r["capacity"], r["isolation"], r["mode"]): r for r in results}
    for (policy, capacity, isolation, mode), r in by_key.items():
        best = by_key[("belady", capacity, isolation, mode)]
        assert r["prefix_hit_ratio"] <= best["prefix_hit_ratio"]
        if policy == "default":
            twin = by_key[("adaptive", capacity, isolation, mode)]  # the default, reused
            assert (r["hit_ratio"], r["prefix_hit_ratio"]) == (twin["hit_ratio"], twin["prefix_hit_ratio"])
    assert plot.stat().st_size > 0


def test_sizes_in_blocks(trace, capsys):
    main(["--trace", str(trace), "--capacity-blocks", "40,80", "--policy", "lru", "--no-plot", "--quick"])
    results = _results(capsys)
    assert [r["capacity_blocks"] for r in results] == [40, 80]
    assert all(0 < r["capacity"] < 1 for r in results)


@pytest.mark.parametrize(
    "args",
    [
        ["--policy", "mru"],
        ["--isolation", "private"],
        ["--mode", "tree"],
        ["--capacity", "0.1", "--capacity-blocks", "10"],
    ],
)
def test_bad_arguments_exit(trace, args):
    with pytest.raises(SystemExit):
        main(["--trace", str(trace), "--no-plot", *args])
