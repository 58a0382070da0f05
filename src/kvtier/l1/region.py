"""A named shared-memory region that other processes can map by name.

The region is a file in a tmpfs directory (``/dev/shm`` by default) mapped
with ``mmap``. We do not use ``multiprocessing.shared_memory``: on Python 3.11
every attach registers with the resource tracker, which unlinks the segment
when the *attaching* process exits, so an engine's exit would destroy the
server's arena.

Names are ``kvtier-{pid}-{random}``. A process that crashed leaves its file
behind; ``SharedRegion.create`` removes every ``kvtier-*`` file whose pid no
longer runs before it creates its own. With ``reaper=True`` (the cache
server's arena) a tiny child process also waits for the creator to die,
SIGKILL included, and removes the file at once: tmpfs memory is not held
until some other kvtier process happens to start. Processes that mapped the
region keep their mapping; the memory goes when the last of them unmaps it.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvtier.reaper import release, start_reaper

log = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"
NAME_PREFIX = "kvtier-"
_NAME = re.compile(r"kvtier-(\d+)-[0-9a-f]+")
MADV_POPULATE_WRITE = 23  # Linux 5.14+; not exported by Python 3.11's mmap module


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_regions(shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Unlink kvtier regions whose creating process is gone; return their names."""
    removed = []
    for path in Path(shm_dir).glob(NAME_PREFIX + "*"):
        match = _NAME.fullmatch(path.name)
        if match is None or _pid_alive(int(match[1])):
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path.name)
        log.warning("L1: removed stale shared-memory region %s", path)
    return removed


class SharedRegion:
    """A mapped region; the creator owns it and unlinks it on ``close()``."""

    def __init__(self, path: Path, size: int, mapping: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.size = size
        self.owner = owner
        self.reaper: subprocess.Popen[bytes] | None = None
        self._mmap = mapping
        self.array: npt.NDArray[np.uint8] = np.frombuffer(mapping, dtype=np.uint8)
        self.prefaulted = threading.Event()  # set once every page is mapped here
        self._closing = threading.Event()

    @property
    def name(self) -> str:
        return self.path.name

    @classmethod
    def create(
        cls,
        size: int,
        *,
        shm_dir: str = DEFAULT_SHM_DIR,
        populate: bool = True,
        reaper: bool = False,
    ) -> SharedRegion:
        """Create and map a new region of ``size`` bytes.

        ``populate`` reserves the tmpfs pages now (``posix_fallocate``), so a
        too-small tmpfs fails here rather than with SIGBUS later, and maps them
        into this process on a background thread (``prefault``), so the hot
        path stops paying first-touch page faults within seconds while start-up
        stays fast (mapping 6 GiB takes several seconds). Raises ValueError
        naming the size asked and the size available.
        """
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"shared region size must be a positive int, got {size!r}")
        if not os.path.isdir(shm_dir):
            raise ValueError(f"shm_dir {shm_dir!r} is not a directory; point it at a tmpfs")
        remove_stale_regions(shm_dir)
        stat = os.statvfs(shm_dir)
        available = stat.f_bavail * stat.f_frsize
        if size > available:
            raise ValueError(_no_room(size, available, shm_dir))
        path = Path(shm_dir) / f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if populate:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except OSError as exc:
            path.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise ValueError(_no_room(size, available, shm_dir)) from exc
            raise
        finally:
            os.close(fd)
        region = cls(path, size, mapping, owner=True)
        if reaper:
            region.reaper = start_reaper("unlink", str(path))
        if populate:
            region.prefault()
        return region

    @classmethod
    def attach(
        cls, name: str, *, shm_dir: str = DEFAULT_SHM_DIR, populate: bool = True
    ) -> SharedRegion:
        """Map an existing region by name (read-write); never unlinks it.
        ``populate`` maps every page on a background thread (``prefault``)."""
        if _NAME.fullmatch(name) is None:
            raise ValueError(f"{name!r} is not a kvtier region name (kvtier-<pid>-<hex>)")
        path = Path(shm_dir) / name
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        region = cls(path, size, mapping, owner=False)
        if populate:
            region.prefault()
        return region

    def prefault(self) -> threading.Thread:
        """Map every page into this process on a daemon thread, a slice at a
        time (``MADV_POPULATE_WRITE``, or touching one byte per page where the
        kernel lacks it); ``prefaulted`` is set when done."""
        thread = threading.Thread(target=self._prefault, name="kvtier-prefault", daemon=True)
        thread.start()
        return thread

    def _prefault(self) -> None:
        start = time.monotonic()
        step = 16 << 20  # short slices: the GIL is held during each
        try:
            for offset in range(0, self.size, step):
                if self._closing.is_set():
                    return
                length = min(step, self.size - offset)
                try:
                    self._mmap.madvise(MADV_POPULATE_WRITE, offset, length)
                except OSError:  # an older kernel: read one byte per page instead
                    # (never write: another process may be filling these bytes)
                    self.array[offset : offset + length : mmap.PAGESIZE].sum()
        except ValueError:  # closed meanwhile
            return
        self.prefaulted.set()
        log.info(
            "L1: %s mapped (%d MiB) in %.1f s", self.name, self.size >> 20, time.monotonic() - start
        )

    def close(self) -> None:
        """Unmap, and unlink if this process created the region."""
        self._closing.set()
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            # Views handed out are still alive; the mapping goes when they do.
            log.debug("L1: region %s still has live views; unmapping deferred", self.name)
        if self.owner:
            self.path.unlink(missing_ok=True)
            self.owner = False
        if self.reaper is not None:
            release(self.reaper)
            self.reaper = None


def _no_room(size: int, available: int, shm_dir: str) -> str:
    return (
        f"the L1 arena needs {size} bytes in {shm_dir} but only {available} are free; "
        "lower the L1 size or point shm_dir at a larger tmpfs"
    )
