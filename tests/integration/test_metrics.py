"""``GET /metrics``: Prometheus text that parses; counters typed as counters
(``_total``), gauges as gauges, families with real labels (``tier``,
``adapter``, ``reason``, ``tenant``...); counters that move by exactly what
the requests did; and ``/status`` that decodes as a ``ServerStatus`` with the
same numbers."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvtier.keys import model_label
from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient
from kvtier.protocol.status import decode
from tests.integration import workload as w
from tests.integration.harness import (
    Server,
    ServerFactory,
    tenants_toml,
    wait_for,
    wait_written_back,
)

SIZE = w.object_bytes(256)
Labels = tuple[tuple[str, str], ...]


class Scrape:
    """One ``/metrics`` text: each family's type, and each sample's value by
    sample name and labels."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.values: dict[tuple[str, Labels], float] = {}
        for family in text_string_to_metric_families(text):
            assert family.name.startswith("kvtier_"), family.name
            self.types[family.name] = family.type
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                assert key not in self.values, sample  # no duplicate series
                self.values[key] = sample.value

    def __call__(self, name: str, **labels: str) -> float:
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)

    def labels(self, name: str) -> set[Labels]:
        return {labels for sample, labels in self.values if sample == name}


def scrape(server: Server, token: str = "") -> Scrape:
    return Scrape(server.http_get("/metrics", token=token)[1].decode())


def test_metrics_parse_and_counters_follow_requests(server: Server) -> None:
    client = CacheClient(w.client_config(server.rpc, shm=False))
    try:
        # The snapshot behind /metrics is refreshed every tick: wait for the hello.
        before = wait_for(lambda: scrape(server), lambda s: s("kvtier_server_hellos_total") == 1)
        assert before("kvtier_clients") == 1
        assert before("kvtier_chunk_size") == 256
        assert before("kvtier_protocol") == p.PROTOCOL_VERSION

        hashes = w.chunk_hashes(256, seed=71, n_chunks=4)
        assert client.store("s", hashes[:3], w.payloads(71, 3, SIZE)) == 3
        state = client.lookup("r", hashes)  # three stored chunks, then one never stored
        assert client.query(state, timeout_s=10.0) == 3
        assert state.miss_reason == "not_found"  # the server's fs L2 was asked too
        out = w.empty_buffers(3, SIZE)
        assert client.retrieve_into("r", 0, 3, out)
        with w.raw_dealer(server.rpc) as socket:  # one refused request
            reply, _ = w.call(socket, p.Query("r"))
            assert isinstance(reply, p.Error) and reply.code == "no_hello"

        after = wait_for(
            lambda: scrape(server),
            lambda s: (
                s("kvtier_server_errors_total", reason="no_hello") == 1
                and s("kvtier_storage_store_stored_objects_total", adapter="fs") == 3
            ),
        )
    finally:
        client.close()

    def delta(name: str, **labels: str) -> float:
        return after(name, **labels) - before(name, **labels)

    assert delta("kvtier_server_stored_objects_total") == 3
    assert delta("kvtier_server_lookups_total") == 1
    assert delta("kvtier_server_hit_chunks_total") == 3
    assert delta("kvtier_server_hit_tokens_total", tier="L1") == 3 * 256
    assert delta("kvtier_server_lookup_tokens_total") == 4 * 256
    assert delta("kvtier_server_retrieved_objects_total") == 3
    assert delta("kvtier_server_errors_total", reason="no_hello") == 1
    assert delta("kvtier_server_hellos_total") == 0
    assert delta("kvtier_storage_prefetch_lookups_total") == 1
    assert delta("kvtier_storage_prefetch_hit_chunks_total") == 3
    assert delta("kvtier_storage_prefetch_hit_objects_total", tier="L1") == 3
    assert delta("kvtier_storage_prefetch_miss_reasons_total", reason="not_found") == 1
    assert after("kvtier_storage_l2_store_ok_total", adapter="fs") == 3
    assert after("kvtier_storage_l2_healthy", adapter="fs") == 1
    assert after("kvtier_storage_l1_resident_objects") == 3
    assert after("kvtier_storage_l1_used_bytes") == 3 * SIZE
    assert after("kvtier_storage_held_lookup_locks") == 0
    assert after("kvtier_storage_l1_locked_bytes") == 0
    assert after("kvtier_store_reservations") == 0
    # Histograms: one lookup answered, one bytes store, one retrieve.
    assert delta("kvtier_lookup_seconds_count") == 1
    assert delta("kvtier_store_seconds_count") == 1
    assert delta("kvtier_retrieve_seconds_count") == 1

    # Types: counters are counters, levels are gauges, latencies histograms.
    types = after.types
    for name in (
        "kvtier_server_lookups",
        "kvtier_server_hit_tokens",
        "kvtier_server_errors",
        "kvtier_storage_prefetch_miss_reasons",
        "kvtier_storage_l2_store_ok",
        "kvtier_storage_store_stored_objects",
        "kvtier_ledger_served_tokens",
        "kvtier_transport_connections",
    ):
        assert types[name] == "counter", name
    for name in (
        "kvtier_clients",
        "kvtier_uptime_s",
        "kvtier_storage_l1_used_bytes",
        "kvtier_storage_l2_healthy",
        "kvtier_storage_prefetch_inflight_objects",
        "kvtier_handoffs_held",
        "kvtier_ledger_saved_seconds",
    ):
        assert types[name] == "gauge", name
    assert types["kvtier_lookup_seconds"] == "histogram"
    # No packed ``key`` label is left anywhere.
    assert not [k for k in after.values if any(label == "key" for label, _ in k[1])]
    (ledger,) = after.labels("kvtier_ledger_served_tokens_total")
    assert dict(ledger) == {
        "tenant": "default",
        "namespace": f"{model_label(w.MODEL)}@",
        "tier": "L1",
    }

    # /status is a ServerStatus with the same numbers (a later snapshot: at least as many).
    status = decode(server.http_get("/status")[1])
    assert status.server.hit_tokens["L1"] >= after("kvtier_server_hit_tokens_total", tier="L1")
    assert status.server.errors == {"no_hello": 1}
    assert status.storage.store.stored_objects == {"fs": 3}
    assert status.storage.l2["fs"].store_ok == 3
    assert "has no field" not in server.log  # every counter the server counted is typed


def test_metrics_count_misses_and_l2_hits(server: Server) -> None:
    client = CacheClient(w.client_config(server.rpc, shm=True))
    try:
        hashes = w.chunk_hashes(256, seed=72, n_chunks=2)
        assert client.store("s", hashes, w.payloads(72, 2, SIZE)) == 2
        wait_written_back(client.status, 2)
        before = scrape(server)
        code, body = server.http_get("/clear", method="POST")  # L1 forgets; the fs L2 has them
        assert (code, body) == (200, b'{"cleared": 2}')
        l2 = client.lookup("l2", hashes)
        assert client.query(l2, timeout_s=10.0) == 2 and l2.miss_reason == ""  # a full hit
        client.end_session("l2")
        assert client.query(client.lookup("miss", w.chunk_hashes(256, 73, 2)), 10.0) == 0
        after = wait_for(
            lambda: scrape(server),
            lambda s: s("kvtier_server_lookups_total") == before("kvtier_server_lookups_total") + 2,
        )
    finally:
        client.close()

    def delta(name: str, **labels: str) -> float:
        return after(name, **labels) - before(name, **labels)

    assert delta("kvtier_server_lookups_total") == 2
    assert delta("kvtier_server_hit_chunks_total") == 2
    assert delta("kvtier_server_hit_tokens_total", tier="fs") == 2 * 256
    assert delta("kvtier_storage_prefetch_hit_objects_total", tier="fs") == 2
    assert delta("kvtier_storage_prefetch_hit_objects_total", tier="L1") == 0
    assert delta("kvtier_storage_prefetch_loaded_objects_total", adapter="fs") == 2
    assert delta("kvtier_storage_prefetch_loaded_bytes_total", adapter="fs") == 2 * SIZE
    assert after("kvtier_storage_l1_resident_objects") == 2
    assert after("kvtier_storage_held_lookup_locks") == 0


def test_tenants_are_labels(kvtier_server: ServerFactory, tmp_path: Path) -> None:
    """A tenants file's names label the per-tenant numbers (L1 bytes)."""
    path = tmp_path / "tenants.toml"
    path.write_text(tenants_toml())
    server = kvtier_server.start("--tenants-file", str(path))
    client = CacheClient(w.client_config(server.rpc, auth_token="acme-token"))
    try:
        hashes = w.chunk_hashes(256, seed=74, n_chunks=2)
        assert client.store("s", hashes, w.payloads(74, 2, SIZE)) == 2
        seen = wait_for(
            lambda: scrape(server, token="ops-token"),
            lambda s: s("kvtier_storage_l1_tenant_bytes", tenant="acme") == 2 * SIZE,
        )
    finally:
        client.close()
    assert seen.types["kvtier_storage_l1_tenant_bytes"] == "gauge"
    assert seen("kvtier_storage_l1_tenant_pinned_bytes", tenant="acme") == 0
