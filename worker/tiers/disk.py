"""L3: compressed, persistent KV on local disk.

Layout: ``<root>/<fingerprint[:16]>/<namespace_id>/<first block hash>.kv``. Each file is one entry
(``worker.tiers.entry``): a run of consecutive blocks of one chain, written atomically (temp file, fsync,
rename). On start the index is rebuilt from the headers; files of another model fingerprint, corrupt or
truncated files are deleted and counted. Files are the eviction unit, leaf-first: a file whose blocks are
the parents of another file's first block stays until that file is gone. Every file registered
(written, or found at start-up) and dropped (evicted, purged, damaged) is published as ``L3`` KV events.
Thread-safe: the writer thread,
prefetch readers and the engine thread share it under one lock.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from policies.eviction import BlockId, BlockMeta, make_policy
from policies.fair_share import max_min_shares
from policies.hashing import BlockHash
from worker.kv_events import TierEvents
from worker.tiers import disk_lock
from worker.tiers.at_rest import AtRestCipher
from worker.tiers.codec import entry_codec, get_codec
from worker.tiers.entry import (
    PREFIX_BYTES,
    BlockRecord,
    CorruptEntry,
    EntryHeader,
    decode_header,
    encode_entry,
    header_bytes,
    payloads,
)
from worker.tiers.host import DemotedBlock

log = logging.getLogger("prefixgate.worker.disk")
_NS_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
MAX_DIRNAME_CHARS = 128  # well under NAME_MAX (255 bytes on the usual file systems)
# A sane bound on one file's header (it lists each block's token ids): 32 blocks of 4,096 tokens of
# 10-digit ids are ~1.5 MB. A header claiming more, or more than its file, is corrupt.
MAX_HEADER_BYTES = 64 << 20
DIR_MODE = 0o700  # KV files hold tenants' prompts (token ids, keys/values): owner only
FILE_MODE = 0o600


@dataclass(slots=True)
class DiskFile:
    file_id: int
    path: Path
    namespace_id: str
    num_bytes: int
    records: tuple[BlockRecord, ...]
    num_child_files: int = 0  # files whose first block's parent is one of this file's blocks


def _safe_dirname(namespace_id: str) -> str:
    """The directory of a namespace's files: the id itself when it is a plain short name, else a hex form.

    Never longer than a file name may be: a longer one failed every write with ENAMETOOLONG, which
    paused the tier for every namespace. The files' headers, not this name, say whose they are.
    """
    if len(namespace_id) <= MAX_DIRNAME_CHARS and set(namespace_id) <= _NS_SAFE and namespace_id.strip("."):
        return namespace_id
    name = "ns-" + namespace_id.encode().hex()
    if len(name) <= MAX_DIRNAME_CHARS:
        return name
    return "ns-h-" + hashlib.sha256(namespace_id.encode()).hexdigest()


def group_runs(blocks: Sequence[DemotedBlock], max_blocks: int) -> list[list[DemotedBlock]]:
    """Split blocks into chains of consecutive blocks (same namespace), at most ``max_blocks`` each."""
    by_hash = {b.record.block_hash: b for b in blocks}
    children: dict[BlockHash, list[DemotedBlock]] = {}
    for b in blocks:
        parent = by_hash.get(b.record.parent_hash) if b.record.parent_hash else None
        if parent is not None and parent.namespace_id == b.namespace_id:
            children.setdefault(parent.record.block_hash, []).append(b)
    has_parent = {kid.record.block_hash for kids in children.values() for kid in kids}
    starts = [b for b in blocks if b.record.block_hash not in has_parent]
    runs: list[list[DemotedBlock]] = []
    pending = list(starts)
    while pending:
        run = [pending.pop(0)]
        while len(run) < max_blocks and (kids := children.get(run[-1].record.block_hash)):
            run.append(kids[0])
            pending.extend(kids[1:])
        if len(run) == max_blocks and (kids := children.get(run[-1].record.block_hash)):
            pending.extend(kids)
        runs.append(run)
    return runs


def _parents_first(
    found: Sequence[tuple[Path, EntryHeader, int]],
) -> list[tuple[Path, EntryHeader, int]]:
    """Files in an order where a file whose first block continues another file's blocks comes after it.

    File names are block hashes, so a directory scan meets a chain's files in random order; registering
    a child before its parent left the parent's child count wrong (and the child stranded from it).
    """
    owner = {}  # block hash -> index of the first file found holding it
    for i, (_, header, _) in enumerate(found):
        for record in header.blocks:
            owner.setdefault(record.block_hash, i)
    children: dict[int, list[int]] = {}
    roots = []
    for i, (_, header, _) in enumerate(found):
        parent = owner.get(header.blocks[0].parent_hash) if header.blocks[0].parent_hash else None
        if parent is None or parent == i:
            roots.append(i)
        else:
            children.setdefault(parent, []).append(i)
    order, seen = [], set()
    for start in [*roots, *range(len(found))]:  # the second pass takes whatever a cycle left out
        stack = [start]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            order.append(found[i])
            stack.extend(reversed(children.get(i, [])))
    return order


class DiskTier:
    def __init__(
        self,
        root: Path,
        *,
        budget_bytes: int,
        fingerprint: bytes,
        codec: str,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        eviction_policy: str = "default",
        max_blocks_per_file: int = 32,
        pause_after_error_s: float = 30.0,
        min_free_bytes: int = 256 << 20,
        cipher: AtRestCipher | None = None,
        events: TierEvents | None = None,
    ) -> None:
        self.dir = root / fingerprint.hex()[:16]
        self.events = events  # KV events ("L3"): every file registered or dropped, start-up scan included
        self.fingerprint = fingerprint
        self.codec = get_codec(codec)
        self.block_shape = block_shape
        self.dtype = dtype
        self.budget_bytes = budget_bytes
        self.max_blocks_per_file = max_blocks_per_file
        self.pause_after_error_s = pause_after_error_s
        self.cipher = cipher  # entries sealed per namespace (AES-GCM) when set
        self.min_free_bytes = min_free_bytes  # the tier counts the disk as full below this much free space
        self.requested_bytes: dict[str, int] = {}  # namespace -> bytes its reservation asks for
        self.reserved_bytes: dict[str, int] = {}  # namespace -> bytes protected from other owners (granted)
        self._bytes_by_ns: Counter[str] = Counter()
        self.block_payload_bytes = self.codec.payload_bytes(block_shape, dtype)
        capacity_files = max(16, budget_bytes // max(1, self.block_payload_bytes * max_blocks_per_file // 2))
        self.policy = make_policy(eviction_policy, capacity_files)
        self.files: dict[int, DiskFile] = {}
        self.index: dict[BlockHash, tuple[int, int]] = {}  # block hash -> (file id, position in file)
        self.num_bytes = 0
        self.counters: Counter[str] = Counter()
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._paused_until = 0.0
        # Held while this worker runs (DiskInUse if a live worker of this model holds it): no other
        # worker deletes it as a foreign model's cache, and no second worker of this model shares it.
        self._lock_fd: int | None = disk_lock.hold(self.dir, mode=DIR_MODE)
        try:
            for directory in (root, self.dir):  # cached prompts: the worker's user only
                directory.chmod(DIR_MODE)
            self._scan(root)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let go of the directory (worker stop): another worker may use it, or drop it as foreign."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---- start-up ------------------------------------------------------------------------------
    def _scan(self, root: Path) -> None:
        disk_lock.sweep_trash(root)
        for other in root.iterdir():
            if other.is_dir() and other != self.dir and len(other.name) == 16:
                dropped = disk_lock.drop_unheld(other, root)  # another model's cache, unless it is live
                if dropped is None:
                    self.counters["foreign_live_kept_total"] += 1
                    log.info("kept %s: a live worker of another model holds it", other)
                else:
                    self.counters["foreign_deleted_total"] += dropped
        found: list[tuple[Path, EntryHeader, int]] = []
        for path in sorted(self.dir.rglob("*")):
            if path.is_dir():
                path.chmod(DIR_MODE)  # written by an older version with the umask's mode
            elif path.suffix == ".kv":
                path.chmod(FILE_MODE)
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)
            elif path.suffix == ".kv":
                try:
                    size = path.stat().st_size
                    with path.open("rb") as handle:
                        head = handle.read() if self.cipher else self._read_header(handle, size)
                    entry_bytes = size
                    if self.cipher is not None:  # a file in clear is not trusted either: deleted
                        _, head = self.cipher.open(head)
                        entry_bytes = len(head)
                    header = decode_header(head, fingerprint=self.fingerprint)
                    if entry_bytes != header.total_bytes:
                        raise CorruptEntry("file size does not match its header")
                    entry_codec(header, self.block_shape, self.dtype)
                except (CorruptEntry, OSError) as exc:
                    log.warning("deleting unreadable KV file %s: %s", path, exc)
                    path.unlink(missing_ok=True)
                    self.counters["corrupt_deleted_total"] += 1
                    continue
                found.append((path, header, size))
        # Announced once trimmed to the budget: a disk found fuller than a smaller new budget used to be
        # announced whole, then its evictions, a batch the gateway's index refused as hostile.
        events, self.events = self.events, None
        try:
            for path, header, size in _parents_first(found):
                self._register(path, header.namespace_id, header.blocks, size)
            self.counters["files_recovered_total"] = len(self.files)
            self._make_room(0, writer="")  # restarted with a smaller budget than the files found
        finally:
            self.events = events
        if events is not None:
            for info in self.files.values():  # parents first, as registered
                events.stored(info.namespace_id, info.records)

    @staticmethod
    def _read_header(handle: BinaryIO, size: int) -> bytes:
        """A file's header, exactly (its length is in the fixed prefix). Raises CorruptEntry."""
        head = handle.read(PREFIX_BYTES)
        num_bytes = header_bytes(head)
        if num_bytes > min(size, MAX_HEADER_BYTES):
            raise CorruptEntry(f"entry header of {num_bytes} bytes in a file of {size}")
        return head + handle.read(num_bytes - len(head))

    # ---- index ---------------------------------------------------------------------------------
    def _register(self, path: Path, namespace_id: str, records: Sequence[BlockRecord], size: int) -> None:
        """Index one file; a duplicate of what the index holds is deleted, unless a registered file uses
        its path (the same first block: the same name)."""
        with self._lock:
            if any(r.block_hash in self.index for r in records):
                if all(info.path != path for info in self.files.values()):
                    path.unlink(missing_ok=True)  # a duplicate of what another file holds
                return
            file_id = next(self._ids)
            self.files[file_id] = DiskFile(file_id, path, namespace_id, size, tuple(records))
            for pos, record in enumerate(records):
                self.index[record.block_hash] = (file_id, pos)
            parent = records[0].parent_hash
            parent_file = self.index.get(parent) if parent else None
            if parent_file is not None:
                self.files[parent_file[0]].num_child_files += 1
            self.num_bytes += size
            self._bytes_by_ns[namespace_id] += size
            meta = BlockMeta(
                position=0, parent=BlockId(parent_file[0]) if parent_file else None, namespace_id=namespace_id
            )
            self.policy.on_insert(BlockId(file_id), meta, time.monotonic())
            if self.events is not None:  # under the lock: events come in the order the index changed
                self.events.stored(namespace_id, records)

    def _drop(self, file_id: int, *, unlink: bool = True) -> int:
        """Forget (and delete) one file; returns its number of blocks. Caller holds the lock."""
        info = self.files.pop(file_id)
        for record in info.records:
            self.index.pop(record.block_hash, None)
        parent = info.records[0].parent_hash
        if parent and parent in self.index:
            parent_info = self.files[self.index[parent][0]]
            parent_info.num_child_files = max(0, parent_info.num_child_files - 1)
        self.num_bytes -= info.num_bytes
        self._bytes_by_ns[info.namespace_id] -= info.num_bytes
        if file_id in self.policy:
            self.policy.on_remove(BlockId(file_id))
        if unlink:
            info.path.unlink(missing_ok=True)
        if self.events is not None:  # evicted, purged, damaged or forgotten: gone from the index
            self.events.removed(record.block_hash for record in info.records)
        return len(info.records)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.index

    def match(
        self, hashes: Sequence[BlockHash], token_blocks: Sequence[Sequence[int]]
    ) -> list[tuple[int, int]]:
        """(file, position) of the longest run of ``hashes`` held here, from the first one on."""
        found = []
        with self._lock:
            for block_hash, tokens in zip(hashes, token_blocks, strict=False):
                where = self.index.get(block_hash)
                if where is None or self.files[where[0]].records[where[1]].token_ids != tuple(tokens):
                    break
                found.append(where)
        return found

    # ---- reads ---------------------------------------------------------------------------------
    def will_need(self, file_ids: Sequence[int]) -> None:
        """Tell the kernel these files are about to be read, so it reads them ahead in parallel.

        Reading one file after another otherwise pays each file's latency in turn: measured here, a cold
        run of 1 MB files went from 0.57 to 1.39 GB/s (the raw sequential read of one large file).
        """
        with self._lock:
            paths = [self.files[f].path for f in file_ids if f in self.files]
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def read(self, file_id: int, first: int, count: int) -> tuple[list[BlockRecord], torch.Tensor]:
        """Decode blocks ``first … first+count-1`` of one file.

        Raises CorruptEntry (after deleting the file) when it is damaged, or when it was evicted meanwhile
        (a miss, counted in ``reads_evicted_total``, not as damage).
        """
        with self._lock:
            info = self.files.get(file_id)
            if info is None:
                self.counters["reads_evicted_total"] += 1
                raise CorruptEntry("file was evicted")
            if file_id in self.policy:
                self.policy.on_hit(BlockId(file_id), time.monotonic())
        try:
            data = bytearray(info.num_bytes)
            with info.path.open("rb", buffering=0) as handle:
                if handle.readinto(data) != info.num_bytes or handle.read(1):
                    raise CorruptEntry("file size changed")
            if self.cipher is not None:
                namespace_id, plain = self.cipher.open(data)
                data = bytearray(plain)
                if namespace_id != info.namespace_id:
                    raise CorruptEntry("encrypted file of another namespace")
            header = decode_header(data, fingerprint=self.fingerprint)
            if header.total_bytes != len(data) or header.namespace_id != info.namespace_id:
                raise CorruptEntry("truncated or misplaced file")
            codec = entry_codec(header, self.block_shape, self.dtype)  # written before a codec change?
            region = payloads(data, header, first, count)
            blocks = codec.decode(region, count, self.block_shape, self.dtype)
        except (CorruptEntry, OSError) as exc:
            with self._lock:
                if file_id not in self.files:  # evicted or purged after the look-up (unlinked): a miss
                    self.counters["reads_evicted_total"] += 1
                    raise CorruptEntry("file was evicted") from None
            log.warning("deleting damaged KV file %s: %s", info.path, exc)
            with self._lock:
                if file_id in self.files:
                    self._drop(file_id)
                self.counters["corrupt_deleted_total"] += 1
            raise CorruptEntry(str(exc)) from None
        self.counters["blocks_read_total"] += count
        self.counters["bytes_read_total"] += len(data)
        return list(header.blocks[first : first + count]), blocks

    # ---- writes --------------------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        return time.monotonic() >= self._paused_until

    def write(self, blocks: Sequence[DemotedBlock]) -> int:
        """Store demoted blocks (writer thread); returns how many were written."""
        if not self.accepting:
            self.counters["blocks_refused_total"] += len(blocks)
            return 0
        fresh, seen = [], set()
        for block in blocks:  # once each: a clean stop's flush hands L1's blocks and L2's copies of them
            if (block_hash := block.record.block_hash) not in self.index and block_hash not in seen:
                seen.add(block_hash)
                fresh.append(block)
        written = 0
        for run in group_runs(fresh, self.max_blocks_per_file):
            try:
                written += self._write_run(run)
            except OSError as exc:
                self.counters["write_errors_total"] += 1
                self._paused_until = time.monotonic() + self.pause_after_error_s
                level = logging.WARNING if exc.errno in (errno.ENOSPC, errno.EDQUOT) else logging.ERROR
                log.log(level, "disk tier stops accepting for %.0f s: %s", self.pause_after_error_s, exc)
                break
        return written

    def _ensure_dir(self) -> None:
        """Recreate the tier's directory if it was deleted under us (the files it held are forgotten) and
        hold it again; OSError (EBUSY) while another worker of this model holds the new one."""
        if self._lock_fd is not None and self.dir.is_dir():
            return
        if self._lock_fd is not None:  # deleted under us, its lock file with it
            with self._lock:
                lost = list(self.files)
                for file_id in lost:
                    self._drop(file_id, unlink=False)
            self.close()
            self.counters["dir_recreated_total"] += 1
            log.warning(
                "disk tier directory %s was gone: recreating it, %d files forgotten", self.dir, len(lost)
            )
        try:
            self._lock_fd = disk_lock.hold(self.dir, mode=DIR_MODE, wait_s=0)
        except disk_lock.DiskInUse as exc:  # taken by another worker of this model meanwhile: not ours now
            raise OSError(errno.EBUSY, str(exc)) from None

    def _write_run(self, run: list[DemotedBlock]) -> int:
        self._ensure_dir()
        namespace_id = run[0].namespace_id
        data = torch.stack([b.data for b in run])
        entry = encode_entry(
            fingerprint=self.fingerprint,
            namespace_id=namespace_id,
            codec=self.codec.name,
            dtype=str(self.dtype).removeprefix("torch."),
            block_shape=self.block_shape,
            blocks=[b.record for b in run],
            payloads=self.codec.encode(data),
        )
        if self.cipher is not None:
            entry = self.cipher.seal(namespace_id, entry)
        if shutil.disk_usage(self.dir).free < len(entry) + self.min_free_bytes:
            raise OSError(
                errno.ENOSPC, f"less than {self.min_free_bytes} bytes would be left free on the KV disk"
            )
        if not self._make_room(len(entry), namespace_id):
            self.counters["no_room_total"] += 1  # every file left is a parent or another owner's reservation
            return 0
        directory = self.dir / _safe_dirname(namespace_id)
        directory.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        path = directory / f"{run[0].record.block_hash.hex()}.kv"
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
            with os.fdopen(fd, "wb") as handle:
                handle.write(entry)
                handle.flush()
                os.fsync(handle.fileno())
            with self._lock:  # never renamed over a registered file (same first block, same name)
                if any(b.record.block_hash in self.index for b in run):
                    tmp.unlink(missing_ok=True)
                    return 0
                tmp.rename(path)
                self._register(path, namespace_id, [b.record for b in run], len(entry))
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self.counters["blocks_written_total"] += len(run)
        self.counters["bytes_written_total"] += len(entry)
        return len(run)

    def set_reservation(self, namespace_id: str, num_bytes: int) -> None:
        """Ask to protect up to ``num_bytes`` of ``namespace_id``'s files from other owners' writes (0: no
        reservation any more). The grants (``reserved_bytes``) are max-min fair shares of the reservable
        half of the budget among the owners asking: together they never exceed ``budget_bytes // 2``, so
        owners without a reservation always keep at least half of the disk."""
        self.set_reservations({namespace_id: num_bytes})

    def set_reservations(self, num_bytes_by_namespace: Mapping[str, int]) -> None:
        """``set_reservation`` for many owners at once (the grants shared once)."""
        with self._lock:
            for namespace_id, num_bytes in num_bytes_by_namespace.items():
                if num_bytes > 0:
                    self.requested_bytes[namespace_id] = num_bytes
                else:
                    self.requested_bytes.pop(namespace_id, None)
            self.reserved_bytes = max_min_shares(self.requested_bytes, self.budget_bytes // 2)

    def _evictable(self, file_id: int, writer: str) -> bool:
        info = self.files.get(file_id)
        if info is None or info.num_child_files:
            return False
        owner = info.namespace_id
        reserved = self.reserved_bytes.get(owner, 0)
        return not (reserved and owner != writer and self._bytes_by_ns[owner] <= reserved)

    def _make_room(self, num_bytes: int, writer: str) -> bool:
        """Evict until ``num_bytes`` more fit in the budget; False when nothing more may go."""
        with self._lock:
            while self.num_bytes + num_bytes > self.budget_bytes:
                victim = self.policy.evict(lambda f: self._evictable(f, writer)) if self.files else None
                if victim is None:
                    return False
                self._drop(victim)
                self.counters["files_evicted_total"] += 1
            return True

    # ---- purge ---------------------------------------------------------------------------------
    def purge(self, namespace_id: str) -> int:
        """Delete every file of ``namespace_id`` (and files chained below them); returns blocks erased."""
        erased = 0
        with self._lock:
            doomed = {fid for fid, info in self.files.items() if info.namespace_id == namespace_id}
            changed = True
            while changed:  # files continuing a doomed file's chain would be stranded
                changed = False
                for fid, info in self.files.items():
                    parent = info.records[0].parent_hash
                    if fid not in doomed and parent in self.index and self.index[parent][0] in doomed:
                        doomed.add(fid)
                        changed = True
            for fid in doomed:
                erased += self._drop(fid)
        with contextlib.suppress(OSError):
            (self.dir / _safe_dirname(namespace_id)).rmdir()
        return erased

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "files": len(self.files),
                "blocks": len(self.index),
                "bytes": self.num_bytes,
                "budget_bytes": self.budget_bytes,
                "accepting": int(self.accepting),
                **self.counters,
            }
