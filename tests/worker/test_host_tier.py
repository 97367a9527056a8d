"""L2 (host tier): a prefetched chain is offered as one batch, so the chain's head is what stays when it
does not all fit, and each block is linked to its parent once (not a walk up the chain per block)."""

import torch

from policies.hashing import block_hashes
from tests.worker.conftest import segments
from worker.block_manager import Block
from worker.tiers.entry import BlockRecord
from worker.tiers.host import HostTier

SHAPE = (1, 2, 16, 1, 4)


def chain(num_blocks: int) -> tuple[list[BlockRecord], torch.Tensor]:
    tokens = list(range(16 * num_blocks))
    hashes = block_hashes(tokens, 16, b"host", segments())
    records = [
        BlockRecord(
            block_hash=h,
            parent_hash=hashes[k - 1] if k else None,
            token_ids=tuple(tokens[16 * k : 16 * k + 16]),
        )
        for k, h in enumerate(hashes)
    ]
    return records, torch.arange(num_blocks, dtype=torch.float32).view(-1, 1, 1, 1, 1, 1).expand(
        -1, *SHAPE
    ).clone()


def test_a_chain_longer_than_l2_keeps_its_head():
    host = HostTier(capacity_blocks=4, block_shape=SHAPE, dtype=torch.float32, pin_memory=False)
    records, data = chain(6)
    slots = host.put_many(records, ["a"] * 6, list(range(6)), data)
    assert slots[4:] == [None, None] and None not in slots[:4]
    found = host.match([r.block_hash for r in records], [r.token_ids for r in records])
    assert found == slots[:4]  # the first four blocks, matchable from the first one
    assert [host.data[s][0, 0, 0, 0, 0].item() for s in found] == [0.0, 1.0, 2.0, 3.0]
    assert host.index.num_evictable_blocks == 4  # nothing stays pinned after the offer


def test_offering_a_chain_links_each_block_to_its_parent_once(monkeypatch):
    steps = 0
    original = Block.pinned

    def counted(self):
        nonlocal steps
        steps += 1
        return original.fget(self)

    monkeypatch.setattr(Block, "pinned", property(counted))
    host = HostTier(capacity_blocks=512, block_shape=SHAPE, dtype=torch.float32, pin_memory=False)
    records, data = chain(400)
    host.put_many(records, ["a"] * 400, list(range(400)), data)
    assert len(host.match([r.block_hash for r in records], [r.token_ids for r in records])) == 400
    assert steps < 20 * 400  # linear in the chain; one put per block walked the chain: ~400² / 2 checks


def test_an_l1_victim_goes_through_to_disk_when_every_l2_slot_is_pinned(tmp_path):
    import queue

    from worker.tiers.store import TierConfig, TieredStore

    pool = torch.randn(4, *SHAPE)
    block_bytes = pool[0].numel() * pool.element_size()
    store = TieredStore(
        TierConfig(l2_bytes=block_bytes, l3_dir=tmp_path, l3_min_free_bytes=0),  # L2 holds one block
        fingerprint=b"host-test",
        kv_cache=pool,
        bytes_per_block=block_bytes,
        prefill_tokens_per_s=lambda: 0.0,
        post=queue.SimpleQueue().put,
    )
    records, data = chain(2)
    (loading,) = store.l2.put_many(records[:1], ["a"], [0], data[:1])
    store.l2.pin([loading])  # a request is copying it into L1 right now
    victim = records[1]
    store.demote_from_l1(
        Block(
            block_id=2,
            block_hash=victim.block_hash,
            parent_hash=victim.parent_hash,
            token_ids=victim.token_ids,
            namespace_id="a",
        )
    )
    store.wait_for_writes()
    assert victim.block_hash in store.disk and victim.block_hash not in store.l2
    _, restored = store.disk.read(*store.disk.index[victim.block_hash], 1)
    assert torch.equal(restored[0], pool[2])
    store.close()
