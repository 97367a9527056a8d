"""What near miss remembers of routed prompts, and how a request compares with them: the prompts
(``Remembered``), their FAISS index per namespace key (``NamespaceVectors``), the one whose cache a
request could reuse most (``best_nominee``), and where a request parts from the closest one of its
tenant (``diverging_span``: a near-miss finding). Plain data and numpy: no I/O, no state of the app."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np

from gateway.model import ModelRuntime
from gateway.near_miss_findings import DivergingSpan
from policies.hashing import NamespaceSegment
from policies.near_miss import SegmentLayout, layout_of, reusable


@dataclass(frozen=True, kw_only=True, slots=True)
class Remembered:
    token_ids: np.ndarray  # int32, the prompt's first ``max_prompt_tokens`` tokens
    layout: SegmentLayout  # its namespace segments (start token, key)
    worker_url: str
    own_key: bytes  # the key it is indexed under (its last segment's)
    tenant_id: str  # whose prompt it is: every `shared` tenant's key is the global one
    epoch: int = 0  # its tenant's epoch when it was prepared (older than the newest: purged since)
    routed_s: float = 0.0  # time.monotonic() when it was routed


class NamespaceVectors:
    """One namespace key's remembered prompts: a FAISS inner-product index over unit vectors."""

    def __init__(self, dim: int, capacity: int) -> None:
        import faiss  # only when a tenant enables near-miss

        self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self._entries: OrderedDict[int, Remembered] = OrderedDict()
        self._id_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._next_id = 0
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, vector: np.ndarray, entry: Remembered) -> None:
        digest = blake3.blake3(
            entry.token_ids.tobytes() + entry.worker_url.encode() + b"\0" + entry.tenant_id.encode()
        ).digest(16)
        known = self._id_of.get(digest)
        if known is not None:  # the same tenant's prompt on the same worker: just keep it fresh
            self._entries.move_to_end(known)
            return
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self._index.add_with_ids(vector.reshape(1, -1), np.array([entry_id], dtype=np.int64))
        self._entries[entry_id], self._id_of[digest], self._digest_of[entry_id] = entry, entry_id, digest
        if len(self._entries) > self._capacity:
            oldest, _ = self._entries.popitem(last=False)
            del self._id_of[self._digest_of.pop(oldest)]
            self._index.remove_ids(np.array([oldest], dtype=np.int64))

    def num_of(self, tenant_id: str) -> int:
        return sum(1 for entry in self._entries.values() if entry.tenant_id == tenant_id)

    def remove_tenant(self, tenant_id: str) -> None:
        """Drop one tenant's prompts (a `shared` tenant's, from the global key's index)."""
        gone = [entry_id for entry_id, entry in self._entries.items() if entry.tenant_id == tenant_id]
        for entry_id in gone:
            del self._entries[entry_id]
            del self._id_of[self._digest_of.pop(entry_id)]
        if gone:
            self._index.remove_ids(np.array(gone, dtype=np.int64))

    def search(self, vector: np.ndarray, k: int) -> list[tuple[float, Remembered]]:
        if not self._entries:
            return []
        scores, ids = self._index.search(vector.reshape(1, -1), min(k, len(self._entries)))
        return [(float(s), self._entries[int(i)]) for s, i in zip(scores[0], ids[0], strict=True) if i >= 0]


def best_nominee(
    tokens: np.ndarray,
    segments: Sequence[NamespaceSegment],
    nominees: Sequence[Remembered],
    by_url: dict,
    block_size: int,
) -> tuple[int, Remembered] | None:
    """The nominee whose cache the request could reuse most (exact tokens, same keys), if any."""
    layout = layout_of(segments)
    best: tuple[int, Remembered] | None = None
    for entry in nominees:
        if entry.worker_url not in by_url:
            continue  # its worker is gone
        blocks = reusable(tokens, layout, entry.token_ids, entry.layout, block_size).reusable_blocks
        if blocks and (best is None or blocks > best[0]):
            best = (blocks, entry)
    return best


def diverging_span(
    tenant_id: str,
    model: ModelRuntime,
    tokens: np.ndarray,
    segments: Sequence[NamespaceSegment],
    nominees: Sequence[Remembered],
    block_size: int,
) -> DivergingSpan | None:
    """Where the request parted from its closest prompt of the same tenant and namespace, or None (no
    such prompt, nothing shared, or one is a prefix of the other). Never another tenant's: a finding
    shows the other prompt's text, and every `shared` tenant's key is the global one."""
    own_key, layout = bytes(segments[-1].key), layout_of(segments)
    closest: tuple[int, Remembered] | None = None
    for entry in nominees:
        if entry.own_key == own_key and entry.tenant_id == tenant_id:
            lcp = reusable(tokens, layout, entry.token_ids, entry.layout, block_size).lcp_tokens
            if closest is None or lcp > closest[0]:
                closest = (lcp, entry)
    if closest is None:
        return None
    lcp, other = closest
    if lcp >= min(len(tokens), len(other.token_ids)) or lcp == 0:
        return None  # one is a prefix of the other (no divergence) or nothing is shared
    return DivergingSpan(
        model_id=model.model_id,
        position_token=lcp,
        before_text=model.decode(tokens[max(0, lcp - 8) : lcp].tolist()),
        request_text=model.decode(tokens[lcp : lcp + 12].tolist()),
        other_text=model.decode(other.token_ids[lcp : lcp + 12].tolist()),
        tokens_after=int(len(tokens) - lcp),
        seen_at=time.time(),
    )
