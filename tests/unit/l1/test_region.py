from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.l1 import Arena, SharedRegion, remove_stale_regions


def test_second_process_maps_the_arena_by_name(tmp_path: Path) -> None:
    arena = Arena(1 << 20, shm_dir=str(tmp_path))
    try:
        (offset,) = arena.allocate([5000]) or []
        payload = np.arange(5000, dtype=np.uint32).astype(np.uint8)
        np.copyto(arena.view(offset, 5000), payload)
        child = f"""
import numpy as np
from kvtier.l1 import SharedRegion
region = SharedRegion.attach({arena.name!r}, shm_dir={str(tmp_path)!r})
data = region.array[{offset}:{offset} + 5000]
print(int(data.astype(np.uint64).sum()))
region.array[{offset}] = 77   # writes are visible to the creator
region.close()
"""
        out = subprocess.run(
            [sys.executable, "-c", child], capture_output=True, text=True, check=True
        )
        assert int(out.stdout) == int(payload.astype(np.uint64).sum())
        assert arena.view(offset, 1)[0] == 77
        assert (tmp_path / arena.name).exists()  # the child's exit did not unlink it
    finally:
        arena.close()
    assert not (tmp_path / arena.name).exists()  # the owner's close did


def test_stale_regions_of_dead_processes_are_removed(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(proc.stdout)
    stale = tmp_path / f"kvtier-{dead_pid}-abcdef"
    stale.write_bytes(b"x" * 10)
    alive = tmp_path / f"kvtier-{os.getpid()}-123456"
    alive.write_bytes(b"y")
    unrelated = tmp_path / "other-file"
    unrelated.write_bytes(b"z")
    region = SharedRegion.create(4096, shm_dir=str(tmp_path))
    try:
        assert not stale.exists()
        assert alive.exists() and unrelated.exists()
        assert remove_stale_regions(str(tmp_path)) == []
    finally:
        region.close()


def test_too_large_region_names_size_asked_and_available(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"needs \d+ bytes in .* but only \d+ are free"):
        SharedRegion.create(1 << 62, shm_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        SharedRegion.create(4096, shm_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="positive int"):
        SharedRegion.create(0, shm_dir=str(tmp_path))
    with pytest.raises(ValueError, match="not a kvtier region name"):
        SharedRegion.attach("../etc/passwd", shm_dir=str(tmp_path))


def test_populated_region_is_allocated_up_front(tmp_path: Path) -> None:
    region = SharedRegion.create(1 << 20, shm_dir=str(tmp_path), populate=True)
    try:
        assert os.stat(region.path).st_blocks * 512 >= 1 << 20
        assert region.prefaulted.wait(60)  # mapped on a background thread
    finally:
        region.close()
    sparse = SharedRegion.create(1 << 20, shm_dir=str(tmp_path), populate=False)
    try:
        assert os.stat(sparse.path).st_blocks == 0
    finally:
        sparse.close()
