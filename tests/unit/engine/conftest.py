"""Fixtures of the transformers-integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.l1 import L1Config
from kvtier.storage import StorageConfig, StorageManager


@pytest.fixture
def storage() -> Iterator[StorageManager]:
    manager = StorageManager(StorageConfig(l1=L1Config(size_bytes=64 << 20, populate=False)))
    try:
        yield manager
    finally:
        manager.close()
