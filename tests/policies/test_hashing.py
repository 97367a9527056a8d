import numpy as np
import pytest

from policies.hashing import NamespaceSegment, block_hashes, chain_hash, root_hash, tokens_to_bytes
from policies.isolation import (
    GLOBAL_NAMESPACE_ID,
    namespace_segments,
    tenant_namespace_id,
    tenant_namespace_key,
)

FP = b"fingerprint"


def seg(key: bytes, start: int = 0, ns: str = "t") -> NamespaceSegment:
    return NamespaceSegment(start_token=start, namespace_id=ns, key=key)


def test_chain_matches_the_documented_formula():
    import blake3

    tokens = list(range(40))
    hashes = block_hashes(tokens, 16, FP, [seg(b"k" * 32)])
    assert len(hashes) == 2  # the partial third block is not hashed
    h0 = blake3.blake3(
        blake3.blake3(b"prefixgate/v1" + FP + b"k" * 32).digest() + np.arange(16, dtype="<u4").tobytes()
    ).digest()
    assert hashes[0] == h0
    assert hashes[1] == chain_hash(h0, tokens_to_bytes(tokens[16:32]))


def test_equal_prefixes_share_hashes_and_diverge_after_the_first_difference():
    a = block_hashes(list(range(64)), 16, FP, [seg(b"k" * 32)])
    b = block_hashes([*range(40), 999, *range(41, 64)], 16, FP, [seg(b"k" * 32)])
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]


def test_namespace_model_and_block_size_change_every_hash():
    tokens = list(range(64))
    base = block_hashes(tokens, 16, FP, [seg(b"k" * 32)])
    assert not set(base) & set(block_hashes(tokens, 16, FP, [seg(b"j" * 32)]))
    assert not set(base) & set(block_hashes(tokens, 16, b"other-model", [seg(b"k" * 32)]))
    assert not set(base) & set(block_hashes(tokens, 32, FP, [seg(b"k" * 32)]))


def test_second_segment_keeps_the_shared_head_and_privatizes_the_tail():
    tokens = list(range(96))
    shared = block_hashes(tokens, 16, FP, [seg(b"g" * 32, ns="global")])
    tenant_a = block_hashes(tokens, 16, FP, [seg(b"g" * 32, ns="global"), seg(b"a" * 32, 32, "a")])
    tenant_b = block_hashes(tokens, 16, FP, [seg(b"g" * 32, ns="global"), seg(b"b" * 32, 32, "b")])
    assert shared[:2] == tenant_a[:2] == tenant_b[:2]
    assert len({shared[2], tenant_a[2], tenant_b[2]}) == 3


@pytest.mark.parametrize(
    "segments",
    [[], [seg(b"k" * 32, 16)], [seg(b"k" * 32), seg(b"j" * 32, 8)], [seg(b"k" * 32), seg(b"j" * 32, 0)]],
)
def test_invalid_segments_are_rejected(segments):
    with pytest.raises(ValueError):
        block_hashes(list(range(64)), 16, FP, segments)


def test_root_hash_depends_on_both_inputs():
    assert root_hash(FP, b"a") != root_hash(FP, b"b") != root_hash(b"x", b"b")


def test_tenant_keys_are_secret_salted_and_epoch_bound():
    key = tenant_namespace_key(b"salt", "tenant-1", 0)
    assert key != tenant_namespace_key(b"salt", "tenant-1", 1)
    assert key != tenant_namespace_key(b"other salt", "tenant-1", 0)
    assert key != tenant_namespace_key(b"salt", "tenant-2", 0)
    assert tenant_namespace_id(b"salt", "tenant-1") == tenant_namespace_id(b"salt", "tenant-1")
    assert "tenant-1" not in tenant_namespace_id(b"salt", "tenant-1")


def test_isolation_levels_map_to_segments():
    shared = namespace_segments(level="shared", salt=b"s", tenant_id="t", epoch=0)
    assert [s.namespace_id for s in shared] == [GLOBAL_NAMESPACE_ID]
    own = namespace_segments(level="namespace", salt=b"s", tenant_id="t", epoch=0, reserved_blocks=9)
    assert len(own) == 1 and own[0].namespace_id.startswith("t-") and own[0].reserved_blocks == 0
    dedicated = namespace_segments(
        level="dedicated", salt=b"s", tenant_id="t", epoch=0, reserved_blocks=9, promoted_prefix_tokens=32
    )
    assert len(dedicated) == 1 and dedicated[0].reserved_blocks == 9  # never reads the shared pool
    promoted = namespace_segments(
        level="namespace", salt=b"s", tenant_id="t", epoch=0, promoted_prefix_tokens=32
    )
    assert [(s.namespace_id, s.start_token) for s in promoted] == [("promoted", 0), (own[0].namespace_id, 32)]
