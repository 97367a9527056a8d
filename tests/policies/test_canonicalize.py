import copy
import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.canonicalize import (
    MODES,
    NOTE_HEADER,
    CanonicalizationPolicy,
    canonical_json,
    canonical_tools,
    canonicalize_request,
    note_entries,
    restore,
    split_note,
)
from policies.chat_text import cacheable_end, iter_texts, normalize_whitespace, set_text

ON = CanonicalizationPolicy(mode="on")
REPORT = CanonicalizationPolicy(mode="report")
OFF = CanonicalizationPolicy(mode="off")


def chat(*messages, **extra):
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], **extra}


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


# -- concrete examples ----------------------------------------------------------------------------


def test_prompts_differing_only_in_a_timestamp_share_the_canonical_prefix():
    a = chat(("system", "You are Ada. Now: 2026-11-29T14:03:22Z. Be brief."), ("user", "hi"))
    b = chat(("system", "You are Ada. Now: 2026-11-30T09:00:01Z. Be brief."), ("user", "hi"))
    ca, cb = canonicalize_request(a, ON), canonicalize_request(b, ON)
    assert ca.request["messages"][:-1] == cb.request["messages"][:-1]
    assert ca.request["messages"][0]["content"] == "You are Ada. Now: [[1]]. Be brief."
    note = ca.request["messages"][-1]
    assert note == {"role": "user", "content": f"{NOTE_HEADER}\n[[1]] 2026-11-29T14:03:22Z"}
    assert ca.report.num_moved == 1
    assert [(f.rule, f.message_index, f.start, f.end) for f in ca.report.fragments] == [
        ("iso8601", 0, 18, 38)
    ]


def test_the_last_user_turn_and_everything_after_it_are_untouched():
    request = chat(
        ("system", "id 123e4567-e89b-12d3-a456-426614174000"),
        ("user", "first turn on 2026-11-29"),
        ("assistant", "noted 2026-11-29"),
        ("user", "second turn at 14:03:22  \r\n"),
        ("assistant", "calling tool at 2026-11-29"),
        ("tool", "result 2026-11-29T14:03:22Z"),
    )
    out = canonicalize_request(request, ON).request["messages"]
    assert out[3:6] == request["messages"][3:6]
    assert out[1]["content"] == "first turn on [[2]]" and out[2]["content"] == "noted [[3]]"
    assert out[-1]["content"].endswith(
        "[[1]] 123e4567-e89b-12d3-a456-426614174000\n[[2]] 2026-11-29\n[[3]] 2026-11-29"
    )
    assert len(out) == len(request["messages"]) + 1


def test_report_mode_leaves_the_request_byte_identical_but_reports():
    request = chat(("system", "Now: 2026-11-29T14:03:22Z \r\n"), ("user", "hi"))
    before = dumps(request)
    result = canonicalize_request(request, REPORT)
    assert dumps(result.request) == before and dumps(request) == before
    assert result.report.num_moved == 0
    assert [f.text for f in result.report.fragments] == ["2026-11-29T14:03:22Z"]
    assert result.report.fragments[0].placeholder == "[[1]]"
    assert result.report.whitespace[0].line_endings == 1 and result.report.whitespace[0].trailing_runs == 1


def test_off_mode_does_nothing():
    request = chat(("system", "Now: 2026-11-29T14:03:22Z"), ("user", "hi"), tools=[{"b": 1, "a": 2}])
    result = canonicalize_request(request, OFF)
    assert result.request == request and result.request["messages"] is request["messages"]
    assert result.report.fragments == () and not result.report.tools_changed


def test_default_mode_is_report_and_modes_are_a_registry():
    assert CanonicalizationPolicy().mode == "report"
    assert set(MODES) == {"off", "report", "on"}
    with pytest.raises(ValueError, match="mode must be one of"):
        CanonicalizationPolicy(mode="aggressive")
    with pytest.raises(ValueError, match="note role"):
        CanonicalizationPolicy(note_role="assistant")


def test_same_tools_in_any_key_or_list_order_render_identically():
    weather = {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["c", "f"], "type": "string"}, "city": {"type": "string"}},
                "required": ["unit", "city"],
            },
        },
    }
    search = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    shuffled = {
        "function": {
            "parameters": {
                "required": ["city", "unit"],
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "type": "object",
            },
            "description": "Weather for a city",
            "name": "weather",
        },
        "type": "function",
    }
    a = canonicalize_request(chat(("user", "hi"), tools=[weather, search]), ON)
    b = canonicalize_request(chat(("user", "hi"), tools=[search, shuffled]), ON)
    assert dumps(a.request["tools"]) == dumps(b.request["tools"])
    assert [t["function"]["name"] for t in a.request["tools"]] == ["search", "weather"]
    assert a.request["tools"][1]["function"]["parameters"]["required"] == ["city", "unit"]
    assert a.report.tools_changed and b.report.tools_changed
    assert canonical_json(weather) == canonical_json(shuffled | {"function": weather["function"]})
    # enum order carries meaning and is kept; only key order and `required` are normalized
    assert a.request["tools"][1]["function"]["parameters"]["properties"]["unit"]["enum"] == ["c", "f"]
    again = canonicalize_request(a.request, ON)
    assert not again.report.tools_changed and again.request == a.request


def test_legacy_functions_are_sorted_by_name():
    functions = [{"name": "b", "parameters": {}}, {"parameters": {}, "name": "a"}]
    out = canonicalize_request(chat(("user", "hi"), functions=functions), ON).request
    assert [f["name"] for f in out["functions"]] == ["a", "b"]
    assert list(out["functions"][0]) == ["name", "parameters"]
    assert canonical_tools([1, {"x": 1}]) == [1, {"x": 1}]  # malformed entries are kept, not dropped


def test_tenant_patterns_and_disabled_rules():
    policy = CanonicalizationPolicy.from_tenant(
        mode="on", patterns={"order": r"ORD-\d{6,10}"}, disabled_rules=["date_iso"]
    )
    out = canonicalize_request(
        chat(("system", "Order ORD-1234567 placed 2026-11-29."), ("user", "status?")), policy
    )
    assert out.request["messages"][0]["content"] == "Order [[1]] placed 2026-11-29."
    assert [(f.rule, f.kind) for f in out.report.fragments] == [("order", "tenant")]
    with pytest.raises(ValueError, match="pattern 'order' rejected: unbounded repeat"):
        CanonicalizationPolicy.from_tenant(patterns={"order": r"ORD-\d+"})
    with pytest.raises(ValueError, match="unknown built-in rules"):
        CanonicalizationPolicy.from_tenant(disabled_rules=["dates"])


def test_whitespace_is_normalized_only_in_the_cacheable_part():
    request = chat(("system", "line one  \r\nline two\t\rthree "), ("user", "keep  \r\n"))
    result = canonicalize_request(request, ON)
    assert result.request["messages"][0]["content"] == "line one\nline two\nthree"
    assert result.request["messages"][1]["content"] == "keep  \r\n"
    assert result.report.num_moved == 0 and len(result.request["messages"]) == 2
    change = result.report.whitespace[0]
    assert (change.line_endings, change.trailing_runs) == (2, 3)


def test_fragment_offsets_refer_to_the_text_as_sent():
    request = chat(("system", "a \r\nb  \r\nid=x at 2026-11-29"), ("user", "q"))
    fragment = canonicalize_request(request, REPORT).report.fragments[0]
    assert request["messages"][0]["content"][fragment.start : fragment.end] == "2026-11-29"


def test_content_parts_are_canonicalized_part_by_part():
    request = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "doc of 2026-11-29"},
                    {"type": "image_url", "image_url": {"url": "data:2026-11-29"}},
                ],
            },
            {"role": "user", "content": "question"},
        ]
    }
    result = canonicalize_request(request, ON)
    parts = result.request["messages"][0]["content"]
    assert parts[0]["text"] == "doc of [[1]]" and parts[1] == request["messages"][0]["content"][1]
    assert result.report.fragments[0].part_index == 0
    assert request["messages"][0]["content"][0]["text"] == "doc of 2026-11-29"  # input not mutated


def test_without_a_user_message_every_message_is_cacheable():
    out = canonicalize_request(chat(("system", "now 14:03:22")), ON).request["messages"]
    assert out[0]["content"] == "now [[1]]" and split_note(out)[1] is not None


def test_literal_placeholders_in_the_input_are_kept_and_never_reused():
    request = chat(("system", "see [[1]] then 2026-11-29"), ("user", "and [[2]]"))
    out = canonicalize_request(request, ON).request["messages"]
    assert out[0]["content"] == "see [[1]] then [[3]]"
    assert note_entries(out[-1]) == {"[[3]]": "2026-11-29"}
    assert restore(out) == request["messages"]


SIX_DIGIT_LITERAL = chat(
    ("system", "Ticket [[999999]] opened 2026-12-01T10:00:00Z by the agent."), ("user", "Summarise it.")
)


def test_a_six_digit_literal_placeholder_does_not_push_numbers_past_the_bound():
    # review r12 #2: the next number was 1000000, which PLACEHOLDER does not recognise
    out = canonicalize_request(SIX_DIGIT_LITERAL, ON).request["messages"]
    assert out[0]["content"] == "Ticket [[999999]] opened [[1]] by the agent."
    assert restore(out) == SIX_DIGIT_LITERAL["messages"]


def test_idempotent_with_a_digit_pattern_after_a_six_digit_literal():
    policy = CanonicalizationPolicy.from_tenant(mode="on", patterns={"ticket": r"[0-9]{7}"})
    once = canonicalize_request(SIX_DIGIT_LITERAL, policy).request
    assert dumps(canonicalize_request(once, policy).request) == dumps(once)


def test_past_the_last_placeholder_number_values_stay_in_place():
    note = {"role": "user", "content": f"{NOTE_HEADER}\n[[999998]] 14:03:22\n[[999999]] 09:00:00"}
    request = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "at [[999998]] and [[999999]], then 2026-11-29 and 2026-11-30"},
            {"role": "user", "content": "q"},
            note,
        ],
    }
    once = canonicalize_request(request, ON)
    assert once.request["messages"][0]["content"] == request["messages"][0]["content"]
    assert once.report.num_moved == 0
    assert (
        restore(once.request["messages"])[0]["content"]
        == "at 14:03:22 and 09:00:00, then 2026-11-29 and 2026-11-30"
    )
    assert dumps(canonicalize_request(once.request, ON).request) == dumps(once.request)


def test_a_request_that_already_has_a_note_gets_new_entries_appended():
    first = canonicalize_request(chat(("system", "at 14:03:22"), ("user", "q")), ON).request
    grown = copy.deepcopy(first)
    grown["messages"].insert(1, {"role": "system", "content": "also 2026-11-29"})
    out = canonicalize_request(grown, ON).request["messages"]
    assert out[1]["content"] == "also [[2]]"
    assert note_entries(out[-1]) == {"[[1]]": "14:03:22", "[[2]]": "2026-11-29"}
    assert sum(m["content"].startswith(NOTE_HEADER) for m in out) == 1


def test_note_role_is_configurable():
    policy = CanonicalizationPolicy(mode="on", note_role="system")
    out = canonicalize_request(chat(("system", "at 14:03:22"), ("user", "q")), policy).request["messages"]
    assert out[-1]["role"] == "system"


def test_report_json_is_serializable_and_carries_the_header_count():
    report = canonicalize_request(chat(("system", "at 14:03:22"), ("user", "q")), ON).report
    data = json.loads(json.dumps(report.to_json()))
    assert data["moved"] == 1 and data["fragments"][0]["placeholder"] == "[[1]]"
    assert report.rules_fired == ("time",)


# -- properties -----------------------------------------------------------------------------------

_piece = st.one_of(
    st.sampled_from(
        [
            "You are a helpful assistant.",
            "word",
            " ",
            "  ",
            "\t",
            "\n",
            "\r\n",
            "\r",
            " \n",
            ".",
            ":",
            "-",
            "1",
            "[[",
            "]]",
            "[[2]]",
            "[[999999]]",
            "[[1000000]]",
            "2026-11-29T14:03:22Z",
            "2026-11-29",
            "14:03:22",
            "Nov 29, 2026",
            "123e4567-e89b-12d3-a456-426614174000",
            "req_01HXYZ9ABC",
            "9f86d081884c7d659a2feaa0c55ad015",
            "timestamp: 1764424999",
        ]
    ),
    st.text(max_size=4),
)
_text = st.lists(_piece, max_size=8).map("".join)
_content = st.one_of(
    _text,
    st.lists(
        st.one_of(
            st.builds(lambda t: {"type": "text", "text": t}, _text),
            st.just({"type": "image_url", "image_url": {"url": "https://x/2026-11-29.png"}}),
        ),
        max_size=3,
    ),
    st.none(),
)
_message = st.builds(
    lambda role, content: {"role": role, "content": content},
    st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
    _content,
)
_request = st.builds(lambda messages: {"model": "m", "messages": messages}, st.lists(_message, max_size=6))


def _normalized_cacheable(messages):
    messages = copy.deepcopy(messages)
    end = cacheable_end(messages)
    for message_index, part_index, text in list(iter_texts(messages)):
        if message_index < end:
            set_text(messages[message_index], part_index, normalize_whitespace(text)[0])
    return messages


def _visible_chars(messages) -> Counter:
    return Counter(c for _, _, text in iter_texts(messages) for c in text if not c.isspace())


@settings(max_examples=200, deadline=None)
@given(_request)
def test_canonicalization_is_idempotent(request):
    once = canonicalize_request(request, ON)
    twice = canonicalize_request(once.request, ON)
    assert dumps(twice.request) == dumps(once.request)
    assert twice.report.num_moved == 0 and twice.report.whitespace == ()


@settings(max_examples=200, deadline=None)
@given(_request)
def test_text_is_moved_never_lost(request):
    before = dumps(request)
    out = canonicalize_request(request, ON).request
    assert dumps(request) == before  # the input is not mutated
    assert restore(out["messages"]) == _normalized_cacheable(request["messages"])
    assert not _visible_chars(request["messages"]) - _visible_chars(out["messages"])


@settings(max_examples=200, deadline=None)
@given(_request)
def test_last_user_turn_onwards_is_kept_and_the_note_is_last(request):
    result = canonicalize_request(request, ON)
    messages, out = request["messages"], result.request["messages"]
    end = cacheable_end(messages)
    body, note = split_note(out)
    assert body[end:] == messages[end:]
    assert len(body) == len(messages)
    assert (note is not None) == (result.report.num_moved > 0)


@settings(max_examples=200, deadline=None)
@given(_request)
def test_nothing_found_means_byte_identical_and_report_matches_on(request):
    on = canonicalize_request(request, ON)
    report = canonicalize_request(request, REPORT)
    assert dumps(report.request) == dumps(request)
    assert report.report.fragments == on.report.fragments
    assert report.report.whitespace == on.report.whitespace
    if not on.report.fragments and not on.report.whitespace:
        assert dumps(on.request) == dumps(request)


_plain_text = st.lists(
    st.sampled_from(["Answer briefly.", "word", " ", "\n", "v3.11.7", "16:9", "ORD", "42", "[x]"]),
    max_size=10,
).map("".join)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), _plain_text), max_size=6))
def test_prompts_without_dynamic_fragments_are_byte_identical(pairs):
    request = chat(*((role, normalize_whitespace(text)[0]) for role, text in pairs))
    result = canonicalize_request(request, ON)
    assert result.report.fragments == ()
    assert dumps(result.request) == dumps(request)


def _form_tool(order: list[str]) -> dict:
    """A tool whose parameter's ``default`` holds DATA under a key named "required" (review r3, D4)."""
    layout = {"type": "object", "description": "fields in display order", "default": {"required": order}}
    return {
        "type": "function",
        "function": {
            "name": "create_form",
            "parameters": {"type": "object", "properties": {"layout": layout}, "required": ["layout"]},
        },
    }


def test_data_lists_named_required_keep_their_order():
    a = canonical_tools([_form_tool(["last_name", "first_name", "email"])])
    b = canonical_tools([_form_tool(["email", "first_name", "last_name"])])
    layout = a[0]["function"]["parameters"]["properties"]["layout"]
    assert layout["default"] == {"required": ["last_name", "first_name", "email"]}
    assert a != b  # different defaults stay different tool sets


@pytest.mark.parametrize("keyword", ["default", "const", "examples", "enum"])
def test_on_mode_never_reorders_values_the_model_sees(keyword):
    value = {"required": ["zip", "city"]}
    data = [value] if keyword in ("examples", "enum") else value
    tool = _form_tool([])
    tool["function"]["parameters"]["properties"]["layout"][keyword] = data
    request = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    out = canonicalize_request(request, CanonicalizationPolicy(mode="on")).request
    assert out["tools"][0]["function"]["parameters"]["properties"]["layout"][keyword] == data


def test_required_is_sorted_in_every_schema_position():
    def obj(*names: str) -> dict:
        return {
            "type": "object",
            "properties": {n: {"type": "string"} for n in names},
            "required": list(names),
        }

    parameters = {
        **obj("b", "a"),
        "$defs": {"d": obj("y", "x")},
        "properties": {"list": {"type": "array", "items": obj("q", "p")}, "u": {"anyOf": [obj("n", "m")]}},
    }
    legacy = canonical_tools([{"name": "f", "parameters": parameters}])[0]["parameters"]
    tool = canonical_tools([{"type": "function", "function": {"name": "f", "parameters": parameters}}])[0]
    for schema in (legacy, tool["function"]["parameters"]):
        assert schema["required"] == ["a", "b"]
        assert schema["$defs"]["d"]["required"] == ["x", "y"]
        assert schema["properties"]["list"]["items"]["required"] == ["p", "q"]
        assert schema["properties"]["u"]["anyOf"][0]["required"] == ["m", "n"]
