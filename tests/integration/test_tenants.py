"""Tenants enforced by a real ``kvtier serve --tenants-file``: a client can
only use its tenant's salts, another tenant's objects are never found, in L1
and in the fs L2 after a restart; a shared namespace is read-only for its
readers; the admin endpoints and STATUS need an admin tenant."""

from __future__ import annotations

from pathlib import Path

from kvtier.server import protocol as p
from kvtier.server.client import CacheClient
from kvtier.server.tenants import token_digest
from tests.integration import workload as w
from tests.integration.harness import ServerFactory, wait_written_back

TENANTS = f"""
[[tenant]]
name = "acme"
token_sha256 = ["{token_digest("acme-token")}"]
salts = ["acme"]
read = ["public"]

[[tenant]]
name = "globex"
token_sha256 = ["{token_digest("globex-token")}"]
salts = ["globex"]

[[tenant]]
name = "ops"
token_sha256 = ["{token_digest("ops-token")}"]
salts = ["public"]
admin = true
"""


def client(server_rpc: str, token: str, salt: str = "") -> CacheClient:
    return CacheClient(
        w.client_config(server_rpc, auth_token=token, salt=salt, request_timeout_s=2.0)
    )


def hits(c: CacheClient, hashes: list[bytes], request: str) -> int:
    found = c.query(c.lookup(request, hashes), timeout_s=10.0)
    if found:
        c.release(request, 0, found)
    return found or 0


def test_tenants_never_see_each_others_objects(
    kvtier_server: ServerFactory, tmp_path: Path
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    server = kvtier_server.start("--tenants-file", str(path))
    hashes = w.chunk_hashes(256, 5, 3)
    acme, globex, ops = (
        client(server.rpc, "acme-token"),
        client(server.rpc, "globex-token"),
        (client(server.rpc, "ops-token")),
    )
    intruder = client(server.rpc, "globex-token", salt="acme")  # another tenant's salt
    try:
        assert acme.store("s", hashes, w.payloads(5, 3, w.object_bytes(256))) == 3
        assert intruder.chunk_size is None and intruder.degraded  # its hello was refused
        assert hits(globex, hashes, "g") == 0 and hits(acme, hashes, "a") == 3
        assert globex.store("s2", hashes, w.payloads(6, 3, w.object_bytes(256))) == 3
        assert hits(globex, hashes, "g2") == 3  # its own objects, under its own salt
        status = ops.status()
        assert status is not None and status["server"]["errors.forbidden"] == 1
        assert acme.status() is None  # STATUS is for admin tenants
        wait_written_back(ops.status, 6)
    finally:
        for c in (acme, globex, ops, intruder):
            c.close()

    restarted = kvtier_server.restart(server, "--tenants-file", str(path))
    acme, globex = client(restarted.rpc, "acme-token"), client(restarted.rpc, "globex-token")
    try:
        assert hits(acme, hashes, "a") == 3 and hits(globex, hashes, "g") == 3  # from fs
        stranger = client(restarted.rpc, "nobody")
        assert stranger.chunk_size is None
        stranger.close()
    finally:
        acme.close()
        globex.close()


def test_a_shared_namespace_is_read_only_for_its_readers(
    kvtier_server: ServerFactory, tmp_path: Path
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    server = kvtier_server.start("--tenants-file", str(path))
    hashes = w.chunk_hashes(256, 7, 2)
    owner, reader = client(server.rpc, "ops-token"), client(server.rpc, "acme-token", "public")
    try:
        assert owner.store("s", hashes, w.payloads(7, 2, w.object_bytes(256))) == 2
        assert hits(reader, hashes, "r") == 2
        assert (
            reader.store("s", w.chunk_hashes(256, 8, 1), w.payloads(8, 1, w.object_bytes(256))) == 0
        )
        status = owner.status()
        assert status is not None and status["server"]["errors.read_only"] == 1
    finally:
        owner.close()
        reader.close()


def test_the_admin_endpoints_need_an_admin_tenant(
    kvtier_server: ServerFactory, tmp_path: Path
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    server = kvtier_server.start("--tenants-file", str(path))
    assert server.http_get("/status", token="")[0] == 401
    assert server.http_get("/status", token="nobody")[0] == 401
    assert server.http_get("/status", token="acme-token")[0] == 403
    assert server.http_get("/status", token="ops-token")[0] == 200
    assert server.http_get("/clear", token="acme-token", method="POST")[0] == 403
    assert server.http_get("/healthz", token="")[0] == 200
    with w.raw_dealer(server.rpc) as socket:
        reply, _ = w.call(socket, w.hello(token="acme-token", salt="globex"))
        assert isinstance(reply, p.Error) and reply.code == "forbidden"
