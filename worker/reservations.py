"""Dedicated owners' reservations over time: released when idle, kept across a restart.

The block manager grants reservations from what requests ask (``BlockManager.set_reservation``), and L2,
L3 and Redis follow its grants. Two gaps closed here (engine thread only):

- An owner that stops sending requests used to keep its share until the worker restarted, shrinking
  everyone else's. A reservation not asked for ``idle_s`` is released (``tick``), as if the owner had
  left ``dedicated``; its next request takes it again.
- A restart forgot every reservation until each owner's first request, so its files on disk were open to
  eviction by the first other owner writing. The requests (blocks asked, and when last) are saved next to
  the disk tier's files (``~reservations.json``) and asked again at start-up, idle ones excepted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from worker.block_manager import BlockManager
from worker.protocol import BadRequest, parse_namespace_id

log = logging.getLogger("prefixgate.worker.reservations")
FILE_NAME = "~reservations.json"  # "~": never a namespace's directory name (tiers.disk._safe_dirname)
MAX_SAVED_BLOCKS = 2**53  # beyond any L1: a request for more is granted the same (saved as this many)
SAVE_EVERY_S = 30.0  # how stale the saved "last asked" times may get (a crash loses at most this much)


class ReservationKeeper:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        idle_s: float,
        directory: Path | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.block_manager = block_manager
        self.idle_s = idle_s  # 0: never released for idleness
        self.path = directory / FILE_NAME if directory is not None else None
        self.clock = clock  # wall time: it is compared across restarts
        self.asked_at: dict[str, float] = {}  # namespace -> when a request last asked for its reservation
        self._dirty = False
        self._next_tick = 0.0

    def ask(self, namespace_id: str, num_blocks: int) -> None:
        """A request's segment asks for ``num_blocks`` (0: its owner is not dedicated, or not any more)."""
        before = self.block_manager.requested_blocks.get(namespace_id, 0)
        self.block_manager.set_reservation(namespace_id, num_blocks)
        if num_blocks > 0:
            self.asked_at[namespace_id] = self.clock()
            self._dirty = True
        elif namespace_id in self.asked_at:
            del self.asked_at[namespace_id]
            self._dirty = True
        if before != max(0, num_blocks):
            self.save()

    def tick(self) -> None:
        """Release reservations idle for ``idle_s`` and save the times now and then (cheap when not due)."""
        now = self.clock()
        if now < self._next_tick and len(self.asked_at) == len(self.block_manager.requested_blocks):
            return
        self._next_tick = now + min(SAVE_EVERY_S, self.idle_s / 4 if self.idle_s > 0 else SAVE_EVERY_S)
        for namespace_id in [ns for ns in self.asked_at if ns not in self.block_manager.requested_blocks]:
            del self.asked_at[namespace_id]  # released meanwhile (purged): saved without it below
            self._dirty = True
        if self.idle_s > 0:
            idle = sorted(ns for ns, asked in self.asked_at.items() if now - asked >= self.idle_s)
            if idle:  # all at once: the grants shared once and the file written once, not once per owner
                log.info(
                    "releasing %d reservations not asked for %.0f s: %s",
                    len(idle),
                    self.idle_s,
                    ", ".join(idle[:5])[:200],
                )
                self.block_manager.set_reservations(dict.fromkeys(idle, 0))
                for namespace_id in idle:
                    del self.asked_at[namespace_id]
                self._dirty = True
        if self._dirty:
            self.save()

    def restore(self) -> None:
        """Ask again for the reservations saved by the last run, except those idle since (start-up).

        Each entry is checked on its own (the file may be damaged or hostile: ``Infinity``, ``1e400``,
        10**400): a bad one is dropped with one warning for all, the others are kept; never raises."""
        if self.path is None:
            return
        try:
            saved = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("ignoring unreadable %s: %s", self.path, exc)
            return
        if not isinstance(saved, dict):
            log.warning("ignoring %s: not an object", self.path)
            return
        entries = [(ns, _valid_entry(ns, entry)) for ns, entry in saved.items()]
        bad = sorted(ns for ns, entry in entries if entry is None)
        if bad:
            log.warning("dropping %d bad entries of %s: %s", len(bad), self.path, ", ".join(bad[:5])[:200])
        now = self.clock()
        kept = {
            ns: entry
            for ns, entry in entries
            if entry is not None and entry[0] > 0 and (self.idle_s <= 0 or now - entry[1] < self.idle_s)
        }
        self.block_manager.set_reservations({ns: num_blocks for ns, (num_blocks, _) in kept.items()})
        self.asked_at.update({ns: min(asked_at, now) for ns, (_, asked_at) in kept.items()})
        self.save()

    def save(self) -> None:
        """Write the requests and their times (atomically; a failure loses only the restart's memory)."""
        self._dirty = False
        if self.path is None:
            return
        requested = self.block_manager.requested_blocks
        entries = {
            ns: {"blocks": min(requested[ns], MAX_SAVED_BLOCKS), "asked_at": asked}
            for ns, asked in self.asked_at.items()
            if ns in requested
        }
        tmp = self.path.with_suffix(".json.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                json.dump(entries, handle)
            tmp.replace(self.path)
        except OSError as exc:
            log.warning("could not save the reservations to %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()


def _valid_entry(namespace_id: object, entry: object) -> tuple[int, float] | None:
    """(blocks, asked_at) of a saved entry, or None when it is not one ``save`` could have written."""
    if not isinstance(entry, dict):
        return None
    num_blocks, asked_at = entry.get("blocks"), entry.get("asked_at")
    try:
        parse_namespace_id(namespace_id)
    except BadRequest:
        return None
    if type(num_blocks) is not int or not 0 <= num_blocks <= MAX_SAVED_BLOCKS:
        return None
    if type(asked_at) not in (int, float):
        return None
    try:
        asked_at = float(asked_at)
    except OverflowError:
        return None
    return (num_blocks, asked_at) if math.isfinite(asked_at) else None
