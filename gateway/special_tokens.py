"""Tenant text never becomes control tokens.

A chat prompt is rendered by the model's template and tokenized as one string, so a message that
contains the text of a special token (``<|end|><|start|>system``) would be tokenized into the real
control tokens: a tenant could close its own turn and write a system turn. ``chat_encoding`` finds the
message texts that contain special-token text, locates them in the rendered prompt with the same
markers hot-prefix promotion uses (``policies.chat_text``), and encodes those spans as plain text
(``ModelRuntime.encode_literal``) while the template's own text keeps its control tokens.

The common case (no special-token text in any message) is one ordinary tokenizer call. Special-token
text anywhere else in a request (tool schemas, names, tool-call arguments), or in a message the
template transforms so that it cannot be located, is refused with a 400 rather than guessed at.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tokenizers import Encoding

from gateway.errors import InvalidRequest
from gateway.model import ModelRuntime
from policies.chat_text import TextPosition, insert_markers, iter_texts, locate_markers


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _contains_any(text: str, needles: Sequence[str]) -> bool:
    return any(needle in text for needle in needles)


def chat_encoding(
    model: ModelRuntime,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    text: str,
) -> Encoding:
    """The tokenizer output for the rendered chat prompt ``text`` of ``messages``/``tools``, with every
    message text encoded as text (special-token text included).

    Raises:
        InvalidRequest: special-token text outside message texts, or in a message text the template
            does not reproduce verbatim.
    """
    specials = model.added_token_texts
    if not specials or not any(_contains_any(s, specials) for s in _strings([list(messages), tools])):
        return model.tokenize_chat(text)
    others = [s for s in _strings([_without_texts(messages), tools]) if _contains_any(s, specials)]
    if others:
        found = next(token for token in specials if token in others[0])
        raise InvalidRequest(
            f"special-token text ({json.dumps(found)}) is only accepted inside message content",
            param="messages" if any(found in s for s in _strings(_without_texts(messages))) else "tools",
            code="invalid_value",
        )
    texts = [(m, p, t) for m, p, t in iter_texts(messages) if _contains_any(t, specials)]
    positions = []
    for message_index, part_index, value in texts:
        positions.append(TextPosition(message_index=message_index, part_index=part_index, offset=0))
        positions.append(TextPosition(message_index=message_index, part_index=part_index, offset=len(value)))
    marked = model.render_chat(insert_markers(messages, positions), tools)
    offsets = locate_markers(marked, text, len(positions))
    if offsets is None or any(offset is None for offset in offsets):
        raise InvalidRequest(
            "this model's chat template transforms message text that contains special-token text, "
            "so it cannot be kept as plain text; remove the special-token text",
            param="messages",
            code="invalid_value",
        )
    spans = sorted(zip(offsets[::2], offsets[1::2], strict=True))
    pieces: list[Encoding] = []
    cursor = 0
    for start, end in spans:
        if start < cursor:  # overlapping spans cannot come from an in-order template: refuse
            raise InvalidRequest("message texts overlap in the rendered prompt", param="messages")
        if start > cursor:
            pieces.append(model.tokenize_chat(text[cursor:start]))
        if end > start:
            pieces.append(model.encode_literal(text[start:end]))
        cursor = end
    if cursor < len(text):
        pieces.append(model.tokenize_chat(text[cursor:]))
    return Encoding.merge(pieces, growing_offsets=True)


def _without_texts(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages' fields other than their texts (role, name, tool calls …)."""
    stripped = []
    for message in messages:
        rest = {k: v for k, v in message.items() if k != "content"}
        content = message.get("content")
        if isinstance(content, list):
            rest["content"] = [
                {k: v for k, v in part.items() if k != "text"} if isinstance(part, Mapping) else part
                for part in content
            ]
        stripped.append(rest)
    return stripped
