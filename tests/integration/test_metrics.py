"""``GET /metrics``: Prometheus text that parses, and counters that move by
exactly what the requests did."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient
from tests.integration import workload as w
from tests.integration.harness import Server, wait_for, wait_written_back

SIZE = w.object_bytes(256)
Samples = dict[tuple[str, str], float]


def samples(text: str) -> Samples:
    """(sample name, ``key`` label) -> value, for every sample of every family."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("kvtier_"), family.name
        for sample in family.samples:
            key = sample.labels.get("key", "")
            if family.type == "histogram":
                key = sample.labels.get("le", "")
            assert (sample.name, key) not in out, sample  # no duplicate series
            out[(sample.name, key)] = sample.value
    return out


def value(s: Samples, name: str, key: str = "") -> float:
    return s.get((name, key), 0.0)


def delta(after: Samples, before: Samples, name: str, key: str = "") -> float:
    return value(after, name, key) - value(before, name, key)


def test_metrics_parse_and_counters_follow_requests(server: Server) -> None:
    client = CacheClient(w.client_config(server.rpc, shm=False))
    try:
        # The snapshot behind /metrics is refreshed every tick: wait for the hello.
        before = wait_for(
            lambda: samples(server.metrics()),
            lambda s: value(s, "kvtier_server_hellos") == 1,
        )
        assert value(before, "kvtier_server_hellos") == 1
        assert value(before, "kvtier_clients") == 1
        assert value(before, "kvtier_chunk_size") == 256
        assert value(before, "kvtier_protocol") == p.PROTOCOL_VERSION

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
            lambda: samples(server.metrics()),
            lambda s: (
                value(s, "kvtier_server_errors", "no_hello") == 1
                and value(s, "kvtier_storage_store_stored_objects", "fs") == 3
            ),
        )
    finally:
        client.close()

    assert delta(after, before, "kvtier_server_stored_objects") == 3
    assert delta(after, before, "kvtier_server_lookups") == 1
    assert delta(after, before, "kvtier_server_hit_chunks") == 3
    assert delta(after, before, "kvtier_server_retrieved_objects") == 3
    assert delta(after, before, "kvtier_server_errors", "no_hello") == 1
    assert delta(after, before, "kvtier_server_hellos") == 0
    assert delta(after, before, "kvtier_storage_prefetch_lookups") == 1
    assert delta(after, before, "kvtier_storage_prefetch_hit_chunks") == 3
    assert delta(after, before, "kvtier_storage_prefetch_hit_objects", "L1") == 3
    assert delta(after, before, "kvtier_storage_prefetch_miss_reasons", "not_found") == 1
    assert value(after, "kvtier_storage_store_stored_objects", "fs") == 3
    assert value(after, "kvtier_storage_l1_resident_objects") == 3
    assert value(after, "kvtier_storage_l1_used_bytes") == 3 * SIZE
    assert value(after, "kvtier_storage_held_lookup_locks") == 0
    assert value(after, "kvtier_storage_l1_locked_bytes") == 0
    assert value(after, "kvtier_store_reservations") == 0
    # Histograms: one lookup answered, one bytes store, one retrieve.
    assert delta(after, before, "kvtier_lookup_seconds_count") == 1
    assert delta(after, before, "kvtier_store_seconds_count") == 1
    assert delta(after, before, "kvtier_retrieve_seconds_count") == 1


def test_metrics_count_misses_and_l2_hits(server: Server) -> None:
    client = CacheClient(w.client_config(server.rpc, shm=True))
    try:
        hashes = w.chunk_hashes(256, seed=72, n_chunks=2)
        assert client.store("s", hashes, w.payloads(72, 2, SIZE)) == 2
        wait_written_back(client.status, 2)
        before = samples(server.metrics())
        code, body = server.http_get("/clear", method="POST")  # L1 forgets; the fs L2 has them
        assert (code, body) == (200, b'{"cleared": 2}')
        l2 = client.lookup("l2", hashes)
        assert client.query(l2, timeout_s=10.0) == 2 and l2.miss_reason == ""  # a full hit
        client.end_session("l2")
        assert client.query(client.lookup("miss", w.chunk_hashes(256, 73, 2)), 10.0) == 0
        after = wait_for(
            lambda: samples(server.metrics()),
            lambda s: (
                value(s, "kvtier_server_lookups") == value(before, "kvtier_server_lookups") + 2
            ),
        )
    finally:
        client.close()
    assert delta(after, before, "kvtier_server_lookups") == 2
    assert delta(after, before, "kvtier_server_hit_chunks") == 2
    assert delta(after, before, "kvtier_storage_prefetch_hit_objects", "fs") == 2
    assert delta(after, before, "kvtier_storage_prefetch_hit_objects", "L1") == 0
    assert delta(after, before, "kvtier_storage_prefetch_loaded_objects", "fs") == 2
    assert value(after, "kvtier_storage_l1_resident_objects") == 2
    assert value(after, "kvtier_storage_held_lookup_locks") == 0
