"""Prefix identity: the one block-hashing function shared by gateway, worker and simulator.

    root = blake3(b"prefixgate/v1" ‖ model_fingerprint ‖ namespace_key)
    H_k  = blake3(H_{k-1} ‖ tokens of block k as little-endian uint32)

Only full blocks are hashed. A request may carry several namespace segments (a promoted hot prefix in
the global namespace, then the tenant's own): at the first block of every later segment the segment's
namespace key is mixed in, ``H_k = blake3(H_{k-1} ‖ b"ns" ‖ key ‖ tokens)``, so the chain after it is
private to that namespace while the blocks before it stay shareable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import blake3
import numpy as np

BlockHash = NewType("BlockHash", bytes)
NamespaceKey = NewType("NamespaceKey", bytes)

DOMAIN = b"prefixgate/v1"
_NS_MARK = b"ns"
HASH_BYTES = 32


@dataclass(frozen=True, kw_only=True, slots=True)
class NamespaceSegment:
    """A run of the prompt, from ``start_token`` to the next segment, hashed in one namespace."""

    start_token: int  # first token of the segment; a multiple of the block size
    namespace_id: str  # opaque, stable tag of the owner ("global" or a tenant tag): purge and quotas
    key: NamespaceKey  # secret, server-derived key that enters the hash (changes with the tenant epoch)
    reserved_blocks: int = 0  # per-tier block quota of a `dedicated` owner (0: common pool)


def root_hash(model_fingerprint: bytes, namespace_key: bytes) -> BlockHash:
    """The chain's seed: ties every block to one model and one namespace."""
    return BlockHash(blake3.blake3(DOMAIN + model_fingerprint + namespace_key).digest())


def chain_hash(parent: BlockHash, block_bytes: bytes, namespace_key: bytes | None = None) -> BlockHash:
    """One link of the chain: the hash of a block given its parent's hash and its tokens' bytes.

    ``namespace_key`` is given only for the first block of a later namespace segment.
    """
    data = parent + block_bytes if namespace_key is None else parent + _NS_MARK + namespace_key + block_bytes
    return BlockHash(blake3.blake3(data).digest())


def tokens_to_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32, the byte form that enters the hash."""
    return np.asarray(token_ids, dtype="<u4").tobytes()


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    model_fingerprint: bytes,
    segments: Sequence[NamespaceSegment],
    *,
    max_blocks: int | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids``, in one incremental pass.

    Args:
        token_ids: the prompt's tokens.
        block_size: tokens per block (the worker's KV block size).
        model_fingerprint: identity of weights, tokenizer, KV dtype and block size.
        segments: namespace segments ordered by ``start_token``; the first starts at 0 and every start
            is a multiple of ``block_size``.
        max_blocks: hash at most this many blocks (None: all full blocks).

    Returns:
        ``[H_0, H_1, …]`` for the full blocks; a trailing partial block is not hashed.
    """
    validate_segments(segments, block_size)
    raw = tokens_to_bytes(token_ids)
    num_blocks = len(raw) // (4 * block_size)
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    switch_at = {seg.start_token // block_size: seg.key for seg in segments[1:]}
    stride = 4 * block_size
    parent = root_hash(model_fingerprint, segments[0].key)
    hashes: list[BlockHash] = []
    for k in range(num_blocks):
        parent = chain_hash(parent, raw[k * stride : (k + 1) * stride], switch_at.get(k))
        hashes.append(parent)
    return hashes


def validate_segments(segments: Sequence[NamespaceSegment], block_size: int) -> None:
    """Raise ValueError unless the segments start at 0, are block-aligned and strictly increasing."""
    if not segments:
        raise ValueError("at least one namespace segment is required")
    if segments[0].start_token != 0:
        raise ValueError("the first namespace segment must start at token 0")
    previous = -1
    for seg in segments:
        if seg.start_token % block_size:
            raise ValueError(f"segment start {seg.start_token} is not a multiple of block size {block_size}")
        if seg.start_token <= previous:
            raise ValueError("namespace segments must have strictly increasing starts")
        previous = seg.start_token


def segment_at(segments: Sequence[NamespaceSegment], token_index: int) -> NamespaceSegment:
    """The segment that owns ``token_index``."""
    owner = segments[0]
    for seg in segments:
        if seg.start_token > token_index:
            break
        owner = seg
    return owner
