"""``Arena``: the L1 memory, one named shared-memory region plus its allocator.

Another process maps the same bytes with ``SharedRegion.attach(arena.name)``
and reads or writes objects at the offsets the L1 manager hands out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvtier.l1.allocator import PAGE_BYTES, FreeListAllocator
from kvtier.l1.region import DEFAULT_SHM_DIR, SharedRegion


class Arena:
    """A shared-memory region with a page-aligned, all-or-nothing batch allocator.

    Not thread-safe: ``L1Manager`` owns it and calls it under its lock. Views
    returned by ``view()`` alias shared memory; they are valid while the
    object they cover is allocated.
    """

    def __init__(
        self,
        size_bytes: int,
        *,
        shm_dir: str = DEFAULT_SHM_DIR,
        populate: bool = True,
        reaper: bool = False,
        alignment: int = PAGE_BYTES,
    ) -> None:
        self._allocator = FreeListAllocator(size_bytes, alignment)
        self._region = SharedRegion.create(
            self._allocator.capacity, shm_dir=shm_dir, populate=populate, reaper=reaper
        )

    @property
    def name(self) -> str:
        """The region's name, for ``SharedRegion.attach`` in another process."""
        return self._region.name

    @property
    def capacity(self) -> int:
        return self._allocator.capacity

    @property
    def used_bytes(self) -> int:
        return self._allocator.used_bytes

    def allocate(self, sizes: Sequence[int]) -> list[int] | None:
        """Offsets for all sizes, or None with nothing allocated."""
        return self._allocator.allocate(sizes)

    def free(self, offsets: Sequence[int]) -> None:
        self._allocator.free(offsets)

    def reserved_bytes(self, size: int) -> int:
        """What an object of ``size`` bytes really takes (whole pages)."""
        return self._allocator.pages_for(size) * self._allocator.alignment

    def view(self, offset: int, size: int) -> npt.NDArray[np.uint8]:
        """A writable uint8 view of ``size`` bytes at ``offset`` (no copy)."""
        return self._region.array[offset : offset + size]

    def wait_mapped(self, timeout: float | None = None) -> bool:
        """Wait until the background pre-faulting of the region is done."""
        return self._region.prefaulted.wait(timeout)

    def stats(self) -> dict[str, int | float]:
        return self._allocator.stats()

    def close(self) -> None:
        self._region.close()
