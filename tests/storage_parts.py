"""A ``StorageManager``'s parts, for the tests that reach inside it on
purpose: to hold or fail an adapter's calls (fault injection), to patch one
L1 transition, or to stop one controller. What a test only reads goes
through the manager's own operations (``l1_status``, ``l1_audit``,
``in_l1``, ``status()``); so does every caller in ``src/``. Every private
access of the tests outside ``tests/unit/test_storage.py`` is here.
"""

from __future__ import annotations

from kvtier.controllers import PrefetchController, StoreController
from kvtier.l1 import L1Manager
from kvtier.l2.base import L2Adapter
from kvtier.storage import StorageManager


def adapters(storage: StorageManager) -> list[L2Adapter]:
    """The L2 adapters, in lookup order (fastest first)."""
    return list(storage._adapters)


def l1(storage: StorageManager) -> L1Manager:
    return storage._l1


def prefetch(storage: StorageManager) -> PrefetchController:
    return storage._prefetch


def store_controller(storage: StorageManager) -> StoreController:
    return storage._store_controller
