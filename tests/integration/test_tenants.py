"""Tenants enforced by a real ``kvtier serve --tenants-file``: a client can
only use its tenant's salts, another tenant's objects are never found, in L1
and in the fs L2 after a restart; a shared namespace is read-only for its
readers; the admin endpoints and STATUS need an admin tenant."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.commands.admin import call
from kvtier.keys import salt_label
from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient
from tests.integration import workload as w
from tests.integration.harness import (
    Server,
    ServerFactory,
    tenants_toml,
    wait_for,
    wait_written_back,
)

TENANTS = tenants_toml(ops_salt="public", acme_reads="public")


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
        assert status is not None and status.server.errors["forbidden"] == 1
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
        assert status is not None and status.server.errors["read_only"] == 1
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


def test_quotas_evict_the_tenants_own_objects_and_refuse_past_a_hard_cap(
    kvtier_server: ServerFactory, tmp_path: Path
) -> None:
    size = w.object_bytes(256)  # a page multiple: what L1 reserves per object
    path = tmp_path / "tenants.toml"
    quotas = {
        "acme": f"l1_bytes = {4 * size}\npin_bytes = {2 * size}",
        "globex": f"l1_hard_bytes = {3 * size}",
    }
    path.write_text(tenants_toml(quotas))
    server = kvtier_server.start("--tenants-file", str(path), "--cache-dir", "none")
    acme, globex, ops = (client(server.rpc, t) for t in ("acme-token", "globex-token", "ops-token"))
    try:
        old = w.chunk_hashes(256, 20, 4)
        assert acme.store("a1", old, w.payloads(20, 4, size)) == 4
        assert globex.store("g1", w.chunk_hashes(256, 21, 5), w.payloads(21, 5, size)) == 3
        pin = acme.pin(old[:3], ttl_s=600)  # two fit the pin cap
        assert pin is not None and (pin.pinned, pin.refused) == (2, 1)
        new = w.chunk_hashes(256, 22, 2)
        assert acme.store("a2", new, w.payloads(22, 2, size)) == 2  # passes its soft quota
        # its own unpinned old objects went, its pinned ones and globex's stayed
        assert hits(acme, old[:2], "p") == 2 and hits(acme, new, "n") == 2
        assert hits(acme, old[2:], "o") == 0
        assert hits(globex, w.chunk_hashes(256, 21, 3), "g") == 3
        status = ops.status()
        assert status is not None
        l1 = status.storage.l1
        assert l1.tenant_bytes == {"acme": 4 * size, "globex": 3 * size}
        # refused: globex's 2 objects past its hard cap, and acme's third pin
        assert l1.tenant_pinned_bytes["acme"] == 2 * size and l1.over_quota == 3
        assert status.server.pins_refused == 1 and l1.quota_evictions == 2
        line = f'kvtier_storage_l1_tenant_bytes{{tenant="acme"}} {4 * size}.0'
        metrics = wait_for(  # /metrics shows a snapshot at most a tick old
            lambda: server.http_get("/metrics", token="ops-token")[1].decode(),
            lambda text: line in text,
        )
        assert line in metrics
    finally:
        for c in (acme, globex, ops):
            c.close()


@pytest.mark.slow
@pytest.mark.parametrize("store", ["redis_server", "seaweed_server", "mooncake_server"])
def test_tenants_are_apart_in_every_shared_store_and_after_a_restart(
    kvtier_server: ServerFactory, tmp_path: Path, request: pytest.FixtureRequest, store: str
) -> None:
    """L1 is emptied by the restart and there is no local disk: every hit
    after it comes from the shared store, which keeps tenants apart too."""
    backend = request.getfixturevalue(store)
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    args = ["--tenants-file", str(path), "--cache-dir", "none", "--l2", json.dumps(backend.spec())]
    server = kvtier_server.start(*args)
    hashes = w.chunk_hashes(256, 70 + len(store), 3)
    acme, ops = client(server.rpc, "acme-token"), client(server.rpc, "ops-token", "public")
    try:
        assert acme.store("s", hashes, w.payloads(9, 3, w.object_bytes(256))) == 3
        wait_for(ops.status, lambda s: s is not None and sum(
            s.storage.store.stored_objects.values()
        ) >= 3)  # fmt: skip
    finally:
        acme.close()
        ops.close()
    restarted = kvtier_server.restart(server, *args)
    acme, globex = client(restarted.rpc, "acme-token"), client(restarted.rpc, "globex-token")
    try:
        assert hits(globex, hashes, "g") == 0
        assert hits(acme, hashes, "a") == 3
    finally:
        acme.close()
        globex.close()


ODD_SALT = "ops@example.com"  # the tenants file takes it; keys carry its hashed label


def finished_purges(server: Server, jobs: list[str]) -> list[dict[str, Any]]:
    def listed() -> list[dict[str, Any]]:
        purges = call(server.http, "ops-token", "GET", "/admin/purges")["purges"]
        return [j for j in purges if j["id"] in jobs]

    found = wait_for(listed, lambda js: len(js) == len(jobs) and all(
        j["state"] != "running" for j in js
    ))  # fmt: skip
    assert len(found) == len(jobs) and all(j["state"] == "done" for j in found), found
    return found


def test_a_tenant_whose_salt_is_not_a_label_is_purged_by_every_name(
    kvtier_server: ServerFactory, tmp_path: Path
) -> None:
    """A salt such as an e-mail address is keyed by its hashed label: a purge
    by tenant, by the salt as the file spells it, or by its label finds it."""
    path = tmp_path / "tenants.toml"
    path.write_text(tenants_toml(ops_salt=ODD_SALT))
    server = kvtier_server.start("--tenants-file", str(path), "--set", "purge.settle_s=0.1")
    label = salt_label(ODD_SALT)
    size = w.object_bytes(256)
    ops = client(server.rpc, "ops-token")
    try:
        tenants = call(server.http, "ops-token", "GET", "/admin/tenants")["tenants"]
        assert [t["salts"] for t in tenants if t["name"] == "ops"] == [[label]]
        bodies = [{"tenant": "ops"}, {"salt": ODD_SALT}, {"model": w.MODEL, "salt": label}]
        for seed, body in enumerate(bodies, start=80):
            hashes = w.chunk_hashes(256, seed, 3)
            assert ops.store(f"s{seed}", hashes, w.payloads(seed, 3, size)) == 3
            wait_written_back(ops.status, 3 * (seed - 79))
            started = call(server.http, "ops-token", "POST", "/admin/purge", body)
            (job,) = finished_purges(server, started["jobs"])
            assert job["namespace"].endswith(f"@{label}"), job
            assert job["tiers"]["L1"]["deleted"] == job["tiers"]["fs"]["deleted"] == 3, job
            assert hits(ops, hashes, f"after{seed}") == 0, body
    finally:
        ops.close()


@pytest.mark.slow
def test_a_purge_of_such_a_tenant_resumes_after_the_server_was_killed(
    kvtier_server: ServerFactory, tmp_path: Path
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(tenants_toml(ops_salt=ODD_SALT))
    args = ["--tenants-file", str(path), "--set", "purge.settle_s=0.1"]
    server = kvtier_server.start(*args)
    hashes = w.chunk_hashes(256, 90, 20)
    ops = client(server.rpc, "ops-token")
    try:
        assert ops.store("s", hashes, w.payloads(90, 20, w.object_bytes(256))) == 20
        wait_written_back(ops.status, 20)
    finally:
        ops.close()
    slow = [*args, "--set", "purge.batch_objects=1", "--set", "purge.pause_s=0.2"]
    server = kvtier_server.restart(server, *slow, kill=False)
    started = call(server.http, "ops-token", "POST", "/admin/purge", {"tenant": "ops"})
    wait_for(lambda: call(server.http, "ops-token", "GET", "/admin/purges")["purges"][0],
             lambda j: j["deleted"] >= 2)  # fmt: skip
    server = kvtier_server.restart(server, *args)  # SIGKILL mid-purge; the saved job resumes
    (job,) = finished_purges(server, started["jobs"])
    assert job["namespace"] == f"*@{salt_label(ODD_SALT)}"
    ops = client(server.rpc, "ops-token")
    try:
        assert hits(ops, hashes, "after") == 0
    finally:
        ops.close()
