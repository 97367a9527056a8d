import jinja2
import pytest

from policies.chat_text import (
    NOTE_HEADER,
    TextPosition,
    cacheable_end,
    char_to_token_offsets,
    insert_markers,
    iter_texts,
    locate_markers,
    message_boundary_positions,
    normalize_whitespace,
    original_offset,
)

PLAIN = (
    "<s>{% if tools %}[tools]{{ tools | tojson }}[/tools]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}"
)
TRIMMING = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</>{% endfor %}"
CONTENT_SENSITIVE = (
    "{% for m in messages %}<{{ m.role }} len={{ m.content | length }}>{{ m.content }}{% endfor %}"
)


def render(template: str, messages, tools=None) -> str:
    return jinja2.Environment().from_string(template).render(messages=messages, tools=tools)


MESSAGES = [
    {"role": "system", "content": "  Be brief.\n"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "doc one"}, {"type": "image_url", "image_url": {}}],
    },
    {"role": "assistant", "content": None, "tool_calls": []},
    {"role": "user", "content": "question"},
]


def test_iter_texts_and_cacheable_end():
    assert list(iter_texts(MESSAGES)) == [
        (0, None, "  Be brief.\n"),
        (1, 0, "doc one"),
        (3, None, "question"),
    ]
    assert cacheable_end(MESSAGES) == 3
    assert cacheable_end([{"role": "system", "content": "x"}]) == 1
    assert cacheable_end([]) == 0
    note = {"role": "user", "content": f"{NOTE_HEADER}\n[[1]] 2026-11-29"}
    assert cacheable_end([*MESSAGES, note]) == 3  # a trailing note is not the user turn
    assert message_boundary_positions([*MESSAGES, note]) == message_boundary_positions(MESSAGES)


def test_normalize_whitespace_maps_offsets_back_to_the_original():
    text = "a  \r\nbb\t\rc \r\n2026"
    normalized, line_endings, trailing_runs, deletions = normalize_whitespace(text)
    assert normalized == "a\nbb\nc\n2026"
    assert (line_endings, trailing_runs) == (3, 3)
    assert text[original_offset(normalized.index("2026"), deletions) :] == "2026"
    assert text[original_offset(normalized.index("bb"), deletions) :].startswith("bb")
    assert normalize_whitespace("clean\ntext") == ("clean\ntext", 0, 0, [])


def test_boundary_positions_cover_the_first_text_and_each_cacheable_message_end():
    positions = message_boundary_positions(MESSAGES)
    assert positions == [
        TextPosition(message_index=0, part_index=None, offset=2),
        TextPosition(message_index=0, part_index=None, offset=11),
        TextPosition(message_index=1, part_index=0, offset=7),
    ]
    assert len(message_boundary_positions(MESSAGES, max_boundaries=2)) == 2


@pytest.mark.parametrize("template", [PLAIN, TRIMMING])
def test_markers_locate_positions_in_the_rendered_prompt(template):
    messages = [
        {"role": "system", "content": "  Be brief.\n"},
        {"role": "user", "content": "doc one"},
        {"role": "user", "content": "question"},
    ]
    positions = [
        *message_boundary_positions(messages),
        TextPosition(message_index=1, part_index=None, offset=4),
    ]
    marked = insert_markers(messages, positions)
    assert messages[0]["content"] == "  Be brief.\n"  # input untouched
    plain_text = render(template, messages, tools=[{"name": "f"}])
    offsets = locate_markers(render(template, marked, tools=[{"name": "f"}]), plain_text, len(positions))
    assert offsets is not None
    assert plain_text[offsets[1] - len("Be brief.") : offsets[1]] == "Be brief."
    assert plain_text[offsets[2] - len("doc one") : offsets[2]] == "doc one"
    assert plain_text[offsets[3] :].startswith("one")


def test_a_template_that_reacts_to_content_gives_no_offsets_rather_than_wrong_ones():
    messages = [{"role": "system", "content": "abc"}, {"role": "user", "content": "q"}]
    positions = message_boundary_positions(messages)
    marked_text = render(CONTENT_SENSITIVE, insert_markers(messages, positions))
    assert locate_markers(marked_text, render(CONTENT_SENSITIVE, messages), len(positions)) is None


def test_dropped_markers_are_none_and_char_offsets_map_to_token_counts():
    assert locate_markers("ab\ue0000\ue001c", "abc", 2) == [2, None]
    token_starts = [0, 3, 5, 9]
    assert char_to_token_offsets(token_starts, [0, 3, 4, 10, None]) == [0, 1, 2, 4, None]
