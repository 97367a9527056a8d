"""The bundled worker process of ``prefixgate up``: started, watched, restarted with backoff.

- The worker dies with its parent: on Linux it is started with ``PR_SET_PDEATHSIG`` (SIGKILL), so even
  a ``kill -9`` of ``prefixgate up`` leaves no orphan worker holding the port and the data dir.
- When the worker exits on its own, it is restarted after a backoff that doubles up to ``backoff_max_s``
  and starts over once a worker has stayed up ``stable_s``; meanwhile the gateway answers 503.
- ``DataDirLock``: one ``prefixgate up`` per data dir; a second one refuses clearly.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

log = logging.getLogger("prefixgate")

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent_pid: int, prctl: Callable[..., int] | None) -> None:
    """``preexec_fn`` of the worker: the kernel kills it when the parent goes (Linux; a no-op elsewhere).
    ``prctl`` is resolved before the fork: no dynamic loading between fork and exec."""
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _prctl() -> Callable[..., int] | None:
    return ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


class DataDirInUse(RuntimeError):
    pass


class DataDirLock:
    """An exclusive ``flock`` on ``<data dir>/up.lock`` (released by the kernel when the process dies)."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "up.lock"
        self._handle: IO[str] | None = None

    def acquire(self) -> None:
        handle = open(self.path, "a+")  # noqa: SIM115 - held until release()
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise DataDirInUse(
                f"another `prefixgate up` (pid {holder}) is using the data dir {self.path.parent.resolve()}; "
                "stop it first, or give this one its own --data-dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


@dataclass(kw_only=True, slots=True)
class WorkerSupervisor:
    argv: list[str]  # the worker's command line
    env: dict[str, str]
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_s: float = 60.0  # up this long: the next restart waits backoff_initial_s again
    stop_timeout_s: float = 15.0
    process: asyncio.subprocess.Process | None = None
    num_restarts: int = 0
    _started_at: float = field(default=0.0)

    async def start(self) -> asyncio.subprocess.Process:
        self.process = await asyncio.create_subprocess_exec(
            *self.argv, env=self.env, preexec_fn=functools.partial(_die_with_parent, os.getpid(), _prctl())
        )
        self._started_at = time.monotonic()
        return self.process

    async def supervise(self, stop: asyncio.Event) -> None:
        """Restart the worker each time it exits, until ``stop`` is set."""
        backoff_s = self.backoff_initial_s
        while not stop.is_set():
            assert self.process is not None
            if not await _first(self.process.wait(), stop.wait()):
                return
            if time.monotonic() - self._started_at >= self.stable_s:
                backoff_s = self.backoff_initial_s
            log.error(
                "the worker (pid %d) exited with status %s; restarting it in %.0fs",
                self.process.pid,
                self.process.returncode,
                backoff_s,
            )
            if not await _first(asyncio.sleep(backoff_s), stop.wait()):
                return
            await self.start()
            self.num_restarts += 1
            log.info("worker restarted (pid %d, restart %d)", self.process.pid, self.num_restarts)
            backoff_s = min(backoff_s * 2, self.backoff_max_s)

    async def stop(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), self.stop_timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


async def _first(awaitable, stop_awaitable) -> bool:  # type: ignore[no-untyped-def]
    """Wait for ``awaitable`` or for the stop signal; True when ``awaitable`` finished first."""
    work, stopper = asyncio.ensure_future(awaitable), asyncio.ensure_future(stop_awaitable)
    try:
        await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, stopper):
            task.cancel()
    return work.done() and not work.cancelled() and not stopper.done()
