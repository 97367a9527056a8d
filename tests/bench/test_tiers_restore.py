"""bench.tiers restores an L2 chain the way the engine meets it (tail first, scattered slots)."""

import torch

from bench.tiers import restore_l2_chain_gbps, restore_l2_gbps


def test_both_layouts_restore_a_chain():
    shape = (2, 2, 16, 2, 8)  # layers, k/v, block tokens, kv heads, head dim
    assert restore_l2_chain_gbps(shape, torch.float32, 32) > 0
    assert restore_l2_gbps(shape, torch.float32, 32) > 0
