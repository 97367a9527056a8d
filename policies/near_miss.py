"""Near-miss matching: how much of a candidate prompt's cache a request could really reuse.

Embeddings only nominate candidates; reuse is decided here on tokens. A block is reusable only if the
request and the candidate agree on every token up to its end *and* both hash those tokens under the
same namespace keys (the chain is keyed: the same tokens under another key are other blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# (start_token, namespace key) of each namespace segment, in order: enough to tell which key hashes a token.
SegmentLayout = tuple[tuple[int, bytes], ...]


def token_lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def same_keys_tokens(a: SegmentLayout, b: SegmentLayout) -> int:
    """Tokens from the start that both layouts hash under the same keys (a large number if all)."""
    boundaries = sorted({start for start, _ in a} | {start for start, _ in b})

    def key_at(layout: SegmentLayout, token: int) -> bytes:
        owner = layout[0][1]
        for start, key in layout:
            if start > token:
                break
            owner = key
        return owner

    for token in boundaries:
        if key_at(a, token) != key_at(b, token):
            return token
    return 1 << 62


@dataclass(frozen=True, kw_only=True, slots=True)
class Reuse:
    lcp_tokens: int  # tokens the two prompts share from the start
    reusable_blocks: int  # full blocks of that run hashed under the same keys: what a cache hit can serve


def reusable(
    request_tokens: np.ndarray,
    request_layout: SegmentLayout,
    candidate_tokens: np.ndarray,
    candidate_layout: SegmentLayout,
    block_size: int,
) -> Reuse:
    lcp = token_lcp(request_tokens, candidate_tokens)
    usable = min(lcp, same_keys_tokens(request_layout, candidate_layout))
    return Reuse(lcp_tokens=lcp, reusable_blocks=usable // block_size)


def layout_of(segments: Sequence) -> SegmentLayout:
    """The layout of ``policies.hashing.NamespaceSegment``s."""
    return tuple((seg.start_token, bytes(seg.key)) for seg in segments)
