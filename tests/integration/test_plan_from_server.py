"""``kvtier plan --from-server``: the layout, chunk size and traffic of a real
running server, read from its /status, become the plan's inputs."""

from __future__ import annotations

import json

import pytest

from kvtier.commands.cli import main
from kvtier.keys import model_label
from kvtier.planner.observed import observe, read_status
from kvtier.protocol.client import CacheClient
from tests.integration import workload as w
from tests.integration.harness import Server, ServerFactory, wait_for, wait_written_back

CHUNK = 256
SIZE = w.object_bytes(CHUNK)


def lookups(server: Server) -> int:
    return read_status(server.http).server.lookups


def test_observed_window_and_plan(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    client = CacheClient(w.client_config(server.rpc, shm=False))
    try:
        hashes = w.chunk_hashes(CHUNK, seed=5, n_chunks=5)
        assert client.store("s", hashes[:4], w.payloads(5, 4, SIZE)) == 4
        wait_written_back(client.status, 4)
        assert server.http_get("/clear", method="POST")[0] == 200  # hits now start in fs
        wait_for(lambda: server.status()["layouts"], bool)  # /status is refreshed each tick

        def traffic(seconds: float) -> None:
            """Runs between the two /status readings instead of a sleep."""
            for i in range(3):  # 5 chunks looked up, 4 hit: fs first, then L1
                assert client.query(client.lookup(f"r{i}", hashes), timeout_s=10.0) == 4
                client.end_session(f"r{i}")
            fresh = w.chunk_hashes(CHUNK, seed=6, n_chunks=2)
            assert client.store("t", fresh, w.payloads(6, 2, SIZE)) == 2
            wait_for(lambda: lookups(server), lambda n: n == 3)

        seen = observe(server.http, sample_s=1.0, sleep=traffic)
    finally:
        client.close()

    assert (seen.lookups, seen.lookup_tokens) == (3, 3 * 5 * CHUNK)
    assert seen.hit_tokens == {"fs": 4 * CHUNK, "L1": 2 * 4 * CHUNK}
    assert seen.stored_objects == 2
    assert seen.window_s > 0 and seen.qps == 3 / seen.window_s
    assert seen.prefix_tokens == 5 * CHUNK
    assert seen.l2_hit_fraction == 4 / 15  # only the fs hits cross to L2
    assert seen.workload_fields()["write_fraction"] == 2 / 15
    assert seen.namespace == f"{model_label(w.MODEL)}@"  # no salt

    # the client has gone; its layout is still known, and the CLI plans it
    assert main(["plan", "--from-server", server.http, "--sample-s", "0", "--json", "-"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["shape"]["layers"] == w.LAYOUT.num_layers
    assert plan["shape"]["kv_heads"] == w.LAYOUT.kv_heads and plan["shape"]["dtype"] == "fp16"
    assert plan["bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert plan["bytes_per_object"] == SIZE
    assert plan["deployment"]["chunk_size"] == CHUNK and plan["deployment"]["tp"] == 1
    assert plan["observed"]["lookups"] == 3  # since the server started
    assert plan["workload"]["prefix_tokens"] == 5 * CHUNK
    assert plan["workload"]["qps"] == 3 / plan["observed"]["window_s"]

    assert main(["plan", "--from-server", server.http, "--sample-s", "0", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "Observed on" in out and "TP 2" in out  # a flag wins over the server


def test_server_errors_name_what_to_do(
    kvtier_server: ServerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    quiet = kvtier_server.start()
    with pytest.raises(ValueError, match="no engine has connected yet"):
        observe(quiet.http, sample_s=0)
    guarded = kvtier_server.start(token="s3cret")
    assert main(["plan", "--from-server", guarded.http, "--sample-s", "0"]) == 2
    assert "HTTP 401 (pass --auth-token-file or set KVTIER_AUTH_TOKEN)" in capsys.readouterr().err
    client = CacheClient(w.client_config(guarded.rpc, shm=False, auth_token="s3cret"))
    try:
        wait_for(lambda: guarded.status()["layouts"], bool)
        with pytest.raises(ValueError, match="no lookups in its uptime"):
            observe(guarded.http, token="s3cret", sample_s=0)
        with pytest.raises(ValueError, match="--namespace 'other@' has not connected"):
            observe(guarded.http, token="s3cret", sample_s=0, namespace="other@")
    finally:
        client.close()
    quiet.stop()
    with pytest.raises(ValueError, match="cannot reach it"):
        observe(quiet.http, sample_s=0)
