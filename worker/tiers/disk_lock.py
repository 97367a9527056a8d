"""Who holds an L3 model directory: one live worker, by an exclusive ``flock`` on its lock file.

Workers of several models may share one ``--l3-dir`` root. Each holds ``<root>/<fingerprint[:16]>/``
(``~worker.lock``) from start to stop; the kernel releases the lock when the process ends, however it
ends. At start-up a worker drops the directories of other fingerprints that nobody holds (a model change
drops the old cache) and leaves held ones alone (another model's live worker). A dropped directory is first
renamed away under its lock, so a worker starting on it at that moment finds its lock file gone and makes
a fresh directory instead of writing into one being deleted. The lock is advisory and local: it does not
protect a directory shared over NFS between hosts, nor from a worker of an older version.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

# Neither name can be a namespace's directory or a model's (``disk._safe_dirname`` never writes "~").
LOCK_NAME = "~worker.lock"
TRASH_PREFIX = "~dropped-"


class DiskInUse(RuntimeError):
    """Another live worker holds this model's L3 directory: the worker refuses to start."""


def _lock(path: Path) -> int | None:
    """An fd holding an exclusive lock on ``path`` (created if absent), or None while another holds it.

    Raises FileNotFoundError when the directory itself is gone."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        here = os.stat(path)
    except FileNotFoundError:
        here = None
    mine = os.fstat(fd)
    if here is None or (here.st_dev, here.st_ino) != (mine.st_dev, mine.st_ino):
        os.close(fd)  # dropped by another worker between our open and our lock: not this directory's
        raise FileNotFoundError(path)
    return fd


def hold(directory: Path, *, mode: int, wait_s: float = 2.0) -> int:
    """Create ``directory`` if needed and hold it for this process; returns the lock's fd (close it to
    let go). Another worker dropping or starting on it may hold it for an instant: waits up to
    ``wait_s`` for that, then raises DiskInUse (a live worker of the same model uses it)."""
    deadline = time.monotonic() + wait_s
    while True:
        directory.mkdir(parents=True, exist_ok=True, mode=mode)
        try:
            fd = _lock(directory / LOCK_NAME)
        except FileNotFoundError:  # dropped under us (it was another model's or stale): make it again
            if time.monotonic() >= deadline + 5.0:
                raise
            continue
        if fd is not None:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        if time.monotonic() >= deadline:
            holder = (directory / LOCK_NAME).read_text(errors="replace").strip() or "?"
            raise DiskInUse(
                f"the L3 directory {directory} is in use by another worker of the same model (pid {holder}): "
                "give each worker its own --l3-dir (PREFIXGATE_WORKER_L3_DIR) or data dir"
            )
        time.sleep(0.05)


def drop_unheld(directory: Path, root: Path) -> int | None:
    """Delete another model's directory unless a live worker holds it; returns the ``.kv`` files it held
    (None: held, kept)."""
    try:
        fd = _lock(directory / LOCK_NAME)
    except FileNotFoundError:
        return 0  # dropped by another worker meanwhile
    except OSError:
        return None  # not ours to judge (unreadable): kept
    if fd is None:
        return None
    trash = root / f"{TRASH_PREFIX}{directory.name}-{os.urandom(4).hex()}"
    try:
        num_files = sum(1 for _ in directory.rglob("*.kv"))
        directory.rename(trash)
    except OSError:
        return None
    finally:
        os.close(fd)
    shutil.rmtree(trash, ignore_errors=True)
    return num_files


def sweep_trash(root: Path) -> None:
    """Finish deleting what an interrupted drop left (renamed away, so no worker holds it)."""
    for path in root.iterdir():
        if path.name.startswith(TRASH_PREFIX):
            with contextlib.suppress(OSError):
                shutil.rmtree(path)
