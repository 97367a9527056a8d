"""A watchdog on the engine thread's progress, read by ``GET /healthz``.

The engine thread reports progress every time it finishes a command or a step, and that it is idle when
it has nothing to do. Work that arrives (from the event loop) starts the clock if the thread was idle,
so a command that never completes is caught as well as a step that never returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True, kw_only=True)
class StepWatchdog:
    stall_timeout_s: float  # pending work without progress for longer than this: unhealthy
    clock: Callable[[], float] = time.monotonic
    busy_since_s: float | None = None  # last progress while work was pending; None while idle

    def progress(self) -> None:
        """The engine thread completed a command or a step (engine thread)."""
        self.busy_since_s = self.clock()

    def idle(self) -> None:
        """The engine thread has nothing to do and waits for commands (engine thread)."""
        self.busy_since_s = None

    def work_arrived(self) -> None:
        """A command was queued for the engine thread (any thread)."""
        if self.busy_since_s is None:
            self.busy_since_s = self.clock()

    def stalled_for_s(self) -> float:
        busy_since_s = self.busy_since_s  # read once: the engine thread may reset it meanwhile
        return 0.0 if busy_since_s is None else max(0.0, self.clock() - busy_since_s)

    def problem(self) -> str | None:
        """Why the engine counts as stuck, or None while it makes progress."""
        stalled_s = self.stalled_for_s()
        if stalled_s > self.stall_timeout_s:
            return f"engine made no progress for {stalled_s:.1f} s with work pending"
        return None
