"""python -m bench.hitrate --workload multitenant: settings, tables, plot and the JSON line last."""

import json

import pytest

from bench.chat_cli import parse_settings
from bench.chat_sweep import Setting
from bench.hitrate import main

SMALL = [
    "--workload",
    "multitenant",
    "--num-requests",
    "150",
    "--block-tokens",
    "16",
    "--capacity",
    "0.1,0.3",
]


def _record(capsys) -> dict:
    lines = capsys.readouterr().out.strip().splitlines()
    return json.loads(lines[-1])


def test_every_setting_isolation_policy_and_capacity_is_reported(tmp_path, capsys):
    plot = tmp_path / "canon.png"
    main(
        [
            *SMALL,
            "--settings",
            "canon=off,on",
            "promotion=off,on",
            "--timestamp-share",
            "0.5",
            "--plot",
            str(plot),
        ]
    )
    record = _record(capsys)
    results = record["results"]
    assert len(results) == 4 * 2 * 2 * 2  # settings × isolations (shared, namespace) × policies × capacities
    for r in results:
        assert {"setting", "isolation", "policy", "capacity", "hit_ratio", "prefix_hit_ratio"} <= set(r)
        assert 0.0 <= r["prefix_hit_ratio"] <= r["hit_ratio"] <= 1.0
        assert r["reused_tokens"] % 16 == 0
    assert {r["setting"] for r in results} == {
        f"timestamps=0.5 canon={c} promotion={p}" for c in ("off", "on") for p in ("off", "on")
    }
    assert {r["policy"] for r in results} == {"default", "lru"}
    assert {r["isolation"] for r in results} == {"shared", "namespace"}
    # every setting gets the same memory
    assert len({(r["capacity"], r["capacity_blocks"]) for r in results}) == 2
    assert record["config"]["requests"] == 150 and record["config"]["min_tenants"] == 3
    by_key = {(r["setting"], r["isolation"], r["policy"], r["capacity"]): r for r in results}
    for (setting, isolation, policy, capacity), r in by_key.items():
        if isolation == "shared" and "promotion=on" in setting:
            twin = by_key[(setting.replace("promotion=on", "promotion=off"), isolation, policy, capacity)]
            assert r["prefix_hit_ratio"] == twin["prefix_hit_ratio"] and r["seconds"] == 0.0
    stamped = {s["setting"]: s["timestamped_requests"] for s in record["replays"]}
    assert all(n > 0 for n in stamped.values())
    assert plot.stat().st_size > 0


def test_timestamps_as_a_setting_dimension(capsys):
    main(
        [*SMALL, "--settings", "timestamps=0,0.5", "--policy", "lru", "--isolation", "namespace", "--no-plot"]
    )
    results = _record(capsys)["results"]
    assert [r["timestamp_share"] for r in results] == [0.0, 0.0, 0.5, 0.5]
    by_share = {(r["timestamp_share"], r["capacity"]): r["reused_tokens"] for r in results}
    assert by_share[(0.5, 0.3)] < by_share[(0.0, 0.3)]


def test_parse_settings_is_the_product():
    assert parse_settings(["canon=off,on", "promotion=on"], 0.3) == (
        Setting(canon="off", promotion=True, timestamp_share=0.3),
        Setting(canon="on", promotion=True, timestamp_share=0.3),
    )
    assert parse_settings([], 0.0) == (Setting(canon="off", promotion=False, timestamp_share=0.0),)


@pytest.mark.parametrize(
    "args",
    [
        ["--settings", "canon=maybe"],
        ["--settings", "promotion=yes"],
        ["--settings", "colour=red"],
        ["--settings", "timestamps=2"],
        ["--mode", "prefix,flat"],
        ["--trace", "x.jsonl"],
    ],
)
def test_bad_workload_arguments_exit(args):
    with pytest.raises(SystemExit):
        main([*SMALL, "--no-plot", *args])


def test_trace_or_workload_is_required():
    with pytest.raises(SystemExit):
        main(["--no-plot"])
