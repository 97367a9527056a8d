import numpy as np

from policies.near_miss import reusable, same_keys_tokens, token_lcp

A, B, G = b"a" * 32, b"b" * 32, b"g" * 32


def arr(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def test_token_lcp():
    assert token_lcp(arr(1, 2, 3), arr(1, 2, 4)) == 2
    assert token_lcp(arr(1, 2), arr(1, 2, 3)) == 2
    assert token_lcp(arr(), arr(1)) == 0 and token_lcp(arr(5), arr(6)) == 0


def test_reuse_stops_where_the_keys_differ_even_if_tokens_agree():
    tokens = np.arange(100, dtype=np.int32)
    same = reusable(tokens, ((0, A),), tokens.copy(), ((0, A),), 16)
    assert (same.lcp_tokens, same.reusable_blocks) == (100, 6)
    other_tenant = reusable(tokens, ((0, A),), tokens.copy(), ((0, B),), 16)
    assert other_tenant.lcp_tokens == 100 and other_tenant.reusable_blocks == 0
    # A promoted global prefix of 32 tokens, then each tenant's own key: only the global part is shared.
    promoted = reusable(tokens, ((0, G), (32, A)), tokens.copy(), ((0, G), (32, B)), 16)
    assert promoted.reusable_blocks == 2
    assert same_keys_tokens(((0, G), (32, A)), ((0, G), (48, A))) == 32


def test_partial_block_is_not_reusable():
    a = np.arange(40, dtype=np.int32)
    b = a.copy()
    b[20] = 999
    assert reusable(a, ((0, A),), b, ((0, A),), 16).reusable_blocks == 1
