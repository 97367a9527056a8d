"""Block codecs for the disk and remote tiers: ``none``, ``fp8`` (e4m3) and ``int4`` (group-wise, packed).

A block is a tensor ``[num_layers, 2, block_size, kv_heads, head_dim]``. ``fp8`` keeps one float32 scale
per (layer, k/v, head) of the block; ``int4`` one float16 scale per group of ``INT4_GROUP`` values along
``head_dim``, symmetric, two values packed per byte. Codecs work on a batch of blocks at once.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

from worker.tiers.entry import CorruptEntry, EntryHeader

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT4_GROUP = 32


class Codec(ABC):
    name: str

    @abstractmethod
    def encode(self, blocks: torch.Tensor) -> list[bytes]:
        """One payload per block of ``blocks`` [n, L, 2, bs, kvh, hd] (any float dtype, CPU)."""

    @abstractmethod
    def decode(
        self, data: bytearray | memoryview, num_blocks: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Blocks [num_blocks, *shape] in ``dtype`` from their concatenated payloads (a writable buffer).

        The result may share memory with ``data``.
        """

    @abstractmethod
    def payload_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Encoded size of one block."""


def _bytes(data: bytearray | memoryview, num_blocks: int) -> torch.Tensor:
    """The payload bytes as a [num_blocks, payload] uint8 tensor, without copying."""
    return torch.frombuffer(data, dtype=torch.uint8).reshape(num_blocks, -1)


class NoneCodec(Codec):
    name = "none"

    def encode(self, blocks: torch.Tensor) -> list[bytes]:
        raw = blocks.contiguous().view(torch.uint8).reshape(len(blocks), -1).numpy()
        return [row.tobytes() for row in raw]

    def decode(
        self, data: bytearray | memoryview, num_blocks: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        return _bytes(data, num_blocks).view(dtype).reshape(num_blocks, *shape)

    def payload_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class Fp8Codec(Codec):
    name = "fp8"

    def encode(self, blocks: torch.Tensor) -> list[bytes]:
        x = blocks.float()
        amax = x.abs().amax(dim=(3, 5), keepdim=True)  # over block_size and head_dim
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        q = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8).reshape(len(blocks), -1).numpy()
        scales = scale.reshape(len(blocks), -1).numpy()
        return [s.tobytes() + row.tobytes() for s, row in zip(scales, q, strict=True)]

    def decode(
        self, data: bytearray | memoryview, num_blocks: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        layers, two, _, kvh, _ = shape
        n_scale = layers * two * kvh
        raw = _bytes(data, num_blocks)
        scale = (
            raw[:, : 4 * n_scale].contiguous().view(torch.float32).reshape(num_blocks, layers, two, 1, kvh, 1)
        )
        q = raw[:, 4 * n_scale :].contiguous().view(torch.float8_e4m3fn).reshape(num_blocks, *shape)
        return (q.float() * scale).to(dtype)

    def payload_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        layers, two, _, kvh, _ = shape
        return 4 * layers * two * kvh + math.prod(shape)


class Int4Codec(Codec):
    name = "int4"

    @staticmethod
    def _groups(head_dim: int) -> int:
        group = min(INT4_GROUP, head_dim)
        if head_dim % group:
            raise ValueError(f"int4 codec needs head_dim divisible by {group}")
        return head_dim // group

    def encode(self, blocks: torch.Tensor) -> list[bytes]:
        n = len(blocks)
        hd = blocks.shape[-1]
        groups = self._groups(hd)
        x = blocks.float().reshape(*blocks.shape[:-1], groups, hd // groups)
        scale = (x.abs().amax(dim=-1, keepdim=True) / 7.0).clamp(min=1e-12).to(torch.float16)
        q = (torch.round(x / scale.float()).clamp(-8, 7) + 8).to(torch.uint8).reshape(n, -1)
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).numpy()
        scales = scale.reshape(n, -1).numpy()
        return [s.tobytes() + row.tobytes() for s, row in zip(scales, packed, strict=True)]

    def decode(
        self, data: bytearray | memoryview, num_blocks: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        n = num_blocks
        hd = shape[-1]
        groups = self._groups(hd)
        n_scale = math.prod(shape[:-1]) * groups
        raw = _bytes(data, n)
        scale = raw[:, : 2 * n_scale].contiguous().view(torch.float16).float()
        packed = raw[:, 2 * n_scale :]
        q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(n, -1).to(torch.int16) - 8
        values = q.float().reshape(n, *shape[:-1], groups, hd // groups) * scale.reshape(
            n, *shape[:-1], groups, 1
        )
        return values.reshape(n, *shape).to(dtype)

    def payload_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        groups = self._groups(shape[-1])
        return 2 * math.prod(shape[:-1]) * groups + math.prod(shape) // 2


CODECS: Mapping[str, Codec] = {c.name: c for c in (NoneCodec(), Fp8Codec(), Int4Codec())}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown KV codec {name!r}; known: {sorted(CODECS)}") from None


def entry_codec(header: EntryHeader, shape: tuple[int, ...], dtype: torch.dtype) -> Codec:
    """The codec that decodes an entry into ``[n, *shape]`` blocks of ``dtype``: the one its header names.

    Raises:
        CorruptEntry: the entry holds blocks of another dtype or shape, an unknown codec, or payloads of
            the wrong size (the fingerprint does not cover the codec: workers of one model may differ).
    """
    if header.dtype != str(dtype).removeprefix("torch.") or tuple(header.block_shape) != tuple(shape):
        raise CorruptEntry(f"entry holds {header.dtype} blocks of shape {list(header.block_shape)}")
    codec = CODECS.get(header.codec)
    if codec is None:
        raise CorruptEntry(f"entry of unknown codec {header.codec!r}")
    size = codec.payload_bytes(shape, dtype)
    if any(length != size for length in header.lengths):
        raise CorruptEntry(f"entry payloads are not {size} bytes ({codec.name})")
    return codec
