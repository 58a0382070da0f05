"""Tenant isolation under quota pressure in L1 (issue 41): a tenant within
its soft quota never loses an object to another tenant's store, whatever the
quotas (their sum within what L1 keeps), the store sizes and their order, and
with some objects held by readers meanwhile."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config, L1Manager, L1Result, WriterTag
from kvtier.l1.quotas import OwnerLimit
from tests.conftest import make_key
from tests.ledger import assert_clean

PAGE = 4096
CAPACITY_PAGES = 64
LOW_WATERMARK = 0.6  # L1Config's default: what L1 keeps after a watermark round


@dataclass(frozen=True)
class Store:
    tenant: int
    count: int
    hold: bool  # published with a read lock (as write-back does), released at the next step


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, list[int], list[Store]]:
    pages = draw(st.integers(1, 3), label="pages per object")
    room = int(LOW_WATERMARK * CAPACITY_PAGES) // pages  # objects L1 keeps
    tenants = draw(st.integers(2, 4), label="tenants")
    quotas: list[int] = []  # soft quotas in objects, their sum within the room
    for left in range(tenants, 0, -1):
        quotas.append(draw(st.integers(1, room - sum(quotas) - (left - 1)), label="quota"))
    stores = draw(
        st.lists(
            st.builds(
                Store,
                st.integers(0, tenants - 1),
                st.integers(1, 2 * room),
                st.booleans(),
            ),
            min_size=1,
            max_size=25,
        ),
        label="stores",
    )
    return pages, quotas, stores


@pytest.mark.parametrize("policy", ["lru", "probation"])
@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_a_tenant_within_its_quota_never_loses_an_object_to_another_tenants_store(
    policy: str, scenario: tuple[int, list[int], list[Store]]
) -> None:
    pages, quotas, stores = scenario
    size = pages * PAGE
    config = L1Config(size_bytes=CAPACITY_PAGES * PAGE, populate=False, eviction_policy=policy)
    l1 = L1Manager(config)
    try:
        l1.set_owners(
            lambda salt: salt,
            {str(t): OwnerLimit(soft=q * size) for t, q in enumerate(quotas)},
        )
        held: list[ObjectKey] = []
        serial = 0
        for step, store in enumerate(stores):
            owner = str(store.tenant)
            before = _holdings(l1)
            usage = l1.owner_usage()
            keys = [make_key(serial + i, salt=owner) for i in range(store.count)]
            serial += store.count
            tag = WriterTag(f"w{step}")
            placements = l1.reserve_write(keys, [size] * len(keys), tag)
            staged = [
                k for k, p in zip(keys, placements, strict=True) if p.result is L1Result.SUCCESS
            ]
            l1.finish_read(held)
            held = []
            if store.hold:
                l1.finish_write_and_reserve_read(staged, tag)
                held = [k for k in staged if l1.contains(k)]
            else:
                l1.finish_write(staged, tag)
            after = _holdings(l1)
            for other, keys_before in before.items():
                within = usage[other]["bytes"] <= quotas[int(other)] * size
                if other != owner and within:
                    assert keys_before <= after.get(other, set()), (step, other)
            if not held:  # nothing is held by a reader: every tenant is within its quota
                for tenant, used in l1.owner_usage().items():
                    assert used["bytes"] <= quotas[int(tenant)] * size, (step, tenant)
        l1.finish_read(held)
        assert_clean(l1)
    finally:
        l1.close()


def _holdings(l1: L1Manager) -> dict[str, set[ObjectKey]]:
    out: dict[str, set[ObjectKey]] = {}
    for key, _ in l1.resident_objects():
        out.setdefault(key.salt, set()).add(key)
    return out
