"""Tenant regular expressions and fragment scanning stay linear in the prompt (issue 11, ReDoS)."""

import subprocess
import sys
import time

import pytest

from policies.fragments import compile_tenant_rules, stable_fragments
from tests.gateway.conftest import ADMIN, create_tenant
from tests.gateway.test_gateway_e2e import auth, chat_body

NESTED_LOOKAHEADS = r"(?:a(?!(?:a(?!(?:a(?!a{1,64}b)){1,64}b)){1,64}b)){1,64}b"


async def test_nested_lookaheads_in_bounded_repeats_are_refused(client):
    tenant = await create_tenant(client)
    response = await client.patch(
        f"/admin/v1/tenants/{tenant['id']}",
        json={"canonicalization": "on", "canonicalization_patterns": {"stall": NESTED_LOOKAHEADS}},
        headers=ADMIN,
    )
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert error["param"] == "canonicalization_patterns" and "stall" in error["message"]


@pytest.mark.parametrize(
    "source",
    [
        NESTED_LOOKAHEADS,
        r"(?<!b)ab",  # lookbehind: what made the re-scan quadratic
        r"(a)\1",  # back-reference
    ],
)
def test_patterns_outside_the_linear_engine_are_refused(source):
    with pytest.raises(ValueError, match=r"rejected|compile"):
        compile_tenant_rules({"p": source})


def test_tenant_patterns_run_on_the_linear_engine():
    (rule,) = compile_tenant_rules({"order": r"ORD-[0-9]{4,12}"})
    assert type(rule.pattern).__module__.startswith("re2")
    text = "x ORD-12345 y ORD-99999999 z"
    assert [text[s.start : s.end] for s in stable_fragments(text, [rule])] == ["ORD-12345", "ORD-99999999"]
    started = time.perf_counter()
    stable_fragments("ORD-" + "1" * 200_000, [rule])  # long near-miss: linear, not stalled
    assert time.perf_counter() - started < 10


_SCAN = """
import re, sys
from policies.fragments import FragmentRule, stable_fragments
rule = FragmentRule(name="chain", kind="tenant", pattern=re.compile(r"(?<!b)ab"))
spans = stable_fragments("ab" * (int(sys.argv[1]) // 2), [rule])
print(len(spans))
"""


def test_fragment_rescan_is_linear_in_the_input():
    """Each masked fragment enabled the next match, one re-scan round per fragment over the whole
    text: 32 KB took 480 s. Run out of process so a regression fails at the bound instead of hanging."""
    result = subprocess.run(
        [sys.executable, "-c", _SCAN, str(32 * 1024)], capture_output=True, text=True, timeout=20
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 1


async def test_a_chatty_prompt_with_tenant_patterns_is_answered(gateway):
    tenant = await create_tenant(gateway, canonicalization="on")
    patch = {"canonicalization_patterns": {"ticket": r"TCK-[0-9]{1,8}"}}
    assert (await gateway.patch(f"/admin/v1/tenants/{tenant['id']}", json=patch, headers=ADMIN)).status == 200
    body = chat_body("tickets: " + " ".join(f"TCK-{i}" for i in range(2000)), "hi")
    started = time.perf_counter()
    response = await gateway.post("/v1/chat/completions", json=body, headers=auth(tenant["api_key"]))
    assert response.status in (200, 400), await response.text()  # 400: context length, still answered
    assert time.perf_counter() - started < 10
