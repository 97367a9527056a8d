"""The byte format of KV entries in the disk and remote tiers.

An entry holds a run of consecutive blocks of one prefix chain in one namespace (a "chunk"), so a disk
file is hundreds of KB of contiguous multi-layer KV rather than per-layer slivers:

    b"PGKV" | u16 version | u32 header length | header (JSON) | 16-byte blake3 of the header | payloads

The header names the model fingerprint, namespace, codec, block shape and dtype, and for each block its
hash, parent hash, tokens (the collision guard), payload offset and length and a 16-byte blake3 checksum.
Anything that does not parse or verify is reported as ``CorruptEntry``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from policies.hashing import BlockHash

MAGIC = b"PGKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")
_DIGEST = 16


PREFIX_BYTES = _PREFIX.size  # the fixed prefix, enough to learn how long the header is (``header_bytes``)


class CorruptEntry(ValueError):
    """An entry that is truncated, altered, or written for another model."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockRecord:
    """One block's identity inside an entry."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class EntryHeader:
    fingerprint: bytes
    namespace_id: str
    codec: str
    dtype: str
    block_shape: tuple[int, ...]
    blocks: tuple[BlockRecord, ...]
    offsets: tuple[int, ...]  # payload offsets, relative to the start of the payload area
    lengths: tuple[int, ...]
    checksums: tuple[bytes, ...]
    payload_start: int  # absolute offset of the payload area in the entry

    @property
    def total_bytes(self) -> int:
        return self.payload_start + sum(self.lengths)


def _digest(data: bytes | memoryview) -> bytes:
    return blake3.blake3(data).digest(_DIGEST)


def encode_entry(
    *,
    fingerprint: bytes,
    namespace_id: str,
    codec: str,
    dtype: str,
    block_shape: Sequence[int],
    blocks: Sequence[BlockRecord],
    payloads: Sequence[bytes],
) -> bytes:
    offsets, offset = [], 0
    for payload in payloads:
        offsets.append(offset)
        offset += len(payload)
    header = {
        "fingerprint": fingerprint.hex(),
        "namespace_id": namespace_id,
        "codec": codec,
        "dtype": dtype,
        "block_shape": list(block_shape),
        "blocks": [
            {
                "hash": b.block_hash.hex(),
                "parent": b.parent_hash.hex() if b.parent_hash else None,
                "tokens": list(b.token_ids),
                "offset": off,
                "length": len(p),
                "checksum": _digest(p).hex(),
            }
            for b, p, off in zip(blocks, payloads, offsets, strict=True)
        ],
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([_PREFIX.pack(MAGIC, VERSION, len(raw)), raw, _digest(raw), *payloads])


def header_bytes(prefix: bytes | memoryview) -> int:
    """How many leading bytes of an entry its header takes (prefix, header, checksum), from its first
    ``PREFIX_BYTES``; raises CorruptEntry when they are not an entry's prefix."""
    if len(prefix) < _PREFIX.size:
        raise CorruptEntry("truncated entry prefix")
    magic, version, length = _PREFIX.unpack_from(prefix)
    if magic != MAGIC or version != VERSION:
        raise CorruptEntry("not a prefixgate KV entry")
    return _PREFIX.size + length + _DIGEST


def decode_header(data: bytes | memoryview, *, fingerprint: bytes | None = None) -> EntryHeader:
    """Parse and verify an entry's header (payload checksums are checked by ``payload``).

    An entry lists at least one block: one listing none is corrupt (never written, and its readers take
    the first block as the entry's identity).
    """
    end = header_bytes(data) - _DIGEST
    if len(data) < end + _DIGEST:
        raise CorruptEntry("truncated entry header")
    raw = bytes(data[_PREFIX.size : end])
    if _digest(raw) != bytes(data[end : end + _DIGEST]):
        raise CorruptEntry("entry header checksum mismatch")
    try:
        h = json.loads(raw)
        header = EntryHeader(
            fingerprint=bytes.fromhex(h["fingerprint"]),
            namespace_id=h["namespace_id"],
            codec=h["codec"],
            dtype=h["dtype"],
            block_shape=tuple(h["block_shape"]),
            blocks=tuple(
                BlockRecord(
                    block_hash=BlockHash(bytes.fromhex(b["hash"])),
                    parent_hash=BlockHash(bytes.fromhex(b["parent"])) if b["parent"] else None,
                    token_ids=tuple(b["tokens"]),
                )
                for b in h["blocks"]
            ),
            offsets=tuple(b["offset"] for b in h["blocks"]),
            lengths=tuple(b["length"] for b in h["blocks"]),
            checksums=tuple(bytes.fromhex(b["checksum"]) for b in h["blocks"]),
            payload_start=end + _DIGEST,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptEntry(f"malformed entry header: {exc}") from None
    if not header.blocks:
        raise CorruptEntry("entry lists no blocks")
    if fingerprint is not None and header.fingerprint != fingerprint:
        raise CorruptEntry("entry was written for another model fingerprint")
    return header


def payloads(data: bytes | bytearray | memoryview, header: EntryHeader, first: int, count: int) -> memoryview:
    """The verified payloads of blocks ``first … first+count-1``, one contiguous view (no copy)."""
    view = memoryview(data)
    start = header.payload_start + header.offsets[first]
    end = header.payload_start + header.offsets[first + count - 1] + header.lengths[first + count - 1]
    if end > len(view):
        raise CorruptEntry("truncated entry payload")
    for index in range(first, first + count):
        at = header.payload_start + header.offsets[index]
        if _digest(view[at : at + header.lengths[index]]) != header.checksums[index]:
            raise CorruptEntry("entry payload checksum mismatch")
    return view[start:end]
