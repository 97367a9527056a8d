"""Request traces in the Mooncake JSONL format, the simulator's and workload generator's common input.

One JSON object per line: ``timestamp`` (ms), ``hash_ids`` (one id per full KV block, chained: equal ids
at the same position mean equal prefixes), and optionally ``tenant``, ``input_length`` and
``output_length`` (tokens).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: float  # arrival time
    hash_ids: tuple[int, ...]  # block ids of the prompt's full blocks, in prompt order
    tenant: str = ""  # owner; "" when the trace has no tenants
    input_length: int = 0  # prompt tokens (0: unknown)
    output_length: int = 0  # completion tokens (0: unknown)

    def to_json(self) -> str:
        record: dict[str, object] = {"timestamp": self.timestamp_ms}
        if self.tenant:
            record["tenant"] = self.tenant
        record.update(
            input_length=self.input_length, output_length=self.output_length, hash_ids=list(self.hash_ids)
        )
        return json.dumps(record, separators=(",", ":"))


def parse_request(line: str) -> TraceRequest:
    """One JSONL line as a request; raises ValueError when ``timestamp`` or ``hash_ids`` is missing."""
    record = json.loads(line)
    try:
        return TraceRequest(
            timestamp_ms=float(record["timestamp"]),
            hash_ids=tuple(int(h) for h in record["hash_ids"]),
            tenant=str(record.get("tenant", "")),
            input_length=int(record.get("input_length", 0)),
            output_length=int(record.get("output_length", 0)),
        )
    except KeyError as missing:
        raise ValueError(f"trace line lacks {missing}") from None


def load_trace(path: str | Path) -> list[TraceRequest]:
    """All requests of a JSONL trace file, in file order."""
    with open(path, encoding="utf-8") as lines:
        return [parse_request(line) for line in lines if line.strip()]


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    """Write requests as JSONL (the format ``load_trace`` reads)."""
    with open(path, "w", encoding="utf-8") as out:
        for request in requests:
            out.write(request.to_json() + "\n")


def num_unique_blocks(requests: Sequence[TraceRequest]) -> int:
    """Distinct block ids in the trace: the reference for capacities given as fractions."""
    return len({h for request in requests for h in request.hash_ids})
