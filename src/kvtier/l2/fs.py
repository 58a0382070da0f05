"""``fs``: one file per object on a local file system.

Layout: ``{path}/{h[0:2]}/{h[2:4]}/{key}.kv`` where ``key`` is
``ObjectKey.to_str()`` and ``h`` its chunk hash in hex. Each file is the
shared object format (header, then payload).

- Atomic publish: a copy is written to ``{file}.tmp-{pid}-{n}`` and renamed
  into place, so a reader sees a whole file or none (optionally fsynced,
  file and directory).
- Warm restart: the index (key -> bytes on disk, oldest first) is rebuilt
  from the files at start; leftover temp files are removed. A restarted
  server keeps every stored object usable.
- Capacity: with ``capacity_bytes`` set, the least recently stored or loaded
  files are deleted to stay under it.
- Errors: ENOSPC, EACCES and other OS errors fail that key's store (counted
  as ``no_space``, ``permission``, ``os_error``) and leave nothing visible.
  A corrupt or truncated file is a miss and is deleted.
- ``o_direct``: bypass the page cache for payloads whose size is a multiple
  of 4096 (headers are then padded to 4096); other sizes, and file systems
  that refuse O_DIRECT (tmpfs), use buffered I/O.

The directory belongs to one adapter at a time (the index lives in memory).
Thread safety: ``_index_lock`` guards ``_index`` and ``_used``; file I/O runs
outside it on the adapter's thread pool.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.keys import KeySelector, ObjectKey
from kvtier.l2.base import AdapterConfig, Buffer, CompletionCallback, PurgeStep
from kvtier.l2.blocking import BlockingAdapter
from kvtier.l2.format import (
    MAX_HEADER_BYTES,
    Corruption,
    CorruptObject,
    encode_header,
    parse_header,
    verify_payload,
)

log = logging.getLogger(__name__)

SUFFIX = ".kv"
DIRECT_ALIGN = 4096
_ERRNO_REASON = {errno.ENOSPC: "no_space", errno.EDQUOT: "no_space", errno.EACCES: "permission"}


@dataclass(frozen=True, slots=True, kw_only=True)
class FSConfig(AdapterConfig):
    path: str
    capacity_bytes: int = 0  # 0: unbounded
    fsync: bool = False
    o_direct: bool = False

    def __post_init__(self) -> None:
        super(FSConfig, self).__post_init__()
        if not self.path:
            raise ValueError("option 'path' must name a directory for the fs adapter")
        if self.capacity_bytes < 0:
            raise ValueError(f"option 'capacity_bytes' must be >= 0, got {self.capacity_bytes}")


class FSAdapter(BlockingAdapter):
    type_name = "fs"
    config_class = FSConfig
    takes_codecs = False  # payloads go between L1 and the backend as they are
    shared_by_default = False  # a directory on this node (an NFS mount: set shared = true)
    inline_lookup = True  # the index is in memory

    def __init__(self, config: FSConfig, on_complete: CompletionCallback) -> None:
        super().__init__(config, on_complete)
        self.fs_config = config
        self.root = Path(config.path).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self._direct = config.o_direct and hasattr(os, "O_DIRECT")
        self._tmp_ids = itertools.count()
        self._index_lock = threading.Lock()
        self._index: OrderedDict[ObjectKey, int] = OrderedDict()  # oldest first
        self._used = 0
        self._rebuild_index()

    # ----------------------------------------------------------- backend

    def _store(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str
    ) -> list[int | None]:
        return [self._store_one(k, b, layout) for k, b in zip(keys, buffers, strict=True)]

    def _lookup(self, keys: Sequence[ObjectKey]) -> list[bool]:
        with self._index_lock:
            return [key in self._index for key in keys]

    def _load(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str
    ) -> list[bool]:
        return [self._load_one(k, b, layout) for k, b in zip(keys, buffers, strict=True)]

    def _backend_status(self) -> dict[str, object]:
        with self._index_lock:
            return {
                "path": str(self.root),
                "objects": len(self._index),
                "used_bytes": self._used,
                "capacity_bytes": self.fs_config.capacity_bytes,
            }

    # ------------------------------------------------------------- store

    def _store_one(self, key: ObjectKey, buffer: Buffer, layout: str) -> int | None:
        final = self.path_of(key)
        direct = self._direct_ok(buffer)
        header = encode_header(key, layout, buffer, DIRECT_ALIGN if direct else 64)
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}-{next(self._tmp_ids)}")
        renamed = False
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            written = self._write_file(tmp, header, buffer, direct)
            os.rename(tmp, final)
            renamed = True
            if self.fs_config.fsync:
                _fsync_dir(final.parent)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if renamed:  # published but not durable as asked: take it back
                self._forget(key)
                final.unlink(missing_ok=True)
            reason = _ERRNO_REASON.get(exc.errno or 0, "os_error")
            log.warning("L2 %s: storing %s failed: %s", self.name, key, exc)
            self._count_failure(reason)
            return None
        self._admit(key, written)
        return written

    def _write_file(self, path: Path, header: bytes, buffer: Buffer, direct: bool) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        fd = _open_direct(path, flags) if direct else None
        if fd is None:
            fd = os.open(path, flags, 0o644)
            views = [memoryview(header), buffer.data]
        else:
            aligned = mmap.mmap(-1, len(header))  # O_DIRECT needs aligned memory
            aligned.write(header)
            views = [memoryview(aligned), buffer.data]
        try:
            _write_all(fd, views)
            if self.fs_config.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return len(header) + buffer.nbytes

    # -------------------------------------------------------------- load

    def _load_one(self, key: ObjectKey, buffer: Buffer, layout: str) -> bool:
        path = self.path_of(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._count_failure("not_found")
            self._forget(key)
            return False
        try:
            size = os.fstat(fd).st_size
            header = parse_header(os.pread(fd, MAX_HEADER_BYTES, 0), key, layout)
            if header.payload_len != buffer.nbytes:
                raise CorruptObject(Corruption.LENGTH, f"{header.payload_len} != {buffer.nbytes}")
            if size != header.header_len + header.payload_len:
                raise CorruptObject(Corruption.SHORT, f"file has {size} bytes")
            read = self._read_payload(path, fd, buffer, header.header_len)
            if read != buffer.nbytes:
                raise CorruptObject(Corruption.SHORT, f"read {read} of {buffer.nbytes}")
            verify_payload(header, buffer)
        except CorruptObject as error:
            self._corrupt(key, error)
            self._delete(key, path)
            return False
        except OSError as exc:
            log.warning("L2 %s: loading %s failed: %s", self.name, key, exc)
            self._count_failure("os_error")
            return False
        finally:
            os.close(fd)
        with self._index_lock:
            if key in self._index:
                self._index.move_to_end(key)
        return True

    def _read_payload(self, path: Path, fd: int, buffer: Buffer, offset: int) -> int:
        direct_fd = None
        if self._direct_ok(buffer) and offset % DIRECT_ALIGN == 0:
            direct_fd = _open_direct(path, os.O_RDONLY)
        if direct_fd is None:
            return os.preadv(fd, [buffer.data], offset)
        try:
            return os.preadv(direct_fd, [buffer.data], offset)
        finally:
            os.close(direct_fd)

    def _direct_ok(self, buffer: Buffer) -> bool:
        return (
            self._direct
            and buffer.nbytes % DIRECT_ALIGN == 0
            and buffer.ctypes.data % DIRECT_ALIGN == 0
        )

    # ------------------------------------------------------------- index

    def path_of(self, key: ObjectKey) -> Path:
        digest = key.chunk_hash.hex()
        return self.root / digest[:2] / digest[2:4] / (key.to_str() + SUFFIX)

    def _admit(self, key: ObjectKey, size: int) -> None:
        victims: list[ObjectKey] = []
        cap = self.fs_config.capacity_bytes
        with self._index_lock:
            self._used += size - self._index.pop(key, 0)
            self._index[key] = size
            while cap and self._used > cap and len(self._index) > 1:
                victim, victim_size = self._index.popitem(last=False)
                self._used -= victim_size
                victims.append(victim)
        for victim in victims:
            self.path_of(victim).unlink(missing_ok=True)
        if victims:
            self._count_evictions(len(victims))
            if self.on_removed is not None:
                self.on_removed(victims)

    def _forget(self, key: ObjectKey) -> None:
        with self._index_lock:
            size = self._index.pop(key, None)
            if size is None:
                return
            self._used -= size
        if self.on_removed is not None:
            self.on_removed((key,))

    def held_keys(self) -> list[ObjectKey]:
        with self._index_lock:
            return list(self._index)

    def held_sizes(self) -> list[tuple[ObjectKey, int]]:
        with self._index_lock:
            return list(self._index.items())

    def delete(self, keys: Sequence[ObjectKey]) -> int:
        """Remove these objects (a tenant's oldest, over its quota); how many were held."""
        with self._index_lock:
            held = [k for k in keys if k in self._index]
        for key in held:
            self._delete(key, self.path_of(key))
        return len(held)

    def older_than(self, age_s: float) -> list[ObjectKey]:
        """Objects whose file was written more than ``age_s`` seconds ago."""
        cutoff = time.time() - age_s
        old = []
        for key in self.held_keys():
            try:
                if self.path_of(key).stat().st_mtime < cutoff:
                    old.append(key)
            except OSError:
                continue
        return old

    def purge(self, selector: KeySelector, cursor: str | None, limit: int) -> PurgeStep:
        """From the index: a reader with the file open keeps reading it (an
        unlinked file lives until closed); one that opens it after misses."""
        with self._index_lock:  # the first limit + 1 only: every step scans from the start
            matched = list(
                itertools.islice((k for k in self._index if selector.matches(k)), limit + 1)
            )
        for key in matched[:limit]:
            self._delete(key, self.path_of(key))
        return PurgeStep(min(len(matched), limit), "" if len(matched) > limit else None)

    def _delete(self, key: ObjectKey, path: Path) -> None:
        self._forget(key)
        path.unlink(missing_ok=True)

    def _count_evictions(self, n: int) -> None:
        self._counters.add("evictions", n)

    def _rebuild_index(self) -> None:
        found: list[tuple[float, ObjectKey, int]] = []
        stale = 0
        for path in self.root.glob("*/*/*"):
            name = path.name
            if ".tmp-" in name:
                path.unlink(missing_ok=True)
                stale += 1
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                key = ObjectKey.from_str(name[: -len(SUFFIX)])
                stat = path.stat()
            except (ValueError, OSError):
                continue
            if path != self.path_of(key):
                continue
            found.append((stat.st_mtime, key, stat.st_size))
        found.sort(key=lambda item: item[0])
        with self._index_lock:
            for _, key, size in found:
                self._index[key] = size
                self._used += size
        log.info(
            "L2 %s: indexed %d objects (%d bytes) under %s; removed %d temp files",
            self.name,
            len(found),
            self._used,
            self.root,
            stale,
        )


def _write_all(fd: int, views: list[memoryview]) -> None:
    views = [v.cast("B") for v in views if v.nbytes]
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _open_direct(path: Path, flags: int) -> int | None:
    """An O_DIRECT descriptor, or None where the file system refuses O_DIRECT."""
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        if flags & os.O_CREAT:
            path.unlink(missing_ok=True)  # some file systems create it before refusing
        return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
