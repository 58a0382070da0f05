"""A page-aligned free-list allocator with coalescing, over offsets only.

Extents are counted in pages (4 KiB by default). Free extents are indexed
three ways: by start (to coalesce with the next extent), by end (to coalesce
with the previous one) and in a list sorted by (length, start) for best fit.
KV objects of one layout all have one size, so best fit keeps the arena
nearly unfragmented without size classes; slab classes were rejected because
they strand memory in classes that the current model's object size no longer
uses.

Not thread-safe: its owner (``L1Manager``) calls it under its own lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

PAGE_BYTES = 4096


class FreeListAllocator:
    """Allocate byte extents from ``[0, capacity)``, aligned to ``alignment``."""

    def __init__(self, capacity_bytes: int, alignment: int = PAGE_BYTES) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        pages = capacity_bytes // alignment
        if pages <= 0:
            raise ValueError(
                f"capacity {capacity_bytes} bytes is smaller than one {alignment}-byte page"
            )
        self.alignment = alignment
        self.capacity = pages * alignment
        self._pages = pages
        self._free_at: dict[int, int] = {0: pages}  # start page -> length
        self._free_to: dict[int, int] = {pages: 0}  # end page -> start page
        self._by_size: list[tuple[int, int]] = [(pages, 0)]  # sorted (length, start)
        self._used: dict[int, int] = {}  # start page -> length of live extents
        self.used_bytes = 0

    def pages_for(self, size: int) -> int:
        return -(-size // self.alignment)

    def allocate(self, sizes: Sequence[int]) -> list[int] | None:
        """Byte offsets for every size, or None (and nothing allocated) if any
        fails, a size larger than the whole capacity included."""
        for size in sizes:
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise ValueError(f"allocation size must be a positive int, got {size!r}")
        if any(size > self.capacity for size in sizes):
            return None
        starts: list[int] = []
        for size in sizes:
            start = self._take(self.pages_for(size))
            if start is None:
                self.free([s * self.alignment for s in starts])
                return None
            starts.append(start)
        return [s * self.alignment for s in starts]

    def free(self, offsets: Sequence[int]) -> None:
        """Return extents; an offset that is not allocated raises ValueError."""
        for offset in offsets:
            start, rem = divmod(offset, self.alignment)
            length = self._used.pop(start, None) if rem == 0 else None
            if length is None:
                raise ValueError(f"free of offset {offset}, which is not allocated")
            self.used_bytes -= length * self.alignment
            self._release(start, length)

    def size_of(self, offset: int) -> int:
        """Bytes reserved at ``offset`` (whole pages)."""
        return self._used[offset // self.alignment] * self.alignment

    def _take(self, pages: int) -> int | None:
        i = bisect.bisect_left(self._by_size, (pages, -1))
        if i == len(self._by_size):
            return None
        length, start = self._by_size.pop(i)
        del self._free_at[start]
        del self._free_to[start + length]
        if length > pages:
            self._add_free(start + pages, length - pages)
        self._used[start] = pages
        self.used_bytes += pages * self.alignment
        return start

    def _release(self, start: int, length: int) -> None:
        end = start + length
        after = self._free_at.get(end)
        if after is not None:
            self._remove_free(end, after)
            length += after
        before = self._free_to.get(start)
        if before is not None:
            self._remove_free(before, start - before)
            length += start - before
            start = before
        self._add_free(start, length)

    def _add_free(self, start: int, length: int) -> None:
        self._free_at[start] = length
        self._free_to[start + length] = start
        bisect.insort(self._by_size, (length, start))

    def _remove_free(self, start: int, length: int) -> None:
        del self._free_at[start]
        del self._free_to[start + length]
        i = bisect.bisect_left(self._by_size, (length, start))
        del self._by_size[i]

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free_bytes(self) -> int:
        return self._by_size[-1][0] * self.alignment if self._by_size else 0

    def fragmentation(self) -> float:
        """1 - largest free extent / all free bytes: 0 when free space is one extent."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free_bytes / free

    def stats(self) -> dict[str, int | float]:
        return {
            "capacity_bytes": self.capacity,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes,
            "largest_free_bytes": self.largest_free_bytes,
            "free_extents": len(self._by_size),
            "allocations": len(self._used),
            "fragmentation": self.fragmentation(),
        }
