import json

import jinja2
import pytest

from policies.canonicalize import CanonicalizationPolicy
from policies.prompt_lint import lint_prompt
from worker.tokenizer import BYTE_CHAT_TEMPLATE, TokenizerBundle

TOKENIZER = TokenizerBundle.byte_level()
TEMPLATE = jinja2.Environment().from_string(BYTE_CHAT_TEMPLATE)
POLICY = CanonicalizationPolicy()  # the default, report: lint answers as if it were on


def render(request) -> str:
    return TEMPLATE.render(
        messages=request["messages"],
        tools=request.get("tools"),
        bos_token="<|bos|>",
        add_generation_prompt=False,
    )


def count_tokens(text: str) -> int:
    return len(TOKENIZER.encode(text))


SYSTEM = "You are Ada, a support agent.\nNow: 2026-11-29T14:03:22Z\n" + "Policy text. " * 39 + "The end."


def token_starts(text: str) -> list[int]:
    return [start for start, _ in TOKENIZER.tokenizer.encode(text, add_special_tokens=False).offsets]


def lint(request, policy=POLICY, renderer=render):
    return lint_prompt(request, policy=policy, render=renderer, token_starts=token_starts)


def test_lint_locates_the_first_breaking_fragment_and_its_cost():
    request = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "QUESTION"}]}
    report = lint(request)
    plain = render(request)
    offset = count_tokens(plain[: plain.index("2026-11-29T")])
    cacheable = count_tokens(plain[: plain.index("QUESTION")])
    assert report.first_breaking is report.findings[0]
    assert report.first_breaking.token_offset == offset
    assert report.prompt_tokens == count_tokens(plain)
    assert report.cacheable_tokens == cacheable
    assert report.reusable_tokens == offset
    assert report.reuse_cost_tokens == cacheable - offset > 500
    # with canonicalization on, the whole cacheable part is stable; the timestamp (20 bytes) became [[1]]
    assert report.canonical_cacheable_tokens == cacheable - len("2026-11-29T14:03:22Z") + len("[[1]]")
    assert report.num_movable == 1 and report.suggested_rules == ("iso8601",)
    assert report.exact and report.mode == "report"


def test_every_fragment_gets_an_offset_and_its_own_cost():
    request = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Doc (trace 9f86d081884c7d659a2feaa0c55ad015): lorem ipsum"},
            {"role": "user", "content": "QUESTION"},
        ]
    }
    report = lint(request)
    first, second = report.findings
    assert first.token_offset < second.token_offset
    assert first.reuse_cost_tokens > second.reuse_cost_tokens > 0
    assert report.suggested_rules == ("hex_id", "iso8601")


def test_a_clean_prompt_costs_nothing_and_still_suggests_tools_and_whitespace():
    request = {
        "messages": [{"role": "system", "content": "Be brief.  \r\n"}, {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"parameters": {}, "name": "f"}}],
    }
    report = lint(request)
    assert report.findings == () and report.first_breaking is None
    assert report.reuse_cost_tokens == 0 and report.reusable_tokens == report.cacheable_tokens
    assert report.suggested_rules == ("tools", "whitespace")
    assert report.num_movable == 0


def test_tenant_patterns_are_linted_too():
    policy = CanonicalizationPolicy.from_tenant(mode="off", patterns={"order": r"ORD-\d{6,10}"})
    request = {
        "messages": [{"role": "system", "content": "Order ORD-12345678."}, {"role": "user", "content": "?"}]
    }
    report = lint(request, policy)
    assert [f.fragment.rule for f in report.findings] == ["order"] and report.mode == "off"


def test_no_user_message_counts_the_whole_prompt_as_cacheable():
    request = {"messages": [{"role": "system", "content": "at 14:03:22 do it"}]}
    report = lint(request)
    assert report.cacheable_tokens == report.prompt_tokens
    assert report.reuse_cost_tokens == report.prompt_tokens - report.findings[0].token_offset


def test_a_template_that_reacts_to_content_reports_unknown_offsets():
    env = jinja2.Environment()
    sensitive = env.from_string(
        "{% for m in messages %}[{{ m.content | length }}]{{ m.content }}{% endfor %}"
    )

    def renderer(request):
        return sensitive.render(messages=request["messages"])

    request = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "QUESTION"}]}
    report = lint(request, renderer=renderer)
    assert not report.exact
    assert report.findings[0].token_offset is None and report.reuse_cost_tokens is None
    assert report.num_movable == 1


def test_the_report_serializes_to_json():
    request = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "QUESTION"}]}
    data = json.loads(json.dumps(lint(request).to_json()))
    assert data["first_breaking_fragment"] == 0
    assert data["fragments"][0]["text"] == "2026-11-29T14:03:22Z"
    assert data["fragments"][0]["token_offset"] > 0
    assert set(data) >= {"reuse_cost_tokens", "cacheable_tokens", "would_move", "suggested_rules"}


def test_render_errors_propagate():
    def broken(request):
        raise jinja2.TemplateError("roles must alternate")

    with pytest.raises(jinja2.TemplateError):
        lint({"messages": [{"role": "user", "content": "x"}]}, renderer=broken)


def test_lint_tokenizes_a_bounded_multiple_of_the_input():
    """Cost linear in the input: the characters tokenized stay a small multiple of the prompt's, however
    many fragments there are (tokenizing one prefix per fragment made 400 KB take 30 s)."""
    document = "".join(
        f"Entry {i} at 2026-11-29T14:{i % 60:02d}:22Z. " + "lorem ipsum " * 16 for i in range(300)
    )
    request = {"messages": [{"role": "system", "content": document}, {"role": "user", "content": "QUESTION"}]}
    tokenized = []

    def counting_starts(text: str) -> list[int]:
        tokenized.append(len(text))
        return token_starts(text)

    report = lint_prompt(request, policy=POLICY, render=render, token_starts=counting_starts)
    plain = render(request)
    assert len(report.findings) == 300 and report.findings[63].token_offset is not None
    assert report.findings[1].token_offset == len(token_starts(plain[: plain.index("2026-11-29T14:01")]))
    assert sum(tokenized) <= 3 * len(plain)
