"""The lock/byte ledger: after a scenario, nothing is locked, staged or leaked.

``assert_clean(manager)`` (an ``L1Manager``, or a ``StorageManager``'s L1)
recounts from L1's own tables and checks that no
read lock, staging reservation, I/O fence or fenced zombie remains, that the
arena's used bytes equal the bytes of the objects it holds (nothing leaked,
nothing double-freed), and that the eviction policy tracks exactly the
resident objects.
"""

from __future__ import annotations

from kvtier.l1 import L1Manager
from kvtier.storage import StorageManager


def assert_clean(
    manager: L1Manager | StorageManager, *, staging_ok: bool = False
) -> dict[str, int]:
    if isinstance(manager, StorageManager):
        audit, status = manager.l1_audit(), manager.l1_status()
    else:
        audit, status = manager.audit(), manager.status()
    assert audit["read_locks"] == 0, audit
    assert audit["io_fences"] == 0, audit
    assert audit["zombies"] == 0, audit
    if not staging_ok:
        assert audit["staging_objects"] == 0, audit
    assert audit["object_bytes"] == audit["arena_used_bytes"], audit
    assert audit["policy_entries"] == audit["resident_objects"], audit
    assert status["locked_bytes"] == 0, status
    assert status["locked_objects"] == status["fenced_objects"] == 0, status
    if not staging_ok:
        assert status["staging_bytes"] == 0, status
    return audit
