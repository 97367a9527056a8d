"""A private PostgreSQL cluster that a fault test may stop, SIGSTOP or restart without touching the
machine's shared server (initdb + postgres in a temporary directory, on a free port).

PostgreSQL refuses to run as root: as root the cluster runs as the ``postgres`` user (``runuser``).
Tests skip with a clear reason when the server binaries are missing.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_bindir() -> Path | None:
    """The newest PostgreSQL server bin directory (with initdb and postgres), or None."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
    for path in reversed(candidates):
        if (Path(path) / "initdb").exists() and (Path(path) / "postgres").exists():
            return Path(path)
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("postgres") else None


@dataclass(slots=True)
class PrivatePostgres:
    bindir: Path
    datadir: Path
    port: int
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    def _as_owner(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv

    def init(self) -> None:
        self.datadir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            for path in (self.datadir.parent, self.datadir):
                shutil.chown(path, "postgres", "postgres")
        subprocess.run(
            self._as_owner(
                [str(self.bindir / "initdb"), "-D", str(self.datadir), "-U", "postgres", "-A", "trust"]
            ),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def start(self, timeout_s: float = 30.0) -> None:
        argv = [
            str(self.bindir / "postgres"),
            "-D",
            str(self.datadir),
            "-p",
            str(self.port),
            "-h",
            "127.0.0.1",
            "-k",
            str(self.datadir),  # unix socket in the data dir, not /var/run
            "-c",
            "fsync=off",
            "-c",
            "max_connections=50",
        ]
        log = open(self.datadir.parent / "postgres.log", "ab")  # noqa: SIM115 - the child holds it
        self.process = subprocess.Popen(self._as_owner(argv), stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready = subprocess.run(
                [str(self.bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if ready.returncode == 0:
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited ({self.datadir.parent / 'postgres.log'})")
            time.sleep(0.1)
        raise TimeoutError("private postgres did not start")

    def _pids(self) -> list[int]:
        """The postmaster and its children (backends, checkpointer …)."""
        pid_file = self.datadir / "postmaster.pid"
        if not pid_file.exists():
            return []
        postmaster = int(pid_file.read_text().split()[0])
        children = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True, text=True).stdout
        return [postmaster, *(int(pid) for pid in children.split())]

    def stop(self) -> None:
        """Immediate shutdown (like a crash): connections drop, new ones are refused."""
        if self.process is None:
            return
        self.resume()
        pids = self._pids()
        with contextlib.suppress(ProcessLookupError):
            # To the postmaster itself: runuser, our direct child, need not forward signals.
            os.kill(pids[0] if pids else self.process.pid, signal.SIGQUIT)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def pause(self) -> None:
        """SIGSTOP every process of the cluster: connections hang, they are not refused."""
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        # runuser stops itself when its child stops (job control): wake it too, or it never reaps.
        pids = self._pids() + ([self.process.pid] if self.process is not None else [])
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A running private cluster in its own temporary directory (the ``postgres`` user must reach it,
    so not under pytest's 0700 tmp dirs), stopped and removed at exit. LookupError without binaries."""
    bindir = find_bindir()
    if bindir is None:
        raise LookupError("PostgreSQL server binaries (initdb, postgres) not found")
    base = Path(tempfile.mkdtemp(prefix="prefixgate-pg-"))
    cluster = PrivatePostgres(bindir=bindir, datadir=base / "pgdata", port=_free_port())
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
