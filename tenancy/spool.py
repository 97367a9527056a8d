"""Local spool of usage records that could not reach the database.

JSON lines, appended and fsynced; a torn last line (crash mid-write) is skipped on read. Replay is
idempotent because records are inserted with ON CONFLICT (request_id) DO NOTHING, so a crash between
a replay and the truncation only replays the same records again.

Replay never reads the spool whole: ``start_replay`` moves the file aside (``*.replaying.jsonl``, an
atomic rename, so new records keep being appended to a fresh spool) and ``replay_batches`` streams it
in bounded batches from a byte offset the caller advances once a batch is stored. A replay cut short
(the database went away again, the process died) resumes from that offset, or from the start of the
moved-aside file after a restart, which is harmless.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tenancy.usage_types import UsageEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class SpoolBatch:
    events: list[UsageEvent]
    end_offset: int  # byte offset just after the batch in the replaying file
    num_lines: int  # lines consumed (unreadable ones included)


def _decode(path: Path, line_no: int, line: bytes) -> UsageEvent | None:
    if not line.endswith(b"\n"):
        log.warning("usage spool %s: skipping torn line %d", path, line_no)
        return None
    try:
        return UsageEvent.from_json(json.loads(line))
    except (ValueError, KeyError, TypeError):
        log.warning("usage spool %s: skipping unreadable line %d", path, line_no)
        return None


def _count_lines(path: Path, offset: int = 0) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as handle:
        handle.seek(offset)
        return sum(1 for line in handle if line.endswith(b"\n"))


class UsageSpool:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.replay_path = path.with_name(path.stem + ".replaying" + (path.suffix or ".jsonl"))
        self._depth: int | None = None

    def append(self, events: list[UsageEvent]) -> None:
        """Append and fsync; raises OSError (disk full, read-only…) with nothing half-counted."""
        if not events:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = "".join(json.dumps(event.to_json(), separators=(",", ":")) + "\n" for event in events)
        with open(self.path, "a", encoding="utf-8") as handle:
            start = handle.tell()
            try:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            except OSError:
                # Cut the partial write off so that a later append starts on a clean line.
                with contextlib.suppress(OSError):
                    handle.truncate(start)
                raise
        if self._depth is not None:
            self._depth += len(events)

    def read(self) -> list[UsageEvent]:
        """Every record of the spool file (small spools and tests; replay streams instead)."""
        if not self.path.exists():
            return []
        with open(self.path, "rb") as handle:
            decoded = (_decode(self.path, no, line) for no, line in enumerate(handle, 1))
            return [event for event in decoded if event is not None]

    def rewrite(self, events: list[UsageEvent]) -> None:
        """Replace the spool's content atomically (write a temporary file, fsync, rename)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = "".join(json.dumps(event.to_json(), separators=(",", ":")) + "\n" for event in events)
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)
        self._depth = None

    def clear(self) -> None:
        """Empty the spool (after its records reached the database)."""
        for path in (self.path, self.replay_path):
            path.unlink(missing_ok=True)
        self._depth = 0

    def start_replay(self) -> bool:
        """Move the spool aside for replay unless a replay is already under way; whether there is one."""
        if not self.replay_path.exists():
            if not self.path.exists() or self.path.stat().st_size == 0:
                return False
            os.replace(self.path, self.replay_path)
        return True

    def replay_batches(self, offset: int, batch_size: int) -> Iterator[SpoolBatch]:
        """Batches of at most ``batch_size`` records of the moved-aside file, from byte ``offset``."""
        if not self.replay_path.exists():
            return
        with open(self.replay_path, "rb") as handle:
            handle.seek(offset)
            events: list[UsageEvent] = []
            num_lines = 0
            for line in iter(handle.readline, b""):
                num_lines += 1
                event = _decode(self.replay_path, num_lines, line)
                if event is not None:
                    events.append(event)
                if len(events) >= batch_size:
                    yield SpoolBatch(events=events, end_offset=handle.tell(), num_lines=num_lines)
                    events, num_lines = [], 0
            if num_lines:
                yield SpoolBatch(events=events, end_offset=handle.tell(), num_lines=num_lines)

    def consumed(self, num_lines: int) -> None:
        """A replayed batch reached the database."""
        if self._depth is not None:
            self._depth = max(self._depth - num_lines, 0)

    def finish_replay(self) -> None:
        self.replay_path.unlink(missing_ok=True)
        self._depth = None

    def depth(self, replay_offset: int = 0) -> int:
        """Number of records waiting: in the spool, plus the rest of a replay under way."""
        if self._depth is None:
            self._depth = _count_lines(self.path) + _count_lines(self.replay_path, replay_offset)
        return self._depth
