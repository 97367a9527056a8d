"""Where text lives in an OpenAI-style chat request, and where it lands in the rendered prompt.

Shared by canonicalization (which rewrites message text), the prompt lint and hot-prefix promotion
(which need token offsets of points inside messages). Token offsets are found without re-rendering
prefixes of the conversation: the caller renders the request once with invisible markers inserted at
the points of interest (``insert_markers``), once without, and ``locate_markers`` reads the marker
positions off the marked rendering after checking that it equals the plain one once the markers are
removed (a chat template that inspects content, e.g. its length, would break that; then no offsets are
returned rather than wrong ones).
"""

from __future__ import annotations

import copy
import re
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]

_MARK_OPEN = "\ue000"  # Unicode private-use characters: no tokenizer merges them with real text
_MARK_CLOSE = "\ue001"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")
NOTE_HEADER = (
    "[prefixgate] Values moved out of the messages above so that their prefix can be cached; "
    "each [[n]] above stands for the value listed here."
)
# A placeholder left where canonicalization moved a value out (numbers 1..MAX_PLACEHOLDER); the one
# pattern for placeholders in text and in the note's entries.
PLACEHOLDER = re.compile(r"\[\[(\d{1,6})\]\]")
MAX_PLACEHOLDER = 999_999
_NOTE_ENTRY = re.compile(PLACEHOLDER.pattern + " (.*)")
_TRAILING_WS = re.compile(r"[ \t]+(?=\r|\n|\Z)|\r\n|\r")


@dataclass(frozen=True, kw_only=True, slots=True)
class TextPosition:
    """A character position inside one message's text."""

    message_index: int
    part_index: int | None  # index in a list of content parts; None when ``content`` is a string
    offset: int  # characters from the start of that text


def iter_texts(messages: Sequence[Mapping[str, Any]]) -> Iterator[tuple[int, int | None, str]]:
    """``(message_index, part_index, text)`` for every text in ``messages``, in prompt order.

    Text is a string ``content`` (``part_index`` None) or the ``text`` of a ``{"type": "text"}``
    content part. Other parts (images, audio) and fields (``tool_calls``, ``name``) are not text.
    """
    for message_index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            yield message_index, None, content
        elif isinstance(content, list):
            for part_index, part in enumerate(content):
                if (
                    isinstance(part, Mapping)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    yield message_index, part_index, part["text"]


def set_text(message: Message, part_index: int | None, text: str) -> None:
    """Replace one text of ``message`` in place (``message`` must be the caller's own copy)."""
    if part_index is None:
        message["content"] = text
    else:
        message["content"][part_index]["text"] = text


def normalize_whitespace(text: str) -> tuple[str, int, int, list[tuple[int, int]]]:
    """``(text, line endings fixed, trailing runs removed, deletions)``.

    ``deletions`` lists ``(position in the result, number of characters deleted just before it)``,
    enough to map a result offset back to the original text (``original_offset``).
    """
    if "\r" not in text and " \n" not in text and "\t\n" not in text and not text.endswith((" ", "\t")):
        return text, 0, 0, []
    pieces: list[str] = []
    deletions: list[tuple[int, int]] = []
    line_endings = trailing_runs = 0
    cursor = out_len = 0
    for match in _TRAILING_WS.finditer(text):
        kept = text[cursor : match.start()]
        pieces.append(kept)
        out_len += len(kept)
        token = match.group(0)
        if token.startswith("\r"):
            line_endings += 1
            pieces.append("\n")
            if token == "\r\n":
                deletions.append((out_len, 1))
            out_len += 1
        else:
            trailing_runs += 1
            deletions.append((out_len, len(token)))
        cursor = match.end()
    pieces.append(text[cursor:])
    return "".join(pieces), line_endings, trailing_runs, deletions


def original_offset(offset: int, deletions: Sequence[tuple[int, int]]) -> int:
    return offset + sum(count for position, count in deletions if position <= offset)


def split_note(messages: Sequence[Message]) -> tuple[list[Message], Message | None]:
    """``(messages without the trailing note, the note or None)``."""
    if messages:
        last = messages[-1]
        content = last.get("content") if isinstance(last, Mapping) else None
        if isinstance(content, str) and content.startswith(NOTE_HEADER + "\n"):
            return list(messages[:-1]), last
    return list(messages), None


def note_entries(note: Mapping[str, Any]) -> dict[str, str]:
    """Placeholder → moved text, from a note message."""
    lines = note["content"].split("\n")[1:]
    return {f"[[{m.group(1)}]]": m.group(2) for line in lines if (m := _NOTE_ENTRY.fullmatch(line))}


def cacheable_end(messages: Sequence[Mapping[str, Any]]) -> int:
    """Index of the last user message: messages before it form the cacheable part of the prompt.

    A trailing canonicalization note is not a user turn. With no user message at all, every message
    is cacheable (``len(messages)``).
    """
    last = len(messages) - 1 if split_note(messages)[1] is not None else len(messages)
    for index in range(last - 1, -1, -1):
        if isinstance(messages[index], Mapping) and messages[index].get("role") == "user":
            return index
    return len(messages)


def message_boundary_positions(
    messages: Sequence[Mapping[str, Any]], *, max_boundaries: int = 16
) -> list[TextPosition]:
    """Points that end the stable parts of a prompt, for hot-prefix counting.

    The start of the first message's text (tools are rendered before it by most templates), then
    the end of the text of each message before the last user turn, at most ``max_boundaries`` in
    all. An end is placed before trailing whitespace, so templates that trim content render the
    marked request exactly like the plain one.
    """
    positions: list[TextPosition] = []
    last_text: dict[int, tuple[int | None, str]] = {}
    end = cacheable_end(messages)
    for message_index, part_index, text in iter_texts(messages):
        if not positions:
            lead = len(text) - len(text.lstrip())
            positions.append(TextPosition(message_index=message_index, part_index=part_index, offset=lead))
        if message_index < end:
            last_text[message_index] = (part_index, text)
    for message_index in sorted(last_text):
        part_index, text = last_text[message_index]
        positions.append(
            TextPosition(message_index=message_index, part_index=part_index, offset=len(text.rstrip()))
        )
    return positions[:max_boundaries]


def insert_markers(messages: Sequence[Mapping[str, Any]], positions: Sequence[TextPosition]) -> list[Message]:
    """A deep copy of ``messages`` with marker ``k`` inserted at ``positions[k]``."""
    marked = copy.deepcopy(list(messages))
    texts = {(m, p): t for m, p, t in iter_texts(marked)}
    by_text: dict[tuple[int, int | None], list[tuple[int, int]]] = {}
    for k, pos in enumerate(positions):
        by_text.setdefault((pos.message_index, pos.part_index), []).append((pos.offset, k))
    for (message_index, part_index), inserts in by_text.items():
        text = texts[(message_index, part_index)]
        for offset, k in sorted(inserts, reverse=True):
            text = f"{text[:offset]}{_MARK_OPEN}{k}{_MARK_CLOSE}{text[offset:]}"
        set_text(marked[message_index], part_index, text)
    return marked


def locate_markers(marked_text: str, plain_text: str, num_markers: int) -> list[int | None] | None:
    """Character offsets in ``plain_text`` of markers ``0 … num_markers-1`` found in ``marked_text``.

    Returns None when ``marked_text`` without its markers is not ``plain_text`` (the template reacted
    to the markers); a marker the template dropped gets None; a repeated marker counts where it first
    appears.
    """
    offsets: list[int | None] = [None] * num_markers
    pieces: list[str] = []
    clean_len = 0
    cursor = 0
    for match in _MARK.finditer(marked_text):
        piece = marked_text[cursor : match.start()]
        pieces.append(piece)
        clean_len += len(piece)
        k = int(match.group(1))
        if k < num_markers and offsets[k] is None:
            offsets[k] = clean_len
        cursor = match.end()
    pieces.append(marked_text[cursor:])
    if "".join(pieces) != plain_text:
        return None
    return offsets


def char_to_token_offsets(
    token_char_starts: Sequence[int], char_offsets: Sequence[int | None]
) -> list[int | None]:
    """Number of tokens that start before each character offset.

    Args:
        token_char_starts: start character of every token of the prompt, ascending (a Hugging Face
            ``Encoding.offsets`` gives them as ``[start for start, _ in offsets]``).
        char_offsets: positions from ``locate_markers``; None stays None.
    """
    return [None if c is None else bisect_left(token_char_starts, c) for c in char_offsets]
