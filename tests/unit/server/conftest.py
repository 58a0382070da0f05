"""The server tests' storage: a 1 MiB L1, nothing behind it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.l1 import L1Config
from kvtier.storage import StorageConfig, StorageManager


@pytest.fixture
def storage() -> Iterator[StorageManager]:
    manager = StorageManager(StorageConfig(l1=L1Config(size_bytes=1 << 20, populate=False)))
    yield manager
    manager.close()
