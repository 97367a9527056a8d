import re
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.fragments import (
    BUILTIN_RULES,
    MAX_TENANT_RULES,
    PLACEHOLDER,
    compile_tenant_rules,
    find_fragments,
    stable_fragments,
)
from policies.pattern_safety import check_pattern_safety

RULES = tuple(BUILTIN_RULES.values())


def found(text: str, rules=RULES) -> list[tuple[str, str]]:
    return [(s.rule, text[s.start : s.end]) for s in find_fragments(text, rules)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("now: 2026-11-29T14:03:22Z.", [("iso8601", "2026-11-29T14:03:22Z")]),
        ("at 2026-11-29 14:03:22.123456+01:00 ok", [("iso8601", "2026-11-29 14:03:22.123456+01:00")]),
        ("at 2026-11-29T14:03 local", [("iso8601", "2026-11-29T14:03")]),
        ("stamp 20261129T140322Z", [("iso8601_basic", "20261129T140322Z")]),
        ("Date: Sat, 29 Nov 2026 14:03:22 +0000", [("rfc2822", "Sat, 29 Nov 2026 14:03:22 +0000")]),
        ("Sat Nov 29 14:03:22 2026", [("ctime", "Sat Nov 29 14:03:22 2026")]),
        ("Today is 2026-11-29.", [("date_iso", "2026-11-29")]),
        ("on 2026/11/29", [("date_ymd_slash", "2026/11/29")]),
        ("on 11/29/2026 and 29/11/2026", [("date_slash", "11/29/2026"), ("date_slash", "29/11/2026")]),
        ("am 29.11.2026.", [("date_dots", "29.11.2026")]),
        ("Today is Saturday, November 29, 2026.", [("date_weekday_name", "Saturday, November 29, 2026")]),
        (
            "Sept. 3rd, 2026 or 30th Sep 2026",
            [("date_month_name", "Sept. 3rd, 2026"), ("date_day_name", "30th Sep 2026")],
        ),
        (
            "on Nov. 29th, 2026 and 1 May 2026",
            [("date_month_name", "Nov. 29th, 2026"), ("date_day_name", "1 May 2026")],
        ),
        ("it is 14:03:22 now", [("time", "14:03:22")]),
        ("meet at 2:03 PM", [("time_ampm", "2:03 PM")]),
        ('{"timestamp": 1764424999123}', [("epoch", "1764424999123")]),
        ("created_at=1764424999", [("epoch", "1764424999")]),
        ("id 123e4567-e89b-12d3-a456-426614174000.", [("uuid", "123e4567-e89b-12d3-a456-426614174000")]),
        (
            "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            [("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")],
        ),
        (
            "see req_01HXYZ9ABC and chatcmpl-9aBcD3eF",
            [("prefixed_id", "req_01HXYZ9ABC"), ("prefixed_id", "chatcmpl-9aBcD3eF")],
        ),
        ("X-Request-ID: a1b2c3d4.", [("labeled_id", "a1b2c3d4")]),
        ("session id = 'sess42abc'", [("labeled_id", "sess42abc")]),
        ("sha 9f86d081884c7d659a2feaa0c55ad015 ok", [("hex_id", "9f86d081884c7d659a2feaa0c55ad015")]),
        ("ID 9F86D081884C7D65", [("hex_id", "9F86D081884C7D65")]),
    ],
)
def test_builtin_rules_find_common_dynamic_values(text, expected):
    assert found(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "Python 3.11.7 and CalVer 2024.1.15, pip 24.0",
        "call me at 1234567890 or 415-555-0100; order 20261129",
        "aspect 16:9, verse 3:16, meeting at 10:30",
        "color #ffaabb, pointer 0x7ffe3c2a1b40ff00, word deadbeefdeadbeef",
        "mac 00:12:34:56:78:90 and ip 192.168.1.1 and ipv6 fe80::1:2:3",
        "request-handling and session_timeout, run-loop, call-site",
        "ISBN 978-3-16-148410-0, version 1.2.3-beta, Nov 29 without year, 13/45/2026",
        "the user id is unknown; trace id: none",
        "a short sha 9f86d08 and a word cafebabe",
    ],
)
def test_builtin_rules_leave_versions_numbers_and_code_alone(text):
    assert found(text) == []


def test_overlapping_matches_keep_the_longest_from_the_earliest_start():
    assert found("2026-11-29T14:03:22Z") == [("iso8601", "2026-11-29T14:03:22Z")]
    assert found("Sat, 29 Nov 2026 14:03:22 GMT") == [("rfc2822", "Sat, 29 Nov 2026 14:03:22 GMT")]


def test_placeholders_multiline_and_overlong_values_are_never_fragments():
    text = "[[12]] 2026-11-29"
    assert found(text) == [("date_iso", "2026-11-29")]
    tenant = compile_tenant_rules({"bracketed": r"\[\[\d{1,3}\]\]", "two_lines": r"ab\ncd"})
    assert found("x [[12]] y ab\ncd", tenant) == []


def test_builtin_rules_have_bounded_unambiguous_repeats():
    # The tenant budget is tighter than the built-ins need, but their shapes pass the same checks.
    for rule in RULES:
        assert check_pattern_safety(rule.pattern.pattern, max_cost=1 << 16) is None, rule.name


def test_tenant_rules_compile_and_match():
    rules = compile_tenant_rules({"order": r"ORD-\d{6,10}", "ticket": r"ticket #(?P<v>[A-Z]{2}\d{3,6})"})
    assert [r.name for r in rules] == ["order", "ticket"]
    assert found("ticket #AB1234 for ORD-12345678", rules) == [
        ("ticket", "AB1234"),
        ("order", "ORD-12345678"),
    ]


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        ({"broken": r"ORD-(\d{6}"}, "does not compile"),
        ({"greedy": r"ORD-\d+"}, "unbounded repeat"),
        ({"star": r"a.*b"}, "unbounded repeat"),
        ({"nested": r"(a|ab){1,9}c"}, "nested quantifiers"),
        ({"nested2": r"(x{1,3}){1,9}y"}, "nested quantifiers"),
        ({"product": r"\d{1,64}\d{1,64}x"}, "backtracking bound"),
        ({"backref": r"(\w)\1"}, "back-references"),
        ({"empty": r"x?"}, "empty text"),
        ({"BadName": r"abc"}, "must match"),
        ({"uuid": r"abc"}, "built-in"),
        ({"long": "a" * 300}, "at most 256"),
        ({f"p{i}": "ab" for i in range(MAX_TENANT_RULES + 1)}, f"at most {MAX_TENANT_RULES}"),
    ],
)
def test_bad_tenant_patterns_are_rejected_with_a_clear_message(patterns, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compile_tenant_rules(patterns)


def test_atomic_and_possessive_forms_are_the_documented_escape_hatch():
    assert check_pattern_safety(r"(?>x{1,3}){1,9}y") is None
    assert check_pattern_safety(r"k=\w{1,64}+;") is None


_pieces = st.sampled_from(
    [
        "2026-11-29",
        "14:03:22",
        "T",
        "Z",
        " ",
        "-",
        ":",
        "/",
        "1",
        "29",
        "Nov",
        "abc",
        "req_",
        "9f86d081884c7d65",
        "123e4567-e89b-12d3-a456-426614174000",
        "[[3]]",
        "timestamp: ",
        "1764424999",
        ".",
    ]
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_pieces, max_size=14).map("".join))
def test_stable_fragments_leave_nothing_to_match_once_masked(text):
    spans = stable_fragments(text, RULES)
    masked = text
    for span in reversed(spans):
        masked = masked[: span.start] + "[[7]]" + masked[span.end :]
    assert find_fragments(masked, RULES) == []
    assert all(a.end <= b.start for a, b in pairwise(spans))
    assert not any(PLACEHOLDER.search(text[s.start : s.end]) for s in spans)


def test_masking_can_reveal_a_new_match_and_the_rescan_finds_it_far_into_long_text():
    # "14:03:22" is not a time while followed by ":2"; once the date after it is masked, it is.
    pad = "lorem ipsum dolor " * 200
    text = pad + "14:03:22:2026-11-29 " + pad + "at 14:03:22:2026-11-30." + pad
    spans = stable_fragments(text, RULES)
    assert [(s.rule, text[s.start : s.end]) for s in spans] == [
        ("time", "14:03:22"),
        ("date_iso", "2026-11-29"),
        ("time", "14:03:22"),
        ("date_iso", "2026-11-30"),
    ]
    assert [s.rule for s in find_fragments(text, RULES)] == ["date_iso", "date_iso"]


def _full_rescan_reference(text: str) -> list[tuple[int, int]]:
    spans = [(s.start, s.end) for s in find_fragments(text, RULES)]
    while True:
        masked, shifts, cursor, shift = [], [], 0, 0
        for start, end in spans:
            masked += [text[cursor:start], "[[0]]"]
            shift += 5 - (end - start)
            shifts.append((start + shift + (end - start), shift))
            cursor = end
        masked = "".join([*masked, text[cursor:]])
        found = []
        for s in find_fragments(masked, RULES):
            delta = max((d for e, d in shifts if e <= s.start), default=0)
            found.append((s.start - delta, s.end - delta))
        if not found:
            return spans
        spans = sorted(spans + found)


_pad = st.sampled_from([" ", "\n", "lorem ipsum " * 150, "x" * 700])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(_pieces, _pad), max_size=12).map("".join))
def test_windowed_rescan_equals_a_full_rescan(text):
    assert [(s.start, s.end) for s in stable_fragments(text, RULES)] == _full_rescan_reference(text)


def test_fragments_stop_at_the_limit_with_the_same_first_ones():
    """A 1 MB text of time-like values held 125,000 fragments and cost seconds of CPU to scan; with a
    limit the scan stops early and keeps exactly the first fragments an unlimited scan finds."""
    import uuid

    from policies.fragments import BUILTIN_RULES, stable_fragments

    rules = tuple(BUILTIN_RULES.values())
    text = " ".join(
        f"at 2026-11-{1 + i % 28:02d}T10:{i % 60:02d}:05Z trace {uuid.UUID(int=i * 7919)} ok"
        for i in range(3000)
    )
    everything = stable_fragments(text, rules)
    assert len(everything) == 6000 and len({span.rule for span in everything[:100]}) == 2
    limited = stable_fragments(text, rules, limit=100)
    assert limited == everything[:100]


def test_canonicalization_reports_when_the_fragment_budget_ran_out():
    from policies.canonicalize import CanonicalizationPolicy, canonicalize_request
    from policies.fragments import MAX_FRAGMENTS_PER_REQUEST

    many = "1:11:11 " * (2 * MAX_FRAGMENTS_PER_REQUEST)
    request = {"messages": [{"role": "system", "content": many}, {"role": "user", "content": "at 10:11:12"}]}
    for mode in ("report", "on"):
        out = canonicalize_request(request, CanonicalizationPolicy.from_tenant(mode=mode))
        assert len(out.report.fragments) == MAX_FRAGMENTS_PER_REQUEST
        assert out.report.to_json()["fragment_limit_reached"] is True
    few = canonicalize_request(
        {"messages": [{"role": "system", "content": "now 10:11:12"}, {"role": "user", "content": "hi"}]},
        CanonicalizationPolicy.from_tenant(mode="on"),
    )
    assert few.report.to_json()["fragment_limit_reached"] is False and len(few.report.fragments) == 1


def test_long_texts_are_searched_in_windows_with_the_same_matches():
    """``re`` holds the GIL for a whole search step: long texts are searched in overlapping windows,
    which must find exactly what one search finds, also for matches cut by a window's edge."""
    import random

    from policies import fragments
    from policies.fragments import BUILTIN_RULES, _matches

    rng = random.Random(7)
    pieces = [
        "2026-11-29T14:03:22Z",
        "10:11:12",
        "550e8400-e29b-41d4-a716-446655440000",
        "req_a1b2c3d4e5",
        "timestamp: 1732888888",
        "3f2a9c1b7d4e8f60a1b2c3d4e5f60718",
        "Mon, 29 Nov 2026",
        "lorem ipsum ",
        "1" * 40,
        "a1" * 40,
        "-",
        ":",
        " ",
        "\n",
    ]
    text = "".join(rng.choice(pieces) for _ in range(12_000))
    assert len(text) > 4 * fragments._SCAN_WINDOW
    patterns = [rule.pattern for rule in BUILTIN_RULES.values()]
    patterns.append(fragments.compile_tenant_rules({"ticket": r"TK-[0-9]{4,12}"})[0].pattern)
    text += " TK-12345678 " * 50
    for pattern in patterns:
        expected = [m.span() for m in pattern.finditer(text)]
        assert [m.span() for m in _matches(pattern, text)] == expected, pattern.pattern
    short = text[: fragments._SCAN_WINDOW + fragments._SCAN_OVERLAP + 2000]  # two windows
    for window in range(fragments._SCAN_WINDOW - 300, fragments._SCAN_WINDOW + 300, 41):  # across the cut
        cut = short[:window] + "2026-11-29T14:03:22.123456+01:00" + short[window:]
        for pattern in patterns:
            assert [m.span() for m in _matches(pattern, cut)] == [m.span() for m in pattern.finditer(cut)]
