"""max_min_shares: the water-filling that shares a tier's reservable capacity among dedicated owners."""

from policies.fair_share import max_min_shares


def test_small_asks_are_served_whole_and_the_rest_split_evenly():
    assert max_min_shares({"a": 1000, "b": 8}, 32) == {"a": 24, "b": 8}
    assert max_min_shares({"a": 10, "b": 10, "c": 10}, 16) == {"a": 5, "b": 5, "c": 6}


def test_shares_never_exceed_the_capacity_nor_an_ask():
    asks = {"a": 7, "b": 3, "c": 50, "d": 0}
    shares = max_min_shares(asks, 40)
    assert shares == {"a": 7, "b": 3, "c": 30}  # d asks nothing: no share
    assert max_min_shares(asks, 0) == {} and max_min_shares({}, 10) == {}
    assert sum(max_min_shares({"a": 5, "b": 5}, 3).values()) == 3
