"""Per-tenant L2 quotas (``L2Usage``): on the local disk a store past a
tenant's cap evicts its own oldest objects there as it lands, never
another's; on a shared store the write-back stops at the cap, counted;
usage per tenant and tier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config
from kvtier.server.core import CacheServer
from kvtier.storage import StorageConfig, StorageManager
from kvtier.tenancy.tenants import Quota, Tenant, TenantTable
from kvtier.tenancy.usage import L2Usage
from tests import storage_parts
from tests.conftest import make_key

OBJECT = 4096


def CAP(objects: int) -> int:
    return objects * OBJECT + 2000  # an object's header is well under 2,000 bytes


def test_local_caps_evict_the_tenants_own_oldest_and_shared_caps_stop_write_back(
    tmp_path: Path,
) -> None:
    config = StorageConfig(
        l1=L1Config(size_bytes=4 << 20, populate=False),
        l2=(
            {"type": "fs", "path": str(tmp_path / "fs")},
            {"type": "mock", "name": "shared", "shared": True},
        ),
    )
    tenants = TenantTable([
        # room for three objects on disk and two in the shared store, headers included
        Tenant("acme", salts=("acme",), quota=Quota(l2_bytes={"fs": CAP(3), "shared": CAP(2)})),
        Tenant("globex", salts=("globex",)),
    ])  # fmt: skip
    usage = L2Usage(tenants, refresh_s=3600)
    hooks = {"store_gate": usage.gate, "on_stored": usage.on_stored}
    with StorageManager(config, owners=tenants.owners(), **hooks) as storage:
        usage.watch(storage)
        assert storage.self_capped_tiers() == {"fs"}  # the shared store is gated instead
        fs, shared = storage_parts.adapters(storage)
        mine = [make_key(i, salt="acme") for i in range(5)]
        theirs = [make_key(i, salt="globex") for i in range(4)]
        for key in [*theirs[:2], *mine, *theirs[2:]]:  # one at a time: oldest first
            storage.store([key], [np.zeros(OBJECT, np.uint8)])
            assert storage.flush(10)
        # the shared store took acme's first two, then the cap held
        assert set(_keys(shared)) == {*mine[:2], *theirs}
        store_status = storage.status()["store"]
        assert isinstance(store_status, dict) and store_status["over_quota.shared"] == 3
        # the local disk: acme's two oldest went as its stores landed, globex's stay
        assert set(fs.held_keys()) == {*mine[2:], *theirs}
        assert fs.status()["quota_evictions"] == 2
        usage.refresh()  # no thread of its own: the server's upkeep calls it
        by_tenant = usage.by_tenant()
        assert by_tenant["acme"]["fs"] == sum(s for k, s in fs.held_sizes() if k in mine)
        assert 2 * OBJECT < by_tenant["acme"]["shared"] <= CAP(2)  # what it wrote there
        assert 4 * OBJECT < by_tenant["globex"]["shared"] <= CAP(4)


def _keys(adapter: object) -> list[object]:
    return adapter.keys()  # type: ignore[attr-defined,no-any-return]  # the mock's own listing


def test_a_tenant_past_its_local_cap_never_costs_another_tenant_a_file(tmp_path: Path) -> None:
    """Issue 41 #7: the fs tier holds 6 units, acme's quota there is 2. globex
    writes 3, then acme writes 6. acme's stores evict acme's own files as they
    land; globex loses nothing, with no refresh in between."""
    size = OBJECT + 512  # one object's file, header included, with room to spare
    config = StorageConfig(
        l1=L1Config(size_bytes=4 << 20, populate=False),
        l2=({"type": "fs", "path": str(tmp_path / "fs"), "capacity_bytes": 6 * size},),
    )
    tenants = TenantTable([
        Tenant("acme", salts=("acme",), quota=Quota(l2_bytes={"fs": 2 * size})),
        Tenant("globex", salts=("globex",)),
    ])  # fmt: skip
    usage = L2Usage(tenants, refresh_s=3600)
    with StorageManager(config, owners=tenants.owners(), store_gate=usage.gate) as storage:
        usage.watch(storage)
        (fs,) = storage_parts.adapters(storage)
        theirs = [make_key(i, salt="globex") for i in range(3)]
        mine = [make_key(i, salt="acme") for i in range(6)]
        for batch in (theirs, mine):
            storage.store(batch, [np.zeros(OBJECT, np.uint8)] * len(batch))
            assert storage.flush(10)
        held = set(fs.held_keys())
        assert set(theirs) <= held
        assert len(held & set(mine)) == 2
        assert fs.status()["objects"] == 5
        assert fs.status()["quota_evictions"] == 4
        assert fs.status().get("evictions", 0) == 0


def test_a_shared_cap_without_the_usage_hooks_fails_at_construction(tmp_path: Path) -> None:
    """A cap only the gate keeps, on a storage built without the gate, would be
    shown and never kept: the server refuses to start instead."""
    config = StorageConfig(
        l1=L1Config(size_bytes=1 << 20, populate=False),
        l2=(
            {"type": "fs", "path": str(tmp_path / "fs")},
            {"type": "mock", "name": "shared", "shared": True},
        ),
    )
    tenants = TenantTable([
        Tenant("acme", salts=("acme",), quota=Quota(l2_bytes={"fs": CAP(3), "shared": CAP(2)})),
    ])  # fmt: skip
    usage = L2Usage(tenants)
    other = L2Usage(tenants)
    with StorageManager(config, owners=tenants.owners()) as bare:
        with pytest.raises(ValueError, match=r"caps on shared .*store_gate=usage\.gate"):
            usage.watch(bare)
        with pytest.raises(ValueError, match="l2_bytes caps on shared"):
            CacheServer(bare, 16, tenants)  # the server's own usage: not the storage's hooks
    owners = tenants.owners()
    with StorageManager(
        config, owners=owners, store_gate=other.gate, on_stored=other.on_stored
    ) as storage:
        with pytest.raises(ValueError, match="caps on shared"):
            usage.watch(storage)  # another usage's hooks keep nothing of this one's
        other.watch(storage)
    only_local = TenantTable([Tenant("acme", salts=("acme",), quota=Quota(l2_bytes={"fs": 1}))])
    with StorageManager(config, owners=only_local.owners()) as storage:
        L2Usage(only_local).watch(storage)  # the fs adapter keeps its caps itself


def test_namespaces_written_to_a_shared_store_are_bounded_per_tenant(tmp_path: Path) -> None:
    """What this server wrote to shared stores is counted per namespace, and
    a namespace is named by its clients: 40 model names of one tenant keep at
    most the limit of rows, the least recent summed under "(other)"."""
    config = StorageConfig(
        l1=L1Config(size_bytes=4 << 20, populate=False),
        l2=({"type": "mock", "name": "shared", "shared": True},),
    )
    tenants = TenantTable([
        Tenant("acme", salts=("acme",), quota=Quota(l2_bytes={"shared": 1 << 30})),
    ])  # fmt: skip
    usage = L2Usage(tenants, refresh_s=3600, rows_per_tenant=4)
    hooks = {"store_gate": usage.gate, "on_stored": usage.on_stored}
    with StorageManager(config, owners=tenants.owners(), **hooks) as storage:
        usage.watch(storage)
        keys = [ObjectKey(bytes(32), f"m{n}", 0, 0, "acme") for n in range(40)]
        for key in keys:
            storage.store([key], [np.zeros(OBJECT, np.uint8)])
        assert storage.flush(10)
        written = usage.written()
        assert len(written) == 4
        assert {namespace for _, namespace, _, _, _ in written} >= {"(other)"}
        assert sum(objects for *_, objects, _ in written) == 40
