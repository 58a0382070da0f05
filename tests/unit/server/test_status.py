"""The typed status document: ``fold`` puts each counter where the document
has it, a server's status survives JSON both ways, every counter its
components count has a field, and ``StatusCollector`` exports counters as
counters and gauges as gauges, with real labels."""

from __future__ import annotations

import logging

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.protocol import messages as p
from kvtier.protocol import status as s
from kvtier.server import status as server_status
from kvtier.server.core import CacheServer
from kvtier.server.limits import ServerLimits
from kvtier.server.metrics import StatusCollector
from kvtier.storage import StorageManager
from tests.conftest import FakeClock
from tests.unit.server.test_core import call, hashes, hello, store


@pytest.fixture
def server(storage: StorageManager, clock: FakeClock) -> CacheServer:
    limits = ServerLimits(session_ttl_s=100, client_ttl_s=1000)
    return CacheServer(storage, chunk_size=16, limits=limits, clock=clock)


def busy(server: CacheServer) -> None:
    """Most of what a server counts: hellos, stores, a lookup and its
    retrieve, pins, reports, refusals, a hand-off offered, taken and done."""
    for peer in (b"A", b"D"):
        assert isinstance(hello(server, peer), p.Welcome)
    hs = hashes(3)
    assert store(server, b"A", hs) == 3
    call(server, b"A", p.Lookup("r", [*hs, *hashes(1, seed=9)]))
    assert call(server, b"A", p.Query("r")) == p.QueryResult(3, {"L1": 3}, "not_in_l1")
    assert isinstance(call(server, b"A", p.Retrieve("r", 0, 3)), p.Objects)
    call(server, b"A", p.EndSession("r"))
    assert isinstance(call(server, b"A", p.Pin(hs[:1], 60.0)), p.Pinned)
    call(server, b"A", p.ShadowReport(checked=2, mismatched=1))
    call(server, b"A", p.QualityReport("blend", agreed=True, kl=0.1))
    call(
        server,
        b"A",
        p.UsageReport(prefill_s=0.064, computed_tokens=64, load_s=0.5, loaded_tokens=32),
    )
    refused = call(server, b"Z", p.Query("x"))  # no hello: refused
    assert isinstance(refused, p.Error) and refused.code == "no_hello"
    call(server, b"A", p.HandoffOffer("h", hs, 30.0, ""))
    assert call(server, b"D", p.HandoffTake("h", hs, "")) == p.HandoffState("granted")
    assert call(server, b"D", p.HandoffDone("h", "", "")) == p.HandoffState("released")


def test_fold_puts_plain_names_families_and_sections_in_their_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    flat = {
        "lookups": 2,
        "hit_tokens.L1": 32,
        "hit_tokens.fs": 16,
        "errors.forbidden": 1,
        "handoffs.offered": 4,
        "handoffs.refused.wrong_consumer": 2,
        "shadow_chunks.checked": 5,
    }
    counts = server_status.fold(s.ServerCounts, flat, "test")
    assert counts.lookups == 2 and counts.hit_tokens == {"L1": 32, "fs": 16}
    assert counts.errors == {"forbidden": 1}
    assert counts.handoffs == s.HandoffCounts(offered=4, refused={"wrong_consumer": 2})
    assert counts.shadow_chunks == s.ShadowChunks(checked=5)
    assert not [n for n in server_status.unmapped() if n.startswith("test.")]

    caplog.set_level(logging.WARNING, logger="kvtier.server.status")
    odd = {"no_such_counter": 1, "lookups.L1": 1, "handoffs": 3, "lookups": 1}
    assert server_status.fold(s.ServerCounts, odd, "odd") == s.ServerCounts(lookups=1)
    assert {n for n in server_status.unmapped() if n.startswith("odd.")} == {
        "odd.no_such_counter",
        "odd.lookups.L1",
        "odd.handoffs",
    }
    server_status.fold(s.ServerCounts, odd, "odd")  # logged once per name
    assert len([r for r in caplog.records if "has no field" in r.getMessage()]) == 3


def test_fold_renames_a_family_that_shares_a_counters_name() -> None:
    flat = {"recompute_cheaper_chunks": 3, "recompute_cheaper_chunks.fs": 2}
    prefetch = server_status.fold(
        s.PrefetchStatus,
        flat,
        "test",
        families={"recompute_cheaper_chunks": "recompute_cheaper_chunks_by_tier"},
    )
    assert prefetch.recompute_cheaper_chunks == 3
    assert prefetch.recompute_cheaper_chunks_by_tier == {"fs": 2}


def test_a_busy_servers_status_has_every_counter_and_round_trips(server: CacheServer) -> None:
    before = server_status.unmapped()
    busy(server)
    status = server.status()
    assert server_status.unmapped() == before  # no counter was dropped
    assert msgspec.json.decode(msgspec.json.encode(status), type=s.ServerStatus) == status
    counts = status.server
    assert (counts.hellos, counts.lookups, counts.hit_chunks) == (2, 1, 3)
    assert counts.hit_tokens == {"L1": 3 * 16} and counts.lookup_tokens == 4 * 16
    assert counts.errors == {"no_hello": 1}
    assert counts.shadow_chunks == s.ShadowChunks(checked=2, mismatched=1)
    assert (counts.handoffs.offered, counts.handoffs.consumed) == (1, 1)
    assert counts.pinned_chunks == 1
    assert status.storage.prefetch.hit_objects == {"L1": 3}
    assert status.storage.prefetch.miss_reasons == {"not_in_l1": 1}
    [row] = status.ledger
    assert (row.tenant, row.served_tokens, row.loaded_tokens) == ("default", {"L1": 48}, 32)
    assert row.load_seconds == 0.5
    assert status.namespaces == [row.namespace]


def test_a_status_that_does_not_fit_is_refused_naming_the_field(server: CacheServer) -> None:
    document = msgspec.to_builtins(server.status())
    document["storage"]["l1"]["used_bytes"] = "lots"
    with pytest.raises(msgspec.ValidationError, match=r"\$\.storage\.l1\.used_bytes"):
        s.decode(msgspec.json.encode(document))
    document["storage"]["l1"]["used_bytes"] = 0
    del document["boot_id"]
    with pytest.raises(msgspec.ValidationError, match="boot_id"):
        s.decode(msgspec.json.encode(document))


def test_a_status_too_long_or_too_deep_is_refused_saying_so(
    server: CacheServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = msgspec.json.encode(server.status())
    with monkeypatch.context() as patched:
        patched.setattr(s, "MAX_STATUS_BYTES", len(body))
        assert s.decode(body).boot_id == server.boot_id
        with pytest.raises(msgspec.DecodeError, match=f"over {len(body)} bytes"):
            s.decode(body + b" ")
    deep = b'{"deep":' + b"[" * 100_000 + b"]" * 100_000 + b","
    with pytest.raises(msgspec.DecodeError, match="nests deeper"):
        s.decode(deep + body[1:])


def scrape(status: s.ServerStatus) -> dict[str, tuple[str, dict[tuple[str, ...], float]]]:
    """Metric family -> (type, {sorted label items of a sample: value})."""
    registry = CollectorRegistry()
    registry.register(StatusCollector(lambda: status))
    out: dict[str, tuple[str, dict[tuple[str, ...], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        samples = {
            tuple(f"{k}={v}" for k, v in sorted(sample.labels.items())): sample.value
            for sample in family.samples
            if not sample.name.endswith("_created")
        }
        out[family.name] = (family.type, samples)
    return out


def test_counters_are_counters_gauges_are_gauges_families_are_labels(
    server: CacheServer,
) -> None:
    busy(server)
    metrics = scrape(server.status())
    assert metrics["kvtier_server_lookups"] == ("counter", {(): 1.0})
    assert metrics["kvtier_server_hit_tokens"] == ("counter", {("tier=L1",): 48.0})
    assert metrics["kvtier_server_errors"] == ("counter", {("reason=no_hello",): 1.0})
    assert metrics["kvtier_server_handoffs_consumed"] == ("counter", {(): 1.0})
    assert metrics["kvtier_storage_l1_resident_objects"] == ("gauge", {(): 3.0})
    assert metrics["kvtier_storage_prefetch_miss_reasons"] == (
        "counter",
        {("reason=not_in_l1",): 1.0},
    )
    assert metrics["kvtier_clients"] == ("gauge", {(): 2.0})
    assert metrics["kvtier_chunk_size_frozen"] == ("gauge", {(): 1.0})
    row = ("namespace=" + server.status().ledger[0].namespace, "tenant=default")
    assert metrics["kvtier_ledger_served_tokens"] == ("counter", {(*row, "tier=L1"): 48.0})
    assert metrics["kvtier_ledger_loaded_tokens"] == ("counter", {row: 32.0})
    assert metrics["kvtier_ledger_load_seconds"] == ("counter", {row: 0.5})
    assert metrics["kvtier_ledger_saved_seconds"][0] == "gauge"
    data = ("kvtier_layouts", "kvtier_hash_namespaces", "kvtier_storage_l1_eviction_policy")
    assert not [name for name in metrics if name.startswith(data)]  # data, not metrics


def test_adapters_are_a_label_and_nested_families_take_both_labels() -> None:
    l1 = s.L1Status()
    adapter = s.L2AdapterStatus(name="fs", store_keys=3, failures={"not_found": 2}, objects=3)
    status = s.ServerStatus(
        boot_id="b",
        protocol=p.PROTOCOL_VERSION,
        hash_algorithm=p.HASH_ALGORITHM,
        chunk_size=16,
        chunk_size_frozen=False,
        uptime_s=1.5,
        l2_usage=s.L2Usage(tenant_bytes={"acme": {"fs": 7}}),
        server=s.ServerCounts(),
        storage=s.StorageStatus(
            l1=l1,
            l2={"fs": adapter},
            store=s.StoreStatus(stored_objects={"fs": 3}),
            prefetch=s.PrefetchStatus(),
        ),
    )
    metrics = scrape(status)
    assert metrics["kvtier_storage_l2_store_keys"] == ("counter", {("adapter=fs",): 3.0})
    assert metrics["kvtier_storage_l2_failures"] == (
        "counter",
        {("adapter=fs", "reason=not_found"): 2.0},
    )
    assert metrics["kvtier_storage_l2_objects"] == ("gauge", {("adapter=fs",): 3.0})
    assert metrics["kvtier_storage_l2_healthy"] == ("gauge", {("adapter=fs",): 1.0})
    assert "kvtier_storage_l2_codec_ratio" not in metrics  # None: not measured yet
    assert metrics["kvtier_l2_usage_tenant_bytes"] == (
        "gauge",
        {("adapter=fs", "tenant=acme"): 7.0},
    )
    assert metrics["kvtier_storage_store_stored_objects"] == ("counter", {("adapter=fs",): 3.0})
    assert metrics["kvtier_uptime_s"] == ("gauge", {(): 1.5})
