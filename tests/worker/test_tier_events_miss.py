"""A Redis read that finds blocks this worker announced gone announces them removed (review r16).

After Redis lost its keys (FLUSHALL, a restart without persistence) reads missed every announced block, yet
the worker's KV-event state (what snapshots send) and the gateways kept crediting them until their TTL (an
hour by default). A miss is announced only for blocks not announced stored again since the read began."""

import redis

from tests.worker.test_tier_events import _blocks, _events_tier, held


def _read(tier, blocks):
    hashes = [b.record.block_hash for b in blocks]
    return tier.get_run([b.namespace_id for b in blocks], hashes, [b.record.token_ids for b in blocks])


def test_a_read_that_finds_announced_blocks_gone_announces_them_removed(private_redis):
    port, _ = private_redis
    url = f"redis://127.0.0.1:{port}/0"  # this test's own server: FLUSHALL touches no one else's keys
    tier, log = _events_tier(url, ttl_s=3600)
    blocks, other = _blocks("t-a", 4, 3), _blocks("t-b", 5, 2)
    assert tier.put(blocks) == 3 and tier.put(other) == 2
    redis.Redis.from_url(url).flushall()
    assert _read(tier, blocks) == ([], None)
    assert held(log, "remote") == {b.record.block_hash: "t-b" for b in other}  # only what was read
    assert _read(tier, blocks) == ([], None)
    removed = [e for e in log.since(0).events if e.kind == "BlockRemoved"]
    assert len(removed) == 3  # announced once: a block no longer held is not announced again


def test_a_block_stored_again_while_the_read_ran_stays_announced(kv_redis_url, monkeypatch):
    tier, log = _events_tier(kv_redis_url, fingerprint=b"miss-then-stored" * 2)
    blocks = _blocks("t-a", 6, 2)
    tier.put(blocks)
    tier.client.delete(*[tier.key("t-a", b.record.block_hash) for b in blocks])  # gone, unannounced
    read = tier.client.mget

    def read_then_store(keys):  # the writer stores the blocks again between the read and its miss
        values = read(keys)
        tier.put(blocks)
        return values

    monkeypatch.setattr(tier.client, "mget", read_then_store)
    assert _read(tier, blocks) == ([], None)
    assert held(log, "remote") == {b.record.block_hash: "t-a" for b in blocks}
