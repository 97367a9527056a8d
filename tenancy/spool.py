"""Local spool of usage records that could not reach the database.

JSON lines, appended and fsynced; a torn last line (crash mid-write) is skipped on read. Replay is
idempotent because records are inserted with ON CONFLICT (request_id) DO NOTHING, so a crash between
a replay and the truncation only replays the same records again.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from tenancy.usage_types import UsageEvent

log = logging.getLogger(__name__)


class UsageSpool:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._depth: int | None = None

    def append(self, events: list[UsageEvent]) -> None:
        if not events:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = "".join(json.dumps(event.to_json(), separators=(",", ":")) + "\n" for event in events)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        self._depth = self.depth() if self._depth is None else self._depth + len(events)

    def read(self) -> list[UsageEvent]:
        if not self.path.exists():
            return []
        events: list[UsageEvent] = []
        with open(self.path, encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, 1):
                if not line.endswith("\n"):
                    log.warning("usage spool %s: skipping torn line %d", self.path, line_no)
                    continue
                try:
                    events.append(UsageEvent.from_json(json.loads(line)))
                except (ValueError, KeyError, TypeError):
                    log.warning("usage spool %s: skipping unreadable line %d", self.path, line_no)
        return events

    def clear(self) -> None:
        """Empty the spool (after its records reached the database)."""
        if self.path.exists():
            with open(self.path, "w", encoding="utf-8") as handle:
                handle.flush()
                os.fsync(handle.fileno())
        self._depth = 0

    def depth(self) -> int:
        """Number of records waiting in the spool."""
        if self._depth is None:
            if not self.path.exists():
                self._depth = 0
            else:
                with open(self.path, "rb") as handle:
                    self._depth = sum(1 for line in handle if line.endswith(b"\n"))
        return self._depth
