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
- Capacity and tenant caps (``kvtier.l2.local_index``), kept as each store
  lands: a store that takes its tenant past its cap (``set_owners``) deletes
  that tenant's own least recently stored or loaded files (counted
  ``quota_evictions``), never another's; an object larger than its tenant's
  cap alone is not written (``over_quota``). Past ``capacity_bytes`` the
  least recently stored or loaded files of all are deleted (``evictions``).
- Errors: ENOSPC, EACCES and other OS errors fail that key's store (counted
  as ``no_space``, ``permission``, ``os_error``) and leave nothing visible.
  A corrupt or truncated file is a miss and is deleted.
- ``o_direct``: bypass the page cache for payloads whose size is a multiple
  of 4096 (headers are then padded to 4096); other sizes, and file systems
  that refuse O_DIRECT (tmpfs), use buffered I/O.

The directory belongs to one adapter at a time (the index lives in memory).
Thread safety: ``_index_lock`` guards ``_index``; file I/O runs outside it
on the adapter's thread pool.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
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
from kvtier.l2.local_index import Evicted, LocalIndex

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
        self._index = LocalIndex(config.capacity_bytes)
        self._rebuild_index()

    def set_owners(self, owner_of: Callable[[str], str], caps: Mapping[str, int]) -> bool:
        """Keep each owner's files within its cap from now on; owners already
        past theirs lose their oldest files now."""
        with self._index_lock:
            evicted = self._index.set_owners(owner_of, caps)
        self._remove(evicted)
        return True

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
                "used_bytes": self._index.used,
                "capacity_bytes": self.fs_config.capacity_bytes,
            }

    # ------------------------------------------------------------- store

    def _store_one(self, key: ObjectKey, buffer: Buffer, layout: str) -> int | None:
        final = self.path_of(key)
        direct = self._direct_ok(buffer)
        header = encode_header(key, layout, buffer, DIRECT_ALIGN if direct else 64, seal=self.seal)
        with self._index_lock:
            refused = self._index.refuses(key, len(header) + buffer.nbytes)
        if refused:
            log.warning("L2 %s: %s is larger than its tenant's quota here", self.name, key)
            self._count_failure("over_quota")
            return None
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
            verify_payload(header, buffer, self.seal)
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
            self._index.touch(key)
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
        with self._index_lock:
            evicted = self._index.admit(key, size)
        self._remove(evicted)

    def _remove(self, evicted: Evicted) -> None:
        """Delete the files of objects the index evicted (already out of it)."""
        for victim in evicted.keys:
            self.path_of(victim).unlink(missing_ok=True)
        self._counters.add("quota_evictions", len(evicted.own))
        self._counters.add("evictions", len(evicted.oldest))
        if evicted.keys and self.on_removed is not None:
            self.on_removed(evicted.keys)

    def _forget(self, key: ObjectKey) -> None:
        with self._index_lock:
            if self._index.forget(key) is None:
                return
        if self.on_removed is not None:
            self.on_removed((key,))

    def held_keys(self) -> list[ObjectKey]:
        with self._index_lock:
            return self._index.keys()

    def held_sizes(self) -> list[tuple[ObjectKey, int]]:
        with self._index_lock:
            return self._index.items()

    def delete(self, keys: Sequence[ObjectKey]) -> int:
        """Remove these objects (retention: a tenant's expired ones); how many were held."""
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
        with self._index_lock:  # a capacity lowered since: the oldest go now
            evicted = [self._index.admit(key, size) for _, key, size in found]
        for each in evicted:
            self._remove(each)
        log.info(
            "L2 %s: indexed %d objects (%d bytes) under %s; removed %d temp files",
            self.name,
            len(found),
            self._index.used,
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
