"""Retention: a tenant's objects older than its ``retention_s`` leave L1 and
the fs L2; another tenant's, and younger ones, stay; a held object waits.
Ages are set, never waited for: L1 runs on a clock the test moves, and the fs
L2's ages are its files' times, set by hand."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config
from kvtier.l2.fs import FSAdapter
from kvtier.storage import StorageConfig, StorageManager
from kvtier.tenancy.retention import Retention
from kvtier.tenancy.tenants import Tenant, TenantTable
from tests import storage_parts
from tests.conftest import FakeClock, make_key


def age_file(fs: FSAdapter, key: ObjectKey, age_s: float) -> None:
    """Make ``key``'s file look written ``age_s`` seconds ago."""
    os.utime(fs.path_of(key), (time.time() - age_s,) * 2)


def test_old_objects_of_a_tenant_with_retention_go(tmp_path: Path, clock: FakeClock) -> None:
    config = StorageConfig(
        l1=L1Config(size_bytes=1 << 20, populate=False),
        l2=({"type": "fs", "path": str(tmp_path / "fs")},),
    )
    tenants = TenantTable([
        Tenant("acme", salts=("acme",), retention_s=60),
        Tenant("globex", salts=("globex",)),
    ])  # fmt: skip
    with StorageManager(config, clock=clock) as storage:
        old = [make_key(i, salt="acme") for i in range(3)]
        theirs = [make_key(i, salt="globex") for i in range(3)]
        storage.store(old + theirs, [np.zeros(4096, np.uint8)] * 6)
        assert storage.flush(10)
        (fs,) = storage_parts.adapters(storage)
        assert isinstance(fs, FSAdapter)
        for key in old[1:] + theirs:  # two of acme's files are a day old, and all of globex's
            age_file(fs, key, 86400)
        retention = Retention(storage, tenants, check_s=3600)  # no thread: sweeps are called
        assert retention.active
        assert retention.sweep() == 2  # young in L1 still; the old files go
        assert set(fs.held_keys()) == {old[0], *theirs}
        assert storage.reserve_read_all(old[:1])[1] == 0  # a reader holds one
        clock.advance(61)  # every L1 object is past acme's retention
        age_file(fs, old[0], 61)
        assert retention.sweep() == 2 + 1  # L1: two (one is held); fs: the last acme file
        assert [storage.in_l1(k) for k in old] == [True, False, False]
        storage.finish_read(old[:1])
        assert retention.sweep() == 1
        assert all(storage.in_l1(k) for k in theirs)
        assert set(fs.held_keys()) == set(theirs)
        counts = retention.counters.snapshot()
        assert counts["retention_removed.L1"] == 3 and counts["retention_removed.fs"] == 3


def test_without_a_retention_there_is_nothing_to_schedule(tmp_path: Path) -> None:
    config = StorageConfig(l1=L1Config(size_bytes=1 << 20, populate=False))
    with StorageManager(config) as storage:
        retention = Retention(storage, TenantTable([Tenant("acme", salts=("acme",))]))
        assert not retention.active
