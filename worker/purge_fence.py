"""Which namespaces were purged after a given moment, so that work started earlier cannot undo a purge.

A purge erases a namespace from every tier, but work that started before it may still hold the
namespace's blocks or compute new ones: a prefetch reading disk or Redis, a request waiting or running.
Each such piece of work carries a *tag* taken when it started (``PurgeFence.tag``); before it offers a
block to a tier, the engine asks ``purged_since(namespace_id, tag)`` and drops the block if so. A purge
fences from the moment it starts until its last tier (Redis, erased off the engine thread) is done: while
a namespace is being purged, ``purged_since`` is True for it whatever the tag, so a prefetch that started
in between, and read Redis before Redis was erased, is dropped too (and after the end, work tagged during
the purge still predates its last step).

Engine thread only (no lock).
"""

from __future__ import annotations

from collections.abc import Iterable


class PurgeFence:
    def __init__(self) -> None:
        self.generation = 0  # bumped at the start and at the end of every purge
        self._purged_at: dict[str, int] = {}  # namespace_id -> generation of its latest purge step
        self._purging: dict[str, int] = {}  # namespace_id -> purges of it under way (overlapping calls)

    def tag(self) -> int:
        """The tag of work starting now."""
        return self.generation

    def purge_started(self, namespace_id: str) -> None:
        self._purging[namespace_id] = self._purging.get(namespace_id, 0) + 1
        self._bump(namespace_id)

    def purge_done(self, namespace_id: str, live_tags: Iterable[int] = ()) -> None:
        """The purge reached every tier; ``live_tags``: tags of the work still under way (to forget the
        purges none of it predates: the record stays as small as the set of recent purges)."""
        left = self._purging.pop(namespace_id, 1) - 1
        if left > 0:
            self._purging[namespace_id] = left
        self._bump(namespace_id)
        oldest = min(live_tags, default=self.generation)
        stale = [ns for ns, generation in self._purged_at.items() if generation <= oldest]
        for ns in [ns for ns in stale if ns not in self._purging]:  # another purge still running: kept
            del self._purged_at[ns]

    def purged_since(self, namespace_id: str, tag: int) -> bool:
        """Was ``namespace_id`` purged (or being purged) after work tagged ``tag`` started?"""
        return namespace_id in self._purging or self._purged_at.get(namespace_id, 0) > tag

    def _bump(self, namespace_id: str) -> None:
        self.generation += 1
        self._purged_at[namespace_id] = self.generation
