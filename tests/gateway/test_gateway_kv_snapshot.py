"""A gateway that connects after the worker's KV-event ring overflowed (a disk larger than the ring,
announced at start-up) rebuilds its index from the worker's snapshot, with a real worker process."""

from __future__ import annotations

import random

import aiohttp

from gateway.app import create_app
from gateway.state import PREFIX_INDEX
from policies.hashing import NamespaceSegment, block_hashes
from tests.gateway.conftest import make_config
from tests.gateway.test_gateway_e2e import MODEL
from tests.gateway.test_gateway_routing_kv import wait_until
from tests.worker_process import worker_process

BLOCK = 16
KEY = "00112233445566778899aabbccddeeff"
NAMESPACE = "t-snap"


async def get_json(session: aiohttp.ClientSession, url: str, **query) -> dict:
    async with session.get(url, params={k: str(v) for k, v in query.items()}) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_a_late_gateway_learns_a_disk_larger_than_the_event_ring(aiohttp_client, sqlite_url, tmp_path):
    args = ["--model", MODEL, "--num-blocks", "64", "--max-model-len", "512", "--l2-bytes", "0"]
    args += ["--l3-dir", str(tmp_path / "disk"), "--l3-min-free-bytes", "0"]
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 200) for _ in range(4 * BLOCK + 3)] for _ in range(6)]
    with worker_process(*args, log_path=tmp_path / "first.log") as url:
        async with aiohttp.ClientSession() as session:
            for i, prompt in enumerate(prompts):
                payload = {
                    "request_id": f"snap-{i}",
                    "prompt_token_ids": prompt,
                    "namespace": [{"start_token": 0, "namespace_id": NAMESPACE, "key": KEY}],
                    "sampling": {"max_tokens": 1, "temperature": 0},
                }
                async with session.post(f"{url}/v1/generate", json=payload) as response:
                    assert response.status == 200, await response.text()
    # A clean stop wrote the 24 blocks to disk; the restarted worker announces them in a ring of 8.
    with worker_process(*args, "--kv-events-capacity", "8", log_path=tmp_path / "second.log") as url:
        async with aiohttp.ClientSession() as session:
            info = await get_json(session, f"{url}/v1/info")
            segments = [NamespaceSegment(start_token=0, namespace_id=NAMESPACE, key=bytes.fromhex(KEY))]
            fingerprint = bytes.fromhex(info["model_fingerprint"])
            expected = [block_hashes(p, BLOCK, fingerprint, segments) for p in prompts]
            on_disk = {x.hex() for hashes in expected for x in hashes}
            # The wire: pages of at most 5 blocks, chained by the cursor, all at one sequence number.
            page = await get_json(session, f"{url}/v1/kv_events", since=0, max_events=5)
            assert page["reset"] and page["snapshot"]["num_blocks"] >= 24
            seen, seqs = [], set()
            while True:
                seen += [(e["medium"], x) for e in page["events"] for x in e["block_hashes"]]
                seqs.add(page["snapshot"]["seq"])
                if page["snapshot"]["next"] is None:
                    break
                page = await get_json(
                    session, f"{url}/v1/kv_events", since=0, max_events=5, snapshot=page["snapshot"]["next"]
                )
                assert not page["reset"] and len({x for e in page["events"] for x in e["block_hashes"]}) <= 5
            assert len(seqs) == 1 and on_disk <= {x for medium, x in seen if medium == "L3"}
        client = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(url,))))
        index = client.app[PREFIX_INDEX]
        names = [NAMESPACE] * 4

        def known() -> list[int]:
            return [index.match(url, hashes, names).num_blocks for hashes in expected]

        await wait_until(lambda: known() == [4] * 6, timeout_s=15)
        state = index.workers[url]
        assert state.snapshot_cursor is None and state.last_seq >= page["snapshot"]["seq"]
        assert {m for x in on_disk for m in state.blocks[bytes.fromhex(x)].media} == {"L3"}


def test_index_rebuilds_from_snapshot_pages_then_follows_the_events_after_them():
    from gateway.kv_index import PrefixIndex

    index = PrefixIndex()
    h = [bytes([i]) * 32 for i in range(6)]
    old = {"seq": 1, "type": "BlockStored", "medium": "L1", "block_hashes": [h[5].hex()], "namespace_id": "t"}
    index.apply("http://w", {"worker_id": "w", "last_seq": 1, "events": [old]})

    def page(hashes, parent, cursor, reset):
        event = {"type": "BlockStored", "medium": "L3", "namespace_id": "t", "parent_block_hash": parent}
        event["block_hashes"] = [x.hex() for x in hashes]
        snapshot = {"seq": 40, "next": cursor, "num_blocks": 4}
        return {"worker_id": "w", "last_seq": 45, "reset": reset, "events": [event], "snapshot": snapshot}

    index.apply("http://w", page(h[:2], None, "s:2", reset=True))  # forgets what it knew (h[5])
    assert index.snapshot_cursor("http://w") == "s:2" and index.position("http://w") == ("w", 40)
    assert index.match("http://w", [h[5]], ["t"]).num_blocks == 0
    index.apply("http://w", page(h[2:4], h[1].hex(), None, reset=False))
    assert index.snapshot_cursor("http://w") is None and index.position("http://w") == ("w", 40)
    assert index.match("http://w", h[:4], ["t"] * 4).num_blocks == 4
    assert index.workers["http://w"].write_pressure_blocks == 0  # a state transfer is not new writes
    removed = {"seq": 41, "type": "BlockRemoved", "medium": "L3", "block_hashes": [h[2].hex()]}
    index.apply("http://w", {"worker_id": "w", "last_seq": 45, "events": [removed]})
    assert index.match("http://w", h[:4], ["t"] * 4).num_blocks == 2 and index.position("http://w")[1] == 41
