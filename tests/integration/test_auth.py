"""The server's auth token (``--auth-token-file``, ``KVTIER_AUTH_TOKEN``): hello
and the admin endpoints (but ``/healthz``) need it."""

from __future__ import annotations

import json

import pytest

from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient
from tests.integration import workload as w
from tests.integration.harness import Server, ServerFactory, wait_written_back

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def auth_server(module_servers: ServerFactory) -> Server:
    return module_servers.start(token=TOKEN)


@pytest.mark.parametrize("token", ["", "wrong-token", TOKEN[:-1]])
def test_client_without_the_token_is_refused_and_degraded(auth_server: Server, token: str) -> None:
    with w.raw_dealer(auth_server.rpc) as observer:  # sees the live tables, with the token
        assert isinstance(w.call(observer, w.hello(token=TOKEN))[0], p.Welcome)
        before = w.status_via(observer)
        client = CacheClient(
            w.client_config(auth_server.rpc, auth_token=token, request_timeout_s=2.0, retry_s=60.0)
        )
        try:
            assert client.chunk_size is None and client.degraded
            hashes = w.chunk_hashes(256, 1, 2)
            state = client.lookup("r", hashes)
            assert (state.acked, state.hit_chunks) == (False, 0)
            assert client.store("s", hashes, w.payloads(1, 2, w.object_bytes(256))) == 0
        finally:
            client.close()
        after = w.status_via(observer)
    refused = after["server"]["errors"]["unauthorized"]
    assert refused == before["server"]["errors"].get("unauthorized", 0) + 1
    assert after["clients"] == before["clients"]  # nobody registered
    resident = after["storage"]["l1"]["resident_objects"]
    assert resident == before["storage"]["l1"]["resident_objects"]  # nothing stored


@pytest.mark.parametrize("token", ["", "wrong-token"])
def test_raw_hello_without_the_token_gets_unauthorized(auth_server: Server, token: str) -> None:
    with w.raw_dealer(auth_server.rpc) as socket:
        reply, _ = w.call(socket, w.hello(token=token))
        assert isinstance(reply, p.Error)
        assert reply.code == "unauthorized"
        # Still unregistered: requests that need a session are refused.
        reply, _ = w.call(socket, p.Lookup("r", w.chunk_hashes(256, 1, 1)))
        assert isinstance(reply, p.Error) and reply.code == "no_hello"


def test_client_with_the_token_works(auth_server: Server) -> None:
    client = CacheClient(w.client_config(auth_server.rpc, auth_token=TOKEN))
    try:
        assert client.chunk_size == 256
        hashes = w.chunk_hashes(256, 2, 2)
        assert client.store("s", hashes, w.payloads(2, 2, w.object_bytes(256))) == 2
        assert client.query(client.lookup("r", hashes), timeout_s=10.0) == 2
        client.release("r", 0, 2)
        assert client.stats.errors == {}
    finally:
        client.close()


@pytest.mark.parametrize("path", ["/status", "/metrics"])
def test_admin_reads_need_the_bearer_token(auth_server: Server, path: str) -> None:
    assert auth_server.http_get(path, token="") == (401, b"unauthorized\n")
    assert auth_server.http_get(path, token="wrong")[0] == 401
    code, body = auth_server.http_get(path, token=TOKEN)
    assert code == 200
    if path == "/status":
        assert json.loads(body)["boot_id"] == auth_server.boot_id
    else:
        assert b"kvtier_server_" in body or b"kvtier_storage_" in body


def test_admin_clear_needs_the_bearer_token(auth_server: Server) -> None:
    client = CacheClient(w.client_config(auth_server.rpc, auth_token=TOKEN))
    try:
        hashes = w.chunk_hashes(256, 3, 1)
        assert client.store("s", hashes, w.payloads(3, 1, w.object_bytes(256))) == 1
        # Wait until the fs L2 has every resident object: one being written is
        # locked, and /clear skips it.
        live = client.status()
        assert live is not None
        resident = live.storage.l1.resident_objects
        assert resident >= 1
        wait_written_back(client.status, resident)

        assert auth_server.http_get("/clear", token="", method="POST")[0] == 401
        assert auth_server.http_get("/clear", token="wrong", method="POST")[0] == 401
        live = client.status()
        assert live is not None and live.storage.l1.resident_objects == resident

        expected = json.dumps({"cleared": resident}).encode()
        assert auth_server.http_get("/clear", token=TOKEN, method="POST") == (200, expected)
        assert client.query(client.lookup("r", hashes), timeout_s=10.0) == 1  # from the fs L2
        client.release("r", 0, 1)
    finally:
        client.close()


def test_healthz_stays_open(auth_server: Server) -> None:
    assert auth_server.http_get("/healthz", token="") == (200, b"ok\n")
    assert auth_server.http_get("/healthz", token="wrong") == (200, b"ok\n")


def test_without_a_token_everything_is_open(server: Server) -> None:
    for path in ("/healthz", "/status", "/metrics"):
        assert server.http_get(path, token="")[0] == 200
    assert server.http_get("/nope", token="")[0] == 404
    client = CacheClient(w.client_config(server.rpc, auth_token="anything"))
    try:
        assert client.chunk_size == 256  # a token nobody asked for is ignored
    finally:
        client.close()


def test_rpc_status_needs_the_token_too(auth_server: Server) -> None:
    """Regression: STATUS over RPC used to answer any peer, hello or not, with
    every registered namespace (model@salt), while GET /status needed the token."""
    client = CacheClient(w.client_config(auth_server.rpc, auth_token=TOKEN, salt="tenant-a"))
    try:
        assert client.chunk_size == 256
        with w.raw_dealer(auth_server.rpc) as socket:  # no hello, no token
            reply, _ = w.call(socket, p.Status())
        assert isinstance(reply, p.Error), reply
        assert reply.code == "no_hello"
    finally:
        client.close()
