"""Operator packaging (docker/): the compose stack, the Dockerfiles, the Prometheus rules and the Grafana
dashboard refer only to things that exist.

- Metric names and labels come from the real exposition text of ``gateway/metrics.py`` (every labelled
  metric touched once) and ``worker/metrics.py`` (its collector fed the stat keys it reads, tier event names
  taken from the tier classes' ``counters[...]``); no server is started, nothing imports torch.
- Environment variables are fields of ``GatewayConfig`` / ``WorkerConfig``; files exist in the repository
  and survive ``.dockerignore``; service names, ports, volumes and mounts agree between the files.
- With ``promtool`` on PATH (or ``$PROMTOOL``), the rules, the config and the alert unit tests
  (``docker/prometheus/alerts.test.yml``) run too; without it those tests are skipped and say so.

No Docker engine is needed (none is available here): the images themselves are not built by this test.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics, TenantCounter
from worker import metrics as worker_metrics
from worker.output import SOURCES

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
PROM = DOCKER / "prometheus"
GRAFANA = DOCKER / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "prefixgate.json"
RUNBOOK = ROOT / "docs" / "operations.md"
DOCKERFILES = {
    "gateway": DOCKER / "Dockerfile.gateway",
    "worker": DOCKER / "Dockerfile.worker",
    "worker-cuda": DOCKER / "Dockerfile.worker-cuda",
}
TARGET_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series
BUILTIN_SERIES = {"up": set(), "ALERTS": {"alertname", "alertstate", "severity"}}
PROMQL_WORDS = {"and", "or", "unless", "offset", "bool", "inf", "nan", "by", "without", "on", "ignoring"}
SEVERITIES = {"critical", "warning", "info"}


# ---- what the code exports -----------------------------------------------------------------------------
def _parse_exposition(text: str) -> dict[str, set[str]]:
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def _tier_events() -> dict[str, set[str]]:
    """Event names per tier, as the tier classes count them (``counters["…_total"]``)."""
    events = {}
    for tier, path in (("l3", "worker/tiers/disk.py"), ("remote", "worker/tiers/remote.py")):
        names = re.findall(r'counters\["(\w+)_total"\]', (ROOT / path).read_text())
        assert names, f"no tier counters found in {path}"
        events[tier] = set(names)
    return events


@cache
def exported() -> tuple[dict[str, set[str]], dict[tuple[str, str], set[str]]]:
    """(series name -> label names, (series, label) -> known label values) of both /metrics endpoints."""
    gateway = GatewayMetrics()
    for value in vars(gateway).values():
        value = value.counter if isinstance(value, TenantCounter) else value  # per-tenant: the counter
        if isinstance(value, MetricWrapperBase) and value._labelnames:
            child = value.labels(*["x"] * len(value._labelnames))
            if hasattr(child, "observe"):
                child.observe(0.1)
            else:
                child.inc()
    series = _parse_exposition(gateway.render()[0].decode())

    events = _tier_events()
    tiers = {
        "hits_blocks": dict.fromkeys(SOURCES, 1),
        "gated_blocks": dict.fromkeys(SOURCES, 1),
        "bandwidth_gbps": dict.fromkeys(SOURCES, 1.0),
        **{tier: {f"{name}_total": 1 for name in names} for tier, names in events.items()},
    }
    stats = {name: 1 for name in [*worker_metrics.COUNTERS, *worker_metrics.GAUGES]} | {"tiers": tiers}
    worker_series = _parse_exposition(worker_metrics.render(lambda: stats).decode())
    assert not set(series) & set(worker_series)
    series.update(worker_series)

    values = {
        ("prefixgate_worker_tier_events_total", "event"): set().union(*events.values()),
        ("prefixgate_worker_tier_events_total", "tier"): set(events),
        ("prefixgate_purges_total", "outcome"): {"complete", "partial"},
        ("prefixgate_canonicalization_fragments_total", "action"): {"moved", "reported"},
    }
    for name in ("prefixgate_worker_tier_hit_blocks_total", "prefixgate_worker_tier_gated_blocks_total"):
        values[(name, "tier")] = set(SOURCES)
    values[("prefixgate_worker_tier_bandwidth_gbps", "tier")] = set(SOURCES)
    values[("prefixgate_cached_tokens_total", "tier")] = set(SOURCES)
    return series, values


def test_exposition_is_what_the_docs_and_a_live_worker_show() -> None:
    series, _ = exported()
    # A sample of names seen on a live worker's and gateway's /metrics (docs/operations.md, Observability).
    for name in (
        "prefixgate_requests_total",
        "prefixgate_request_duration_seconds_bucket",
        "prefixgate_usage_spool_depth",
        "prefixgate_worker_num_blocks_free",
        "prefixgate_worker_requests_aborted_total",
        "prefixgate_worker_tier_events_total",
    ):
        assert name in series
    assert series["prefixgate_cached_tokens_total"] == {"tenant", "tier"}


# ---- PromQL --------------------------------------------------------------------------------------------
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"(?<![\w:$])([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
IDENT = re.compile(r"(?<![\w.:$])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
TEMPLATE_LABEL = re.compile(r"\$labels\.(\w+)")


def series_in(expr: str) -> set[str]:
    """Series names an expression selects (functions, keywords, label names and durations excluded)."""
    text = re.sub(r'"[^"]*"', '""', expr)
    text = GROUPING.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\boffset\s+\w+", " ", text)
    return {name for name in IDENT.findall(text) if name not in PROMQL_WORDS}


def grouping_labels(expr: str) -> set[str]:
    return {
        label.strip()
        for keyword, labels in GROUPING.findall(expr)
        if keyword in ("by", "on", "group_left", "group_right")
        for label in labels.split(",")
        if label.strip()
    }


@cache
def recording_rules() -> dict[str, set[str]]:
    """Recorded series -> the labels they keep (those of their ``by`` clause)."""
    rules = {}
    for group in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                rules[rule["record"]] = grouping_labels(rule["expr"])
    return rules


@cache
def scrape_jobs() -> set[str]:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    return {job["job_name"] for job in config["scrape_configs"]}


def check_expr(expr: str, where: str) -> set[str]:
    """Assert that ``expr`` uses only exported (or recorded, or built-in) series and labels; returns the
    labels its result can carry."""
    series, values = exported()
    known = {**{name: labels | TARGET_LABELS for name, labels in series.items()}, **BUILTIN_SERIES}
    known.update({name: labels for name, labels in recording_rules().items()})
    names = series_in(expr)
    assert names, f"{where}: no series in {expr!r}"
    unknown = names - set(known)
    assert not unknown, f"{where}: unknown series {sorted(unknown)} in {expr!r}"
    for name, matchers in SELECTOR.findall(expr):
        for label, op, value in MATCHER.findall(matchers):
            assert label in known[name] | TARGET_LABELS, f"{where}: {name} has no label {label!r}"
            if label == "job" and op == "=":
                assert value in scrape_jobs(), f"{where}: no scrape job {value!r}"
            allowed = values.get((name, label))
            if allowed is None or op.startswith("!") or "$" in value:
                continue
            alternatives = value.split("|") if op == "=~" else [value]
            if all(re.fullmatch(r"\w+", alt) for alt in alternatives):
                missing = set(alternatives) - allowed
                assert not missing, f"{where}: {name}{{{label}}} is never {sorted(missing)}"
    available = set().union(*(known[name] for name in names)) | TARGET_LABELS | {"le"}
    grouped = grouping_labels(expr)
    assert grouped <= available, f"{where}: grouping by unknown labels {sorted(grouped - available)}"
    return grouped if re.search(r"\b(by|without)\s*\(", expr) else available


def test_series_extraction_ignores_functions_labels_and_durations() -> None:
    expr = (
        'sum by (instance) (rate(prefixgate_requests_total{status=~"5.."}[5m])) / '
        "(x:y:rate5m offset 15m > 0) and on (job) up"
    )
    assert series_in(expr) == {"prefixgate_requests_total", "x:y:rate5m", "up"}
    with pytest.raises(AssertionError, match="unknown series"):
        check_expr("rate(prefixgate_request_total[5m])", "typo")
    with pytest.raises(AssertionError, match="no label"):
        check_expr('prefixgate_usage_spool_depth{tenant="a"}', "label")
    with pytest.raises(AssertionError, match="is never"):
        check_expr('prefixgate_worker_tier_events_total{event="write_error"}', "value")


# ---- alert rules ---------------------------------------------------------------------------------------
@cache
def alerts() -> list[dict]:
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def runbook_headings() -> set[str]:
    return set(re.findall(r"^#+\s+(Prefixgate\w+)\s*$", RUNBOOK.read_text(), flags=re.MULTILINE))


def test_recording_rules_use_exported_metrics() -> None:
    assert recording_rules()
    for group in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                assert rule["record"].startswith("prefixgate:")
                check_expr(rule["expr"], rule["record"])


def test_alerts_use_exported_metrics_and_have_a_runbook() -> None:
    rules = alerts()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)) >= 15
    headings = runbook_headings()
    for rule in rules:
        name = rule["alert"]
        assert name.startswith("Prefixgate")
        labels = check_expr(rule["expr"], name)
        assert rule["labels"]["severity"] in SEVERITIES, name
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        assert notes["runbook_url"] == f"docs/operations.md#{name.lower()}", name
        assert name in headings, f"docs/operations.md has no runbook section '#### {name}'"
        used = set(TEMPLATE_LABEL.findall(notes["summary"] + notes["description"]))
        assert used <= labels, f"{name}: annotations use labels {sorted(used - labels)} the alert lacks"
    stale = headings - set(names)
    assert not stale, f"runbook sections for alerts that do not exist: {sorted(stale)}"


def test_operator_alerts_are_covered() -> None:
    """The situations an operator must hear about each have an alert on the right metric."""
    by_metric = {
        "up": ("PrefixgateWorkerDown", "PrefixgateGatewayDown"),
        "prefixgate_workers_healthy": ("PrefixgateNoHealthyWorkers",),
        "prefixgate_requests_total": ("PrefixgateHigh5xxRate",),
        "prefixgate_usage_spool_depth": ("PrefixgateUsageSpoolGrowing", "PrefixgateUsageSpoolStuck"),
        "prefixgate:cache_hit_ratio:rate5m": ("PrefixgateCacheHitRateCollapse",),
        "prefixgate_worker_tier_events_total": (
            "PrefixgateDiskTierRefusingWrites",
            "PrefixgateDiskTierWriteErrors",
            "PrefixgateTierCorruptEntries",
            "PrefixgateRemoteTierErrors",
        ),
        "prefixgate_worker_engine_errors_total": ("PrefixgateWorkerEngineErrors",),
        "prefixgate_worker_preemptions_total": ("PrefixgatePreemptionStorm",),
        "prefixgate_request_duration_seconds_bucket": ("PrefixgateHighP99Latency",),
    }
    exprs = {rule["alert"]: rule["expr"] for rule in alerts()}
    for metric, names in by_metric.items():
        for name in names:
            assert metric in series_in(exprs[name]), (name, metric)


# ---- Grafana -------------------------------------------------------------------------------------------
def test_dashboard_queries_use_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids, cells, count = set(), {}, 0
    for panel in dashboard["panels"]:
        assert panel["id"] not in ids
        ids.add(panel["id"])
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
        for target in panel.get("targets", []):
            labels = check_expr(target["expr"], panel["title"])
            legend = set(LEGEND_LABEL.findall(target.get("legendFormat", "")))
            assert legend <= labels, f"{panel['title']}: legend uses {sorted(legend - labels)}"
            count += 1
    assert count >= 30
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    assert {"datasource", "tenant", "worker"} <= set(variables)
    for name in ("tenant", "worker"):
        metric, label = re.fullmatch(
            r"label_values\((\w+),\s*(\w+)\)", variables[name]["definition"]
        ).groups()
        assert label in exported()[0][metric] | TARGET_LABELS
    text = DASHBOARD.read_text()
    for metric in (
        "prefixgate_requests_total",
        "prefixgate_request_duration_seconds_bucket",
        "prefixgate_cached_tokens_total",
        "prefixgate_worker_num_blocks_free",
        "prefixgate_worker_num_blocks_cached",
        "prefixgate_worker_num_blocks_in_use",
        "prefixgate_worker_tier_bandwidth_gbps",
        "prefixgate_worker_evictions_total",
        "prefixgate_usage_spool_depth",
        "prefixgate_hot_prefix_promotions_total",
        "prefixgate_canonicalization_fragments_total",
    ):
        assert metric in text, metric


def test_grafana_provisioning_matches_compose() -> None:
    compose = load_compose()
    mounts = bind_mounts(compose["services"]["grafana"])
    datasource = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    [source] = datasource["datasources"]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    dashboard = json.loads(DASHBOARD.read_text())
    variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "datasource")
    assert variable["current"]["value"] == source["uid"]
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/prefixgate.yml").read_text())["providers"]
    [provider] = providers
    assert mounts[provider["options"]["path"]] == GRAFANA / "dashboards"
    assert mounts["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert mounts[str(Path(home).parent)] / Path(home).name == DASHBOARD


# ---- compose -------------------------------------------------------------------------------------------
@cache
def load_compose(name: str = "compose.yaml") -> dict:
    return yaml.safe_load((DOCKER / name).read_text())


def bind_mounts(service: dict) -> dict[str, Path]:
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[target] = (DOCKER / source).resolve()
    return mounts


def env_value(raw: str) -> str:
    """A compose value with ``${VAR:-default}`` / ``${VAR:?msg}`` resolved to its default ('' if none)."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*)|:\?[^}]*)?\}", lambda m: m.group(2) or "", str(raw))


@cache
def worker_fields() -> set[str]:
    """WorkerConfig's fields, read with ast: importing worker.config imports torch."""
    tree = ast.parse((ROOT / "worker/config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WorkerConfig")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


def gateway_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(GatewayConfig)}


def check_env(env: dict[str, str], where: str, *, worker: bool) -> None:
    """Every PREFIXGATE_* variable is a setting the service reads (a worker reads PREFIXGATE_WORKER_<FIELD>,
    the gateway PREFIXGATE_<FIELD>, where PREFIXGATE_WORKER_URLS is its worker_urls)."""
    for key in env:
        if not key.startswith("PREFIXGATE_"):
            continue
        if worker:
            assert key.startswith("PREFIXGATE_WORKER_"), f"{where}: {key} is not a worker variable"
            field = key.removeprefix("PREFIXGATE_WORKER_").lower()
            assert field in worker_fields(), f"{where}: {key} is not a worker setting"
        else:
            field = key.removeprefix("PREFIXGATE_").lower()
            assert field in gateway_fields(), f"{where}: {key} is not a gateway setting"


def is_worker(service: dict) -> bool:
    return "Dockerfile.worker" in service.get("build", {}).get("dockerfile", "")


def dockerfile_env(path: Path) -> dict[str, str]:
    text = path.read_text().replace("\\\n", " ")
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(re.findall(r"(\w+)=(\S+)", line))
    return env


def service_port(compose: dict, name: str) -> int:
    service = compose["services"][name]
    dockerfile = ROOT / service["build"]["dockerfile"]
    env = dockerfile_env(dockerfile) | {k: env_value(v) for k, v in service.get("environment", {}).items()}
    key = "PREFIXGATE_WORKER_PORT" if "PREFIXGATE_WORKER_HOST" in env else "PREFIXGATE_PORT"
    return int(env[key])


def test_compose_is_consistent() -> None:
    compose = load_compose()
    services = compose["services"]
    assert {"postgres", "redis", "migrate", "gateway", "prometheus", "grafana"} <= set(services)
    workers = sorted(name for name in services if name.startswith("worker"))
    assert len(workers) >= 1
    for name, service in services.items():
        if "build" in service:
            context = (DOCKER / service["build"]["context"]).resolve()
            assert context == ROOT
            assert (context / service["build"]["dockerfile"]).is_file(), name
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in compose["volumes"], f"{name}: volume {source} not declared"
        for network in service.get("networks", []):
            assert network in compose["networks"]
        check_env(service.get("environment", {}), name, worker=is_worker(service))

    gateway = {k: env_value(v) for k, v in services["gateway"]["environment"].items()}
    urls = gateway["PREFIXGATE_WORKER_URLS"].split(",")
    assert [re.fullmatch(r"http://([\w-]+):(\d+)", url).group(1) for url in urls] == workers
    for url in urls:
        host, port = re.fullmatch(r"http://([\w-]+):(\d+)", url).groups()
        assert int(port) == service_port(compose, host)
    assert gateway["PREFIXGATE_DATABASE_URL"].startswith("postgresql+asyncpg://")
    assert "@postgres:5432/" in gateway["PREFIXGATE_DATABASE_URL"]
    assert gateway["PREFIXGATE_REDIS_URL"].startswith("redis://redis:6379/")
    assert services["migrate"]["command"] == ["prefixgate", "db", "upgrade"]
    assert (
        env_value(services["migrate"]["environment"]["PREFIXGATE_DATABASE_URL"])
        == (gateway["PREFIXGATE_DATABASE_URL"])
    )
    assert services["gateway"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    # Workers share Redis as their remote tier, each with its own data volume.
    data_volumes = set()
    for name in workers:
        env = {k: env_value(v) for k, v in services[name]["environment"].items()}
        assert env["PREFIXGATE_WORKER_REMOTE_URL"].startswith("redis://redis:6379/")
        assert env["PREFIXGATE_WORKER_REMOTE_URL"] != gateway["PREFIXGATE_REDIS_URL"]
        [volume] = [v for v in services[name]["volumes"] if v.endswith(":/data")]
        data_volumes.add(volume)
    assert len(data_volumes) == len(workers)
    # The worker API must not be published.
    for name in [*workers, "postgres", "redis"]:
        assert "ports" not in services[name], name
    assert compose["networks"]["backend"]["internal"] is True


def test_compose_secrets_are_documented_in_env_example() -> None:
    text = (DOCKER / "compose.yaml").read_text()
    required = set(re.findall(r"\$\{(\w+):\?", text))
    assert {"PREFIXGATE_ADMIN_TOKEN", "POSTGRES_PASSWORD"} <= required
    example = dict(re.findall(r"^(\w+)=(.*)$", (DOCKER / ".env.example").read_text(), flags=re.MULTILINE))
    assert required <= set(example)
    assert ".env" in (DOCKER / ".gitignore").read_text().split()


def test_gpu_override_only_changes_existing_workers() -> None:
    base, gpu = load_compose(), load_compose("compose.gpu.yaml")
    for name, service in gpu["services"].items():
        assert name in base["services"] and name.startswith("worker")
        assert (ROOT / service["build"]["dockerfile"]).name == "Dockerfile.worker-cuda"
        check_env(service["environment"], f"compose.gpu.yaml {name}", worker=True)
        assert service["environment"]["PREFIXGATE_WORKER_DEVICE"] == "cuda"


def test_prometheus_scrapes_the_compose_services_and_loads_the_rules() -> None:
    compose = load_compose()
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    mounts = bind_mounts(compose["services"]["prometheus"])
    assert mounts["/etc/prometheus/prometheus.yml"] == PROM / "prometheus.yml"
    for rule_file in config["rule_files"]:
        assert (PROM / rule_file).is_file()
        assert mounts[f"/etc/prometheus/{rule_file}"] == PROM / rule_file
    targets = {
        job["job_name"]: [t for static in job["static_configs"] for t in static["targets"]]
        for job in config["scrape_configs"]
    }
    assert {"prefixgate-gateway", "prefixgate-worker"} <= set(targets)
    workers = sorted(name for name in compose["services"] if name.startswith("worker"))
    assert sorted(t.split(":")[0] for t in targets["prefixgate-worker"]) == workers
    for job in ("prefixgate-gateway", "prefixgate-worker"):
        for target in targets[job]:
            host, port = target.split(":")
            assert int(port) == service_port(compose, host), target


# ---- Dockerfiles ---------------------------------------------------------------------------------------
def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_the_sources_and_drops_local_state() -> None:
    for kept in ("pyproject.toml", "gateway/app.py", "worker/builtin/model.safetensors", "migrations/env.py"):
        assert not dockerignore_excludes(kept), kept
    for dropped in (".venv/bin/python", ".git/HEAD", "data/prefixgate.db", "bench/out/x.json", "tests/a.py"):
        assert dockerignore_excludes(dropped), dropped
    assert dockerignore_excludes("gateway/__pycache__/app.cpython-311.pyc")
    assert dockerignore_excludes("docker/compose.yaml")
    assert not dockerignore_excludes("docker/healthcheck.py")  # the one docker/ file the images COPY


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile(kind: str) -> None:
    path = DOCKERFILES[kind]
    text = path.read_text()
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        if line.startswith(("COPY ", "ADD ")) and "--from" not in line:
            *sources, _ = [word for word in line.split()[1:] if not word.startswith("--")]
            for source in sources:
                assert (ROOT / source).exists(), f"{path.name}: {source} does not exist"
                assert not dockerignore_excludes(source.rstrip("/")), (
                    f"{path.name}: {source} is dockerignored"
                )
    env = dockerfile_env(path)
    check_env(env, path.name, worker=kind != "gateway")
    users = re.findall(r"^USER (\S+)", text, flags=re.MULTILINE)
    assert users and users[-1] not in ("root", "0"), f"{path.name} must run as a non-root user"
    assert re.search(r'^VOLUME \["/data"\]', text, flags=re.MULTILINE)
    port_var = "PREFIXGATE_PORT" if kind == "gateway" else "PREFIXGATE_WORKER_PORT"
    port = env[port_var]
    assert re.search(rf"^EXPOSE {port}$", text, flags=re.MULTILINE)
    healthcheck = re.search(r"^HEALTHCHECK .*CMD (\[.*\])$", joined, flags=re.MULTILINE)
    assert healthcheck, f"{path.name} has no HEALTHCHECK"
    assert json.loads(healthcheck.group(1)) == ["prefixgate-healthcheck", port_var, port]
    cmd = json.loads(re.findall(r"^CMD (\[.*\])$", text, flags=re.MULTILINE)[-1])
    assert cmd == ["prefixgate", "gateway" if kind == "gateway" else "worker"]
    assert "pip install" in text and "torch==${TORCH_VERSION}" in text
    data_dir = "PREFIXGATE_DATA_DIR" if kind == "gateway" else "PREFIXGATE_WORKER_DATA_DIR"
    assert env[data_dir] == "/data"
    assert env["PREFIXGATE_HOST" if kind == "gateway" else "PREFIXGATE_WORKER_HOST"] == "0.0.0.0"


def test_healthcheck_probe() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connection refused
        probe = [sys.executable, str(DOCKER / "healthcheck.py")]
        env = {**os.environ, "PROBE_PORT": str(port)}
        result = subprocess.run([*probe, "PROBE_PORT", "1"], env=env, capture_output=True, timeout=20)
    assert result.returncode == 1
    assert subprocess.run(probe, capture_output=True, timeout=20).returncode == 2


# ---- promtool (optional) -------------------------------------------------------------------------------
def promtool() -> str:
    tool = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not tool:
        pytest.skip("promtool not found (set $PROMTOOL or put it on PATH; Debian: package prometheus)")
    return tool


def run_promtool(*args: str, cwd: Path = PROM) -> None:
    result = subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_checks_rules_and_config() -> None:
    run_promtool("check", "rules", "alerts.yml")
    # --syntax-only: the bearer-token files it names exist only inside the compose stack (configs).
    run_promtool("check", "config", "--syntax-only", "prometheus.yml")


def test_promtool_alert_unit_tests() -> None:
    run_promtool("test", "rules", "alerts.test.yml")


def test_promtool_parses_dashboard_queries(tmp_path: Path) -> None:
    tool = promtool()
    dashboard = json.loads(DASHBOARD.read_text())
    rules = [
        {
            "record": f"dashboard:panel_{panel['id']}_{target['refId']}",
            "expr": target["expr"]
            .replace("$__rate_interval", "5m")
            .replace("$tenant", ".*")
            .replace("$worker", ".*"),
        }
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]
    (tmp_path / "dashboard_rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": rules}]}))
    result = subprocess.run(
        [tool, "check", "rules", "dashboard_rules.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
