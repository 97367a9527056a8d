"""bench.tiers restores chains the way the engine meets them: L2 tail first into scattered slots, and L3
and Redis through the engine's own prefetch → L2 offer → copy-in path (issue 14)."""

import os

import pytest
import torch

from bench.tiers import restore_chain_engine_gbps, restore_l2_chain_gbps, restore_l2_gbps, restore_l3_gbps
from worker.tiers.store import TierConfig

SHAPE = (2, 2, 16, 2, 8)  # layers, k/v, block tokens, kv heads, head dim


def test_both_layouts_restore_a_chain():
    assert restore_l2_chain_gbps(SHAPE, torch.float32, 32) > 0
    assert restore_l2_gbps(SHAPE, torch.float32, 32) > 0


@pytest.mark.parametrize("codec", ["none", "int4"])
def test_l3_restore_goes_through_the_engine_path_and_keeps_the_contiguous_figure(tmp_path, codec):
    # 96 blocks through an L2 of 64: most of the chain reaches disk by eviction, in the writer's files.
    tiers = TierConfig(l3_dir=tmp_path / "engine", l3_codec=codec, l3_min_free_bytes=0)
    stages = restore_chain_engine_gbps(tiers, SHAPE, torch.float32, 96, repeats=1)  # asserts all 96 came back
    assert set(stages) == {"gbps", "fetch_gbps", "copy_gbps"} and min(stages.values()) > 0
    assert stages["gbps"] < stages["fetch_gbps"]  # end to end includes the read and the copy
    files = list((tmp_path / "engine").rglob("*.kv"))
    assert len(files) > 96 // 32  # the engine's layout: more, shorter files than one chain per 32 blocks
    assert restore_l3_gbps(tmp_path, codec, SHAPE, torch.float32, 96) > 0


def test_redis_restore_goes_through_the_engine_path():
    url = os.environ.get("PREFIXGATE_TEST_REDIS_URL")
    if not url:
        if os.environ.get("PREFIXGATE_REQUIRE_SERVICES"):
            pytest.fail("PREFIXGATE_TEST_REDIS_URL is required in CI")
        pytest.skip("set PREFIXGATE_TEST_REDIS_URL to run the Redis tier tests")
    import redis

    tiers = TierConfig(remote_url=url, remote_bytes=64 << 20, remote_timeout_s=5.0)
    stages = restore_chain_engine_gbps(tiers, SHAPE, torch.float32, 48, repeats=1)
    assert stages["gbps"] > 0
    client = redis.Redis.from_url(url)
    assert not list(client.scan_iter(match="pg:kv:*:bench:*"))  # the bench erased what it wrote
    client.close()
