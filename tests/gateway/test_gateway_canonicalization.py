"""Canonicalization end to end: the real gateway, a real worker, cached_tokens as the worker counts them."""

import copy
import json
import uuid

from tests.gateway.conftest import ADMIN, ADMIN_TOKEN, create_tenant
from tests.gateway.test_gateway_admin_api import run_cli
from tests.gateway.test_gateway_e2e import MODEL, auth, cached, chat_body

HEADER = "x-prefixgate-canonicalized"


def unique_word() -> str:
    """Letters only: a hex tag would itself be a dynamic fragment (rule hex_id)."""
    return "".join(chr(ord("a") + int(c, 16)) for c in uuid.uuid4().hex)


def system_with(value: str) -> str:
    """A long system prompt (about 1,700 tokens) with ``value`` embedded near its start."""
    rules = " ".join(f"Rule {i}: answer politely and check the order number twice." for i in range(30))
    return f"[{unique_word()}] You are the assistant of Example Corp. Current time: {value}. {rules}"


async def post_chat(gateway, key: str, body: dict) -> tuple[dict, str | None]:
    response = await gateway.post("/v1/chat/completions", json=body, headers=auth(key))
    assert response.status == 200, await response.text()
    return await response.json(), response.headers.get(HEADER)


async def two_timestamps(gateway, mode: str) -> tuple[dict, str | None]:
    key = (await create_tenant(gateway, name=f"ts-{mode}", canonicalization=mode))["api_key"]
    template = system_with("{now}")
    _, first_header = await post_chat(gateway, key, chat_body(template.format(now="2026-11-29T14:03:22Z")))
    assert first_header == ("1" if mode == "on" else "0")
    return await post_chat(gateway, key, chat_body(template.format(now="2026-11-29T14:05:47Z")))


async def test_timestamp_in_system_prompt_on_reuses_nearly_everything(gateway):
    second, header = await two_timestamps(gateway, "on")
    assert header == "1"
    prompt_tokens = second["usage"]["prompt_tokens"]
    assert prompt_tokens > 800
    assert cached(second) >= 0.9 * prompt_tokens


async def test_timestamp_in_system_prompt_off_and_report_reuse_almost_nothing(gateway):
    for mode in ("off", "report"):
        second, header = await two_timestamps(gateway, mode)
        assert header == "0"
        assert cached(second) <= 0.1 * second["usage"]["prompt_tokens"], mode


def tool(name: str, description: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "city name"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                    "days": {"type": "integer", "minimum": 1},
                },
                "required": ["city", "unit"],
            },
        },
    }


def reordered(value):
    """The same JSON with every object's keys and the `required` lists in reverse order."""
    if isinstance(value, dict):
        out = {key: reordered(value[key]) for key in reversed(list(value))}
        if isinstance(out.get("required"), list):
            out["required"] = list(reversed(out["required"]))
        return out
    if isinstance(value, list):
        return [reordered(item) for item in value]
    return value


async def test_same_tools_in_another_key_and_list_order_reuse_the_prefix(gateway):
    tag = unique_word()
    tools = [tool(f"get_weather_{tag}", "Weather forecast. " * 8), tool(f"search_{tag}", "Web search. " * 8)]
    shuffled = list(reversed(reordered(copy.deepcopy(tools))))
    assert shuffled != tools
    results = {}
    for mode in ("on", "off"):
        key = (await create_tenant(gateway, name=f"tools-{mode}", canonicalization=mode))["api_key"]
        await post_chat(gateway, key, chat_body("You are helpful.", tools=tools))
        results[mode], _ = await post_chat(gateway, key, chat_body("You are helpful.", tools=shuffled))
    prompt_tokens = results["on"]["usage"]["prompt_tokens"]
    assert cached(results["on"]) >= prompt_tokens - 32  # everything up to the last, partial block
    assert cached(results["off"]) < 64  # the tools JSON differs from its first keys on


async def test_whitespace_is_normalized_in_on_mode(gateway):
    key = (await create_tenant(gateway, name="ws", canonicalization="on"))["api_key"]
    system = system_with("noon")
    await post_chat(gateway, key, chat_body(system.replace(". ", ".  \r\n")))
    second, header = await post_chat(gateway, key, chat_body(system.replace(". ", ".\n")))
    assert header == "0"  # whitespace is normalized, not moved
    assert cached(second) >= second["usage"]["prompt_tokens"] - 32


async def test_tenant_pattern_moves_its_own_ids(gateway):
    created = await create_tenant(gateway, name="pat", canonicalization="on")
    path = f"/admin/v1/tenants/{created['id']}"
    bad = await gateway.patch(path, json={"canonicalization_patterns": {"order": r"ORD-\d+"}}, headers=ADMIN)
    assert bad.status == 400
    error = (await bad.json())["error"]
    assert error["param"] == "canonicalization_patterns" and "unbounded repeat" in error["message"]
    for field, value in (
        ("canonicalization_disabled_rules", ["no_such_rule"]),
        ("canonicalization_note_role", "assistant"),
        ("canonicalization_patterns", {"uuid": "[a-z]{3}"}),  # shadows a built-in rule
    ):
        response = await gateway.patch(path, json={field: value}, headers=ADMIN)
        assert response.status == 400 and (await response.json())["error"]["param"] == field

    patterns = {"ticket": r"ticket #(?P<v>[A-Z]{2}\d{3,6})"}
    response = await gateway.patch(
        path,
        json={"canonicalization_patterns": patterns, "canonicalization_disabled_rules": ["time"]},
        headers=ADMIN,
    )
    assert response.status == 200, await response.text()
    tenant = await response.json()
    assert tenant["canonicalization_patterns"] == patterns
    assert tenant["canonicalization_disabled_rules"] == ["time"]
    template = system_with("about ticket #{ticket}")
    await post_chat(gateway, created["api_key"], chat_body(template.format(ticket="AB1234")))
    second, header = await post_chat(
        gateway, created["api_key"], chat_body(template.format(ticket="CD98765"))
    )
    assert header == "1"
    assert cached(second) >= 0.9 * second["usage"]["prompt_tokens"]


async def test_streamed_response_carries_the_header(gateway):
    key = (await create_tenant(gateway, name="stream", canonicalization="on"))["api_key"]
    body = chat_body(system_with("2026-11-29T14:03:22Z") + " Request id: req_01HXYZ9ABC", stream=True)
    response = await gateway.post("/v1/chat/completions", json=body, headers=auth(key))
    assert response.status == 200 and response.headers[HEADER] == "2"
    await response.read()


async def test_prompt_lint_reports_fragments_and_their_cost(gateway):
    key = (await create_tenant(gateway, name="lint"))["api_key"]  # default mode: report
    system = system_with("2026-11-29T14:03:22Z") + " Trace 123e4567-e89b-12d3-a456-426614174000."
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
    }
    response = await gateway.post("/v1/prompt-lint", json=body, headers=auth(key))
    assert response.status == 200, await response.text()
    lint = await response.json()
    assert lint["object"] == "prompt_lint" and lint["mode"] == "report" and lint["exact"] is True
    assert [f["rule"] for f in lint["fragments"]] == ["iso8601", "uuid"]
    assert lint["fragments"][0]["text"] == "2026-11-29T14:03:22Z"
    assert lint["first_breaking_fragment"] == 0 and lint["would_move"] == 2
    first = lint["fragments"][0]
    assert 0 < first["token_offset"] < 100
    assert lint["reuse_cost_tokens"] == lint["cacheable_tokens"] - first["token_offset"] > 700
    assert lint["canonical_cacheable_tokens"] > 0.9 * lint["cacheable_tokens"]
    assert set(lint["suggested_rules"]) == {"iso8601", "uuid"}

    unauthenticated = await gateway.post("/v1/prompt-lint", json=body)
    assert unauthenticated.status == 401
    unknown_model = await gateway.post("/v1/prompt-lint", json={**body, "model": "nope"}, headers=auth(key))
    assert unknown_model.status == 404
    bad = await gateway.post("/v1/prompt-lint", json={"model": MODEL}, headers=auth(key))
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "messages"


async def test_metrics_count_moved_and_reported_fragments(gateway):
    await two_timestamps(gateway, "on")
    await two_timestamps(gateway, "report")
    text = await (await gateway.get("/metrics", headers=ADMIN)).text()
    lines = [
        line for line in text.splitlines() if line.startswith("prefixgate_canonicalization_fragments_total")
    ]
    assert any('action="moved"' in line and line.endswith(" 2.0") for line in lines)
    assert any('action="reported"' in line and line.endswith(" 2.0") for line in lines)


async def test_cli_sets_canonicalization_fields_and_lints(gateway, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXGATE_URL", str(gateway.make_url("")))
    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    created = await create_tenant(gateway, name="cli-canon")
    code, out, err = await run_cli(
        capsys,
        "tenant",
        "update",
        "cli-canon",
        "--canonicalization",
        "on",
        "--canonicalization-pattern",
        r"ticket=ticket #(?P<v>[A-Z]{2}\d{3,6})",
        "--canonicalization-disable",
        "time",
        "--canonicalization-note-role",
        "system",
    )
    assert code == 0, err
    tenant = json.loads(out)
    assert tenant["canonicalization"] == "on" and tenant["canonicalization_note_role"] == "system"
    assert list(tenant["canonicalization_patterns"]) == ["ticket"]
    assert tenant["canonicalization_disabled_rules"] == ["time"]
    code, _, err = await run_cli(
        capsys, "tenant", "update", "cli-canon", "--canonicalization-pattern", "o=ORD-\\d+"
    )
    assert code == 1 and "unbounded repeat" in err

    request = tmp_path / "request.json"
    system = "Support bot. Ticket: ticket #AB1234, opened 2026-11-29."
    request.write_text(
        json.dumps({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "?"}]})
    )
    code, out, err = await run_cli(
        capsys, "lint", str(request), "--model", MODEL, "--api-key", created["api_key"]
    )
    assert code == 0, err
    lint = json.loads(out)
    assert lint["mode"] == "on" and [f["rule"] for f in lint["fragments"]] == ["ticket", "date_iso"]
    code, _, err = await run_cli(capsys, "lint", str(request), "--model", MODEL, "--api-key", "sk-pg-wrong")
    assert code == 1 and "HTTP 401" in err
