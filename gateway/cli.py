"""`prefixgate` command line: up, gateway, worker, db upgrade, tenant …, hot-prefixes …, report …, lint,
workers, diagnose.

The admin commands talk to a running gateway's admin API (``--url`` / ``$PREFIXGATE_URL``, token from
``--admin-token`` / ``$PREFIXGATE_ADMIN_TOKEN`` / the data dir's ``admin_token`` file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gateway.admin_client import AdminClient, AdminError
from gateway.cli_reports import request_export, usage_report

POLICY_OPTIONS = {
    # option -> (field, type)
    "--isolation": ("isolation", str),
    "--reserved-blocks": ("reserved_blocks", int),
    "--canonicalization": ("canonicalization", str),
    "--canonicalization-note-role": ("canonicalization_note_role", str),
    "--price-input-per-mtok": ("price_input_per_mtok", float),
    "--price-cached-input-per-mtok": ("price_cached_input_per_mtok", float),
    "--price-output-per-mtok": ("price_output_per_mtok", float),
    "--max-tokens-limit": ("max_tokens_limit", int),
    "--rate-limit-rpm": ("rate_limit_rpm", int),
    "--rate-limit-tpm": ("rate_limit_tpm", int),
    "--max-concurrent-requests": ("max_concurrent_requests", int),
}


def _add_policy_options(parser: argparse.ArgumentParser) -> None:
    for option, (field, kind) in POLICY_OPTIONS.items():
        parser.add_argument(option, dest=field, type=kind, default=None)
    parser.add_argument(
        "--share-hot-prefixes", dest="share_hot_prefixes", action=argparse.BooleanOptionalAction, default=None
    )
    parser.add_argument(
        "--canonicalization-pattern",
        dest="canonicalization_patterns",
        action="append",
        default=None,
        metavar="NAME=REGEX",
        help="tenant fragment pattern (repeatable; replaces the tenant's list; NAME= alone clears it)",
    )
    parser.add_argument(
        "--canonicalization-disable",
        dest="canonicalization_disabled_rules",
        action="append",
        default=None,
        metavar="RULE",
        help="built-in fragment rule to turn off (repeatable; replaces the tenant's list; '' clears it)",
    )


def _policy_body(args: argparse.Namespace) -> dict[str, Any]:
    fields = [field for field, _ in POLICY_OPTIONS.values()] + ["share_hot_prefixes"]
    body = {field: getattr(args, field) for field in fields if getattr(args, field) is not None}
    if args.canonicalization_patterns is not None:
        pairs = [item.partition("=") for item in args.canonicalization_patterns]
        body["canonicalization_patterns"] = {name: regex for name, _, regex in pairs if regex}
    if args.canonicalization_disabled_rules is not None:
        body["canonicalization_disabled_rules"] = [
            rule for rule in args.canonicalization_disabled_rules if rule
        ]
    return body


def _server_options(parser: argparse.ArgumentParser, *, port: int = 8080) -> None:
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None, help=f"default {port}")
    parser.add_argument("--data-dir", default=None, help="default ./data")
    parser.add_argument("--config", default=None, help="TOML config file (default $PREFIXGATE_CONFIG)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="embedded default: migrations, one bundled worker, gateway, demo tenant")
    _server_options(up)
    up.add_argument("--model", default="builtin", help="worker model: builtin, random-tiny or a directory")
    up.add_argument("--worker-port", type=int, default=None, help="default: a free port")

    gw = sub.add_parser("gateway", help="run the gateway against running workers")
    _server_options(gw)
    gw.add_argument(
        "--worker-url",
        action="append",
        dest="worker_urls",
        default=None,
        help="worker base URL (repeatable; default $PREFIXGATE_WORKER_URLS)",
    )
    gw.add_argument(
        "--openai-upstream",
        action="append",
        dest="openai_upstreams",
        default=None,
        metavar="JSON",
        help='external OpenAI-compatible upstream, e.g. \'{"url": "http://vllm:8000/v1", "models": ["m"], '
        '"flavour": "vllm"}\' (repeatable; default $PREFIXGATE_OPENAI_UPSTREAMS; docs/upstreams.md)',
    )
    gw.add_argument("--database-url", default=None)

    sub.add_parser("worker", help="run the bundled worker (python -m worker …)", add_help=False)

    db = sub.add_parser("db", help="database commands")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_sub.add_parser("upgrade", help="run the migrations to the latest revision")
    upgrade.add_argument("--database-url", default=None)
    upgrade.add_argument("--data-dir", default=None)
    upgrade.add_argument("--config", default=None)

    admin_parent = argparse.ArgumentParser(add_help=False)
    admin_parent.add_argument("--url", default=None, help="gateway URL (default $PREFIXGATE_URL or :8080)")
    admin_parent.add_argument("--admin-token", default=None)
    admin_parent.add_argument("--data-dir", default=None, help="where to find admin_token")

    tenant_ref = argparse.ArgumentParser(add_help=False)  # commands that name a tenant by id or name
    tenant_ref.add_argument(
        "--id",
        dest="tenant_is_id",
        action="store_true",
        help="the tenant is given by its id (needed when another tenant is named like that id)",
    )

    tenant = sub.add_parser("tenant", help="manage tenants through the admin API")
    t_sub = tenant.add_subparsers(dest="tenant_command", required=True)
    create = t_sub.add_parser("create", parents=[admin_parent])
    create.add_argument("name")
    _add_policy_options(create)
    t_sub.add_parser("list", parents=[admin_parent])
    for name in ("get", "delete", "invalidate", "purge", "keys", "add-key", "rotate-key"):
        t_sub.add_parser(name, parents=[admin_parent, tenant_ref]).add_argument(
            "tenant", help="tenant id or name"
        )
    update = t_sub.add_parser("update", parents=[admin_parent, tenant_ref])
    update.add_argument("tenant", help="tenant id or name")
    update.add_argument("--name", dest="new_name", default=None)
    _add_policy_options(update)
    revoke = t_sub.add_parser("revoke-key", parents=[admin_parent, tenant_ref])
    revoke.add_argument("tenant", help="tenant id or name")
    revoke.add_argument("key_id")
    audit = t_sub.add_parser("audit", parents=[admin_parent, tenant_ref])
    audit.add_argument("--tenant", default=None)
    audit.add_argument("--limit", type=int, default=None)

    hot = sub.add_parser("hot-prefixes", help="promoted hot prefixes through the admin API")
    h_sub = hot.add_subparsers(dest="hot_command", required=True)
    h_list = h_sub.add_parser("list", parents=[admin_parent])
    h_list.add_argument("--all", action="store_true", help="include revoked promotions")
    for name in ("show", "revoke"):
        h_sub.add_parser(name, parents=[admin_parent]).add_argument("hot_prefix_id")

    lint = sub.add_parser("lint", help="POST a chat request to /v1/prompt-lint (tenant key)")
    lint.add_argument("request", help="JSON file of a chat completion request ('-': stdin)")
    lint.add_argument("--url", default=None, help="gateway URL (default $PREFIXGATE_URL or :8080)")
    lint.add_argument("--api-key", default=None, help="tenant API key (default $PREFIXGATE_API_KEY)")
    lint.add_argument("--model", default=None, help="set or override the request's model")

    report = sub.add_parser("report", help="usage reports through the admin API")
    r_sub = report.add_subparsers(dest="report_command", required=True)
    usage = r_sub.add_parser("usage", parents=[admin_parent, tenant_ref])
    usage.add_argument("--tenant", default=None, help="tenant id or name")
    usage.add_argument("--start", default=None)
    usage.add_argument("--end", default=None)
    usage.add_argument("--granularity", choices=["hour", "day"], default="day")
    usage.add_argument("--format", choices=["json", "csv"], default="json")
    usage.add_argument("--by-end-user", action="store_true", help="one row per end user (`user` field)")
    usage.add_argument("--cursor", default=None, help="one page, after the next_cursor of the previous one")
    usage.add_argument("--limit", type=int, default=None, help="rows per page (default: the gateway's)")
    requests = r_sub.add_parser(
        "requests",
        parents=[admin_parent, tenant_ref],
        help="per-request export (JSON: one page; CSV: every page)",
    )
    requests.add_argument("--tenant", default=None, help="tenant id or name")
    requests.add_argument("--start", default=None)
    requests.add_argument("--end", default=None)
    requests.add_argument("--cursor", default=None, help="start after the next_cursor of a previous page")
    requests.add_argument("--limit", type=int, default=1000, help="records per page")
    requests.add_argument("--format", choices=["json", "csv"], default="json")
    rejected = r_sub.add_parser("rejected", parents=[admin_parent], help="usage records the database refused")
    rejected.add_argument("--retry", action="store_true", help="try them again now")

    sub.add_parser("workers", parents=[admin_parent], help="worker pool health")
    sub.add_parser("diagnose", parents=[admin_parent], help="check the gateway, its database and workers")
    return parser


def _gateway_url(args: argparse.Namespace) -> str:
    url = args.url or os.environ.get("PREFIXGATE_URL") or "http://127.0.0.1:8080"
    if urllib.parse.urlsplit(url).scheme not in ("http", "https") or "://" not in url:
        raise ValueError(f"bad gateway URL {url!r}: expected http://HOST:PORT or https://HOST")
    return url


def _admin_client(args: argparse.Namespace) -> AdminClient:
    url = _gateway_url(args)
    token = args.admin_token or os.environ.get("PREFIXGATE_ADMIN_TOKEN")
    if not token:
        token_file = Path(args.data_dir or os.environ.get("PREFIXGATE_DATA_DIR") or "data") / "admin_token"
        if token_file.exists():
            token = token_file.read_text().strip()
    if not token:
        raise AdminError(0, "no admin token: pass --admin-token or set PREFIXGATE_ADMIN_TOKEN")
    return AdminClient(url, token)


def _quote(ref: str) -> str:
    """An id as one URL path segment (an id holding "/" or "?" must not name another resource)."""
    return urllib.parse.quote(ref, safe="")


def _tenant_command(client: AdminClient, args: argparse.Namespace) -> Any:
    command = args.tenant_command
    if command == "create":
        return client.request("POST", "/tenants", {"name": args.name, **_policy_body(args)})
    if command == "list":
        return client.request("GET", "/tenants")
    if command == "audit":
        tenant_id = client.resolve_tenant(args.tenant, is_id=args.tenant_is_id) if args.tenant else None
        return client.request("GET", "/audit", query={"tenant_id": tenant_id, "limit": args.limit})
    tenant_id = client.resolve_tenant(args.tenant, is_id=args.tenant_is_id)
    path = f"/tenants/{_quote(tenant_id)}"
    if command == "update":
        body = _policy_body(args) | ({"name": args.new_name} if args.new_name else {})
        return client.request("PATCH", path, body)
    simple = {
        "get": ("GET", path),
        "delete": ("DELETE", path),
        "invalidate": ("POST", path + "/invalidate"),
        "purge": ("POST", path + "/purge"),
        "keys": ("GET", path + "/keys"),
        "add-key": ("POST", path + "/keys"),
        "rotate-key": ("POST", path + "/keys/rotate"),
    }
    if command in simple:
        return client.request(*simple[command])
    return client.request("POST", f"{path}/keys/{_quote(args.key_id)}/revoke")


def _hot_prefix_command(client: AdminClient, args: argparse.Namespace) -> Any:
    if args.hot_command == "list":
        return client.request("GET", "/hot-prefixes", query={"include_revoked": "true" if args.all else None})
    path = f"/hot-prefixes/{_quote(args.hot_prefix_id)}"
    return client.request("DELETE" if args.hot_command == "revoke" else "GET", path)


def _report_command(client: AdminClient, args: argparse.Namespace) -> Any:
    if args.report_command == "rejected":
        if args.retry:
            return client.request("POST", "/usage/rejected/retry")
        return client.request("GET", "/usage/rejected")
    tenant_id = client.resolve_tenant(args.tenant, is_id=args.tenant_is_id) if args.tenant else None
    query = {"tenant_id": tenant_id, "start": args.start, "end": args.end, "format": args.format}
    if args.report_command == "requests":
        return request_export(client, query, args.cursor, args.limit, args.format)
    group_by = "end_user" if args.by_end_user else "key"
    query = {**query, "granularity": args.granularity, "group_by": group_by, "format": "json"}
    return usage_report(client, query, args.cursor, args.limit, args.format)


def _lint(args: argparse.Namespace) -> Any:
    """Lint with a tenant key (not the admin token): the answer holds that tenant's prompt text."""
    raw = sys.stdin.read() if args.request == "-" else Path(args.request).read_text()
    body = json.loads(raw)
    if args.model:
        body["model"] = args.model
    api_key = args.api_key or os.environ.get("PREFIXGATE_API_KEY")
    if not api_key:
        raise AdminError(0, "no tenant key: pass --api-key or set PREFIXGATE_API_KEY")
    url = _gateway_url(args)
    return AdminClient(url, api_key, timeout_s=60).call("POST", "/v1/prompt-lint", body)


def _diagnose(client: AdminClient) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(client.base_url + "/healthz", timeout=5) as response:
            health = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        health = json.loads(exc.read() or b"{}")
    return {
        "healthz": health,
        "workers": client.request("GET", "/workers")["data"],
        "tenants": len(client.request("GET", "/tenants")["data"]),
    }


def _print(result: Any) -> None:
    if isinstance(result, Iterator):  # text written as it comes (a CSV export, page after page)
        for chunk in result:
            print(chunk, end="", flush=True)
        return
    print(
        result if isinstance(result, str) else json.dumps(result, indent=2),
        end="" if isinstance(result, str) else "\n",
    )


def _server_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "host": args.host,
        "port": args.port,
        "data_dir": args.data_dir,
        "worker_urls": getattr(args, "worker_urls", None),
        "openai_upstreams": getattr(args, "openai_upstreams", None),
        "database_url": getattr(args, "database_url", None),
    }


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["worker"]:
        # The worker runs in its own process (it imports torch; the gateway never does).
        os.execvp(sys.executable, [sys.executable, "-m", "worker", *args_list[1:]])
    args = build_parser().parse_args(args_list)
    from gateway.config import load_config

    try:
        if args.command == "up":
            from gateway.up import run_up

            config = load_config(config_file=args.config, overrides=_server_overrides(args))
            return run_up(config, model=args.model, worker_port=args.worker_port)
        if args.command == "gateway":
            from gateway.up import run_gateway

            return run_gateway(load_config(config_file=args.config, overrides=_server_overrides(args)))
        if args.command == "db":
            from migrations import upgrade_database

            config = load_config(
                config_file=args.config,
                overrides={"data_dir": args.data_dir, "database_url": args.database_url},
            )
            config.data_dir.mkdir(parents=True, exist_ok=True)
            _upgrade(upgrade_database, config.resolved_database_url)
            print("database is at the latest revision")
            return 0
        if args.command == "lint":
            _print(_lint(args))
            return 0
        client = _admin_client(args)
        if args.command == "hot-prefixes":
            _print(_hot_prefix_command(client, args))
        elif args.command == "tenant":
            _print(_tenant_command(client, args))
        elif args.command == "report":
            _print(_report_command(client, args))
        elif args.command == "workers":
            _print(client.request("GET", "/workers"))
        elif args.command == "diagnose":
            _print(_diagnose(client))
        return 0
    except AdminError as exc:
        if isinstance(exc.body, dict) and set(exc.body) - {"error"}:
            _print(exc.body)  # e.g. a partial purge: what each worker answered
        print(f"prefixgate: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # a missing file, bad JSON/TOML, a bad URL: one line, no traceback
        print(f"prefixgate: {_one_line(exc)}", file=sys.stderr)
        return 2


def _upgrade(upgrade_database: Any, database_url: str) -> None:
    """``upgrade_database`` with SQLAlchemy's refusal of a URL (an unknown dialect…) as a ValueError."""
    from sqlalchemy.exc import ArgumentError

    try:
        upgrade_database(database_url)
    except ArgumentError as exc:
        raise ValueError(f"bad --database-url: {exc}") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    return text


if __name__ == "__main__":
    raise SystemExit(main())
