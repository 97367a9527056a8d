"""Mooncake-format JSONL traces: parsing, optional fields, round trip."""

import pytest

from bench.trace import TraceRequest, load_trace, num_unique_blocks, parse_request, write_trace


def test_optional_fields_default():
    request = parse_request('{"timestamp": 40, "hash_ids": [1, 2, 3]}')
    assert request == TraceRequest(timestamp_ms=40.0, hash_ids=(1, 2, 3))


def test_missing_required_field_is_an_error():
    with pytest.raises(ValueError, match="hash_ids"):
        parse_request('{"timestamp": 0, "input_length": 10}')


def test_round_trip(tmp_path):
    requests = [
        TraceRequest(timestamp_ms=0.0, hash_ids=(1, 2), tenant="t0", input_length=900, output_length=7),
        TraceRequest(timestamp_ms=1.5, hash_ids=(1, 3)),
    ]
    path = tmp_path / "trace.jsonl"
    write_trace(path, requests)
    assert load_trace(path) == requests
    assert num_unique_blocks(requests) == 3
