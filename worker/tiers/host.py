"""L2: blocks evicted from the device pool, kept in a byte budget of host memory.

The index is a ``BlockManager`` (same policy registry, leaf-first eviction, reservations and purge as the
device pool); the data is one preallocated host tensor, pinned when a GPU is present so copies to the
device can run asynchronously. Blocks evicted from here are handed to ``on_demote`` (the disk and remote
tiers) as CPU copies, because their slots are reused at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from policies.hashing import BlockHash
from worker.block_manager import Block, BlockManager
from worker.tiers.entry import BlockRecord


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class DemotedBlock:
    """A block leaving a tier, with everything the next tier needs."""

    record: BlockRecord
    namespace_id: str
    position: int
    data: torch.Tensor  # [L, 2, bs, kvh, hd] on the CPU, owned by the receiver


class HostTier:
    def __init__(
        self,
        *,
        capacity_blocks: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        pin_memory: bool,
        eviction_policy: str = "default",
        evict_batch: int = 16,
        on_demote: Callable[[list[DemotedBlock]], None] | None = None,
    ) -> None:
        self.block_shape = block_shape
        self.index = BlockManager(
            capacity_blocks,
            block_shape[2],
            eviction_policy=eviction_policy,
            require_parent=False,
            on_evict=self._collect_victim,
        )
        self.data = torch.empty((capacity_blocks, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self.evict_batch = evict_batch
        self._on_demote = on_demote
        self._victims: list[DemotedBlock] = []
        self._positions: dict[int, int] = {}
        self.num_stored = 0

    @property
    def capacity_blocks(self) -> int:
        return self.index.num_blocks

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.index.hash_to_block_id

    def match(self, hashes: Sequence[BlockHash], token_blocks: Sequence[Sequence[int]]) -> list[int]:
        """Slots of the longest run of ``hashes`` held here, from the first one on."""
        return self.index.match_prefix(hashes, token_blocks)

    def put(self, record: BlockRecord, namespace_id: str, position: int, data: torch.Tensor) -> int | None:
        """Copy one block in (evicting and demoting a chunk of others if full); returns its slot.

        Returns None when the block is already here or every slot is pinned.
        """
        return self.put_many([record], [namespace_id], [position], data.unsqueeze(0))[0]

    def put_many(
        self,
        records: Sequence[BlockRecord],
        namespace_ids: Sequence[str],
        positions: Sequence[int],
        data: torch.Tensor,
    ) -> list[int | None]:
        """Copy a run of one chain in, parents first (a prefetched chain); returns each block's slot.

        The blocks stay referenced until the whole run is in, so (a) the run's head is what is kept when
        L2 cannot hold all of it (a tail without its head can never be matched) and (b) each block is
        linked to an already pinned parent in O(1): offering blocks one ``put`` at a time walked the chain
        up and down on every block, quadratic in its length (measured by ``bench.tiers``). Blocks already
        here, or beyond what L2 can free, get None.
        """
        slots: list[int | None] = []
        taken: list[int] = []
        try:
            for record, namespace_id, position, block in zip(
                records, namespace_ids, positions, data, strict=True
            ):
                if record.block_hash in self.index.hash_to_block_id:
                    slots.append(None)
                    continue
                if not self.index.num_free_blocks:
                    self.index.reclaim(self.evict_batch, namespace_id)
                    self._flush_victims()
                    if not self.index.num_free_blocks:
                        slots.extend([None] * (len(records) - len(slots)))
                        break
                slot = self.index.allocate(namespace_id)
                taken.append(slot)
                self.data[slot].copy_(block)
                if not self.index.cache(
                    slot,
                    record.block_hash,
                    record.token_ids,
                    record.parent_hash,
                    namespace_id=namespace_id,
                    position=position,
                ):
                    slots.append(None)  # stays private: freed by the release below
                    continue
                self._positions[slot] = position
                self.num_stored += 1
                slots.append(slot)
        finally:
            self.index.release(taken)  # leaf first
        return slots

    def pin(self, slots: Sequence[int]) -> None:
        """Keep ``slots`` from eviction while they are copied out (a hit)."""
        self.index.acquire(slots)

    def unpin(self, slots: Sequence[int]) -> None:
        self.index.release(slots)

    def record(self, slot: int) -> BlockRecord:
        block = self.index.blocks[slot]
        assert block.block_hash is not None
        return BlockRecord(
            block_hash=block.block_hash, parent_hash=block.parent_hash, token_ids=block.token_ids
        )

    def resident(self) -> list[tuple[Block, int]]:
        """Every cached (block, position), parents before children within a chain."""
        cached = [b for b in self.index.blocks if b.block_hash is not None]
        return sorted(((b, self._positions.get(b.block_id, 0)) for b in cached), key=lambda item: item[1])

    def purge(self, namespace_id: str) -> int:
        return self.index.purge(namespace_id)

    def _collect_victim(self, block: Block) -> None:
        if self._on_demote is None or block.block_hash is None:
            return
        record = BlockRecord(
            block_hash=block.block_hash, parent_hash=block.parent_hash, token_ids=block.token_ids
        )
        self._victims.append(
            DemotedBlock(
                record=record,
                namespace_id=block.namespace_id,
                position=self._positions.pop(block.block_id, 0),
                data=self.data[block.block_id].clone(),
            )
        )

    def _flush_victims(self) -> None:
        if self._victims and self._on_demote is not None:
            victims, self._victims = self._victims, []
            self._on_demote(victims)
