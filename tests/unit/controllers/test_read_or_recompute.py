"""Read or recompute: the cost model (``kvtier.read_or_recompute``) and the
prefetch controller's choice per request: chunks from a tier are loaded
only as far as that beats the engine's recompute time, the rest is a
counted miss (``recompute_cheaper``) with every lease given back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.controllers import L1_TIER, LookupResult, MissReason
from kvtier.keys import ObjectKey
from kvtier.read_or_recompute import LinkCost, LinkEstimate, cheapest_prefix, verdict
from kvtier.storage import StorageManager
from tests import storage_parts
from tests.conftest import make_key
from tests.unit.controllers import LAYOUT, Stack, assert_settled, seed_l2

SLOW = LinkCost(latency_s=0.01, bytes_per_s=1e6)  # 10 ms, then 1 MB/s


def test_verdict_and_link_cost() -> None:
    assert verdict(0.1, 0.2) == "load" and verdict(0.2, 0.1) == "recompute"
    assert SLOW.seconds(0) == 0.0
    assert SLOW.seconds(1_000_000) == pytest.approx(1.01)


def test_cheapest_prefix_loads_what_saves_time() -> None:
    mb = [{"slow": 1_000_000}] * 4  # 1 s a chunk from "slow"
    assert cheapest_prefix(mb, {"slow": SLOW}, recompute_s_per_chunk=2.0) == 4
    assert cheapest_prefix(mb, {"slow": SLOW}, recompute_s_per_chunk=0.5) == 0
    # chunks L1 already has are free: loading stops before the slow ones only
    mixed = [{}, {}, {"slow": 1_000_000}]
    assert cheapest_prefix(mixed, {"slow": SLOW}, recompute_s_per_chunk=0.5) == 2
    # the latency is paid once: enough chunks amortize it
    small = [{"slow": 1_000}] * 10  # 1 ms a chunk + 10 ms once
    assert cheapest_prefix(small[:1], {"slow": SLOW}, recompute_s_per_chunk=0.004) == 0
    assert cheapest_prefix(small, {"slow": SLOW}, recompute_s_per_chunk=0.004) == 10
    # tiers load in parallel: the slower one sets the time
    both = [{"slow": 500_000, "fast": 500_000}] * 2
    costs = {"slow": SLOW, "fast": LinkCost(0.0, 1e9)}
    assert cheapest_prefix(both, costs, recompute_s_per_chunk=0.6) == 2
    # a tier not measured yet is loaded (and learned)
    assert cheapest_prefix(mb, {"slow": None}, recompute_s_per_chunk=1e-9) == 4


def test_link_estimate_learns_latency_and_bandwidth() -> None:
    link = LinkEstimate()
    link.round_trip(0.01)
    link.load(1.01, 1_000_000)
    assert link.cost() is None  # one load is not enough
    link.load(1.01, 1_000_000)
    cost = link.cost()
    assert cost is not None
    assert cost.latency_s == pytest.approx(0.01)
    assert cost.bytes_per_s == pytest.approx(1e6)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    made = Stack(tmp_path)
    yield made
    made.close_all()


def lookup(storage: StorageManager, keys: list[ObjectKey], per_chunk: float | None) -> LookupResult:
    handle = storage.submit_lookup([(k,) for k in keys], {0: LAYOUT}, None, per_chunk)
    result = storage.collect(handle, 10)
    assert result is not None
    return result


def test_a_slow_tier_is_read_only_where_it_beats_recompute(stack: Stack) -> None:
    # 20 ms a round trip and ~8 ms an object (8 KiB at 1 MB/s)
    storage = stack.build({"type": "mock", "latency_s": 0.02, "bandwidth_bytes_per_s": 1e6})
    mock = storage_parts.adapters(storage)[0]
    keys = [make_key(i) for i in range(6)]
    seed_l2(storage, keys, keep=keys[:2])
    for _ in range(2):  # without a rate every chunk is loaded; the tier's cost is learned
        result = lookup(storage, keys, None)
        assert result.hit_chunks == 6
        storage.release(keys)
        storage.delete_l1(keys[2:])
    learned = storage.status()["prefetch"]
    assert learned["link_latency_s.mock"] > 0 and learned["link_bytes_per_s.mock"] > 0
    loads = mock.status()["load_keys"]

    # recomputing a chunk takes a microsecond: nothing is read from the mock
    result = lookup(storage, keys, 1e-6)
    assert result.hit_chunks == 2 and dict(result.objects_by_tier) == {L1_TIER: 2}
    assert result.miss_reason is MissReason.RECOMPUTE_CHEAPER
    storage.release(keys[:2])
    status = storage.status()["prefetch"]
    assert status["recompute_cheaper_chunks"] == 4
    assert status["recompute_cheaper_chunks.mock"] == 4
    assert status["miss_reasons.recompute_cheaper"] == 1
    assert mock.status()["load_keys"] == loads  # not one load
    assert mock.status()["leases"] == 0  # every lease the lookup took was given back

    # ten seconds a chunk: everything is read
    result = lookup(storage, keys, 10.0)
    assert result.hit_chunks == 6 and result.miss_reason is None
    assert dict(result.objects_by_tier) == {L1_TIER: 2, "mock": 4}
    storage.release(keys)
    assert mock.status()["load_keys"] == loads + 4
    assert_settled(storage)
