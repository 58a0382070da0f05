"""The admin API and ``kvtier admin`` against a real ``kvtier serve`` with
tenants, an fs L2 and a real Redis: usage per tenant and namespace, pins,
purges across every tier (with a reader holding objects meanwhile, and
resumed after the server was killed mid-purge), drain, quota changes, the
savings ledger, and clear errors for bad requests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.commands.admin import AdminError, call
from kvtier.keys import model_label
from kvtier.protocol.client import CacheClient
from kvtier.tenancy.tenants import token_digest
from tests.integration import workload as w
from tests.integration.harness import Server, ServerFactory, paused, tenants_toml, wait_for
from tests.servers import RedisProcess

TENANTS = tenants_toml({"acme": 'pin_bytes = "1MiB"'})
SIZE = w.object_bytes(256)


@pytest.fixture
def admin_server(
    kvtier_server: ServerFactory, redis_server: RedisProcess, tmp_path: Path
) -> tuple[Server, list[str]]:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    redis.Redis(port=redis_server.port).flushall()
    args = ["--tenants-file", str(path), "--l2", json.dumps(redis_server.spec())]
    args += ["--set", "purge.settle_s=0.2"]
    return kvtier_server.start(*args), args


def api(server: Server, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    return call(server.http, "ops-token", method, path, body)


def client(server: Server, token: str) -> CacheClient:
    return CacheClient(w.client_config(server.rpc, auth_token=token, request_timeout_s=5.0))


def hits(c: CacheClient, hashes: list[bytes], request: str, release: bool = True) -> int:
    found = c.query(c.lookup(request, hashes), timeout_s=10.0) or 0
    if found and release:
        c.release(request, 0, found)
    return found


def redis_keys(server: RedisProcess, salt: str) -> int:
    return len(list(redis.Redis(port=server.port).scan_iter(match=f"*@{salt}@*")))


def test_usage_pins_purge_and_drain(
    admin_server: tuple[Server, list[str]], redis_server: RedisProcess
) -> None:
    server, _ = admin_server
    acme, globex = client(server, "acme-token"), client(server, "globex-token")
    try:
        mine, theirs = w.chunk_hashes(256, 30, 6), w.chunk_hashes(256, 31, 2)
        assert acme.store("s", mine, w.payloads(30, 6, SIZE)) == 6
        assert globex.store("s", theirs, w.payloads(31, 2, SIZE)) == 2
        written(server, "fs", 8)
        written(server, "redis", 8)

        tenants = {t["name"]: t for t in api(server, "GET", "/admin/tenants")["tenants"]}
        assert tenants["acme"]["usage"]["L1"] == 6 * SIZE
        assert tenants["acme"]["usage"]["redis"] > 6 * SIZE  # headers too; written here
        assert tenants["ops"]["admin"] and tenants["acme"]["quota"]["pin_bytes"] == 1 << 20
        spaces = {n["namespace"]: n for n in api(server, "GET", "/admin/namespaces")["namespaces"]}
        acme_space = spaces[f"{model_label(w.MODEL)}@acme"]
        assert acme_space["tenant"] == "acme"
        assert acme_space["tiers"]["L1"]["objects"] == acme_space["tiers"]["fs"]["objects"] == 6

        pin = {"model": w.MODEL, "salt": "acme", "hashes": [h.hex() for h in mine[:2]]}
        pinned = api(server, "POST", "/admin/pin", pin)
        assert pinned["results"] == {"success": 2}

        # a reader holds two of acme's chunks while the purge runs
        assert hits(acme, mine[:2], "held", release=False) == 2
        with paused([redis_server.proc.pid]):  # the purge cannot end before Redis answers
            started = api(server, "POST", "/admin/purge", {"tenant": "acme"})
            assert len(started["jobs"]) == 1
            refused = acme.store("late", w.chunk_hashes(256, 32, 1), w.payloads(32, 1, SIZE))
            assert refused == 0  # stores into a namespace being purged are refused
        job = wait_for(
            lambda: api(server, "GET", "/admin/purges")["purges"][0],
            lambda j: j["state"] != "running",
        )
        assert job["state"] == "done", job
        assert job["tiers"]["L1"]["deleted"] == 6 and job["tiers"]["L1"]["held"] == 2
        assert job["tiers"]["fs"]["deleted"] == job["tiers"]["redis"]["deleted"] == 6
        assert hits(acme, mine, "after") == 0 and redis_keys(redis_server, "acme") == 0
        acme.release("held", 0, 2)  # the read is over: their memory goes too
        l1_freed(server, used=2 * SIZE)  # globex's
        assert hits(globex, theirs, "theirs") == 2 and redis_keys(redis_server, "globex") == 2

        assert api(server, "POST", "/admin/drain", {"on": True}) == {"draining": True}
        assert globex.store("d", w.chunk_hashes(256, 33, 1), w.payloads(33, 1, SIZE)) == 0
        assert hits(globex, theirs, "during") == 2  # lookups are served while draining
        api(server, "POST", "/admin/drain", {"on": False})
        assert globex.store("d2", w.chunk_hashes(256, 33, 1), w.payloads(33, 1, SIZE)) == 1
    finally:
        acme.close()
        globex.close()


def l1_freed(server: Server, used: int = 0) -> None:
    """Wait until L1 uses ``used`` bytes, with no object doomed or locked."""

    def l1() -> dict[str, Any]:
        return dict(server.status_json("ops-token")["storage"]["l1"])

    seen = wait_for(l1, lambda s: (s["used_bytes"], s["doomed_objects"]) == (used, 0))
    assert (seen["used_bytes"], seen["doomed_objects"], seen["locked_objects"]) == (used, 0, 0)


def test_a_purge_under_a_reader_is_done_and_never_serves_its_objects_again(
    kvtier_server: ServerFactory, tmp_path: Path
) -> None:
    """The finding: a lookup answered and not released, the tenant purged;
    the job said done with 3 objects "held", and when the reader let go they
    stayed, and the next lookup hit all 3."""
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    args = ["--tenants-file", str(path), "--cache-dir", "none", "--set", "purge.settle_s=0.1"]
    server = kvtier_server.start(*args, "--set", "purge.hold_wait_s=1")
    acme = client(server, "acme-token")
    try:
        hashes = w.chunk_hashes(256, 60, 3)
        assert acme.store("s", hashes, w.payloads(60, 3, SIZE)) == 3
        assert hits(acme, hashes, "held", release=False) == 3
        started = api(server, "POST", "/admin/purge", {"tenant": "acme"})
        job = wait_for(
            lambda: api(server, "GET", "/admin/purges")["purges"][0],
            lambda j: j["state"] != "running",
        )
        assert job["id"] == started["jobs"][0] and job["state"] == "done", job
        assert job["tiers"]["L1"] == {**job["tiers"]["L1"], "deleted": 3, "held": 3}
        assert hits(acme, hashes, "while-held") == 0  # unreachable at once
        acme.release("held", 0, 3)
        assert hits(acme, hashes, "after") == 0
        l1_freed(server)  # freed when the reader let go
    finally:
        acme.close()


def written(server: Server, adapter: str, objects: int) -> None:
    """Wait until the write-back has put ``objects`` objects into ``adapter``."""

    def count() -> int:
        store = server.status_json("ops-token")["storage"]["store"]
        return int(store["stored_objects"].get(adapter, 0))

    assert wait_for(count, lambda n: n >= objects) == objects


@pytest.mark.slow
def test_a_purge_resumes_after_the_server_was_killed(
    kvtier_server: ServerFactory, admin_server: tuple[Server, list[str]]
) -> None:
    server, args = admin_server
    acme = client(server, "acme-token")
    hashes = w.chunk_hashes(256, 40, 40)
    assert acme.store("s", hashes, w.payloads(40, 40, SIZE)) == 40
    written(server, "fs", 40)
    written(server, "redis", 40)
    acme.close()
    slow = [*args, "--set", "purge.batch_objects=1", "--set", "purge.pause_s=0.2"]
    server = kvtier_server.restart(server, *slow, kill=False)
    api(server, "POST", "/admin/purge", {"model": w.MODEL, "salt": "acme"})
    wait_for(lambda: api(server, "GET", "/admin/purges")["purges"][0]["deleted"],
             lambda n: n >= 2)  # fmt: skip
    server = kvtier_server.restart(server, *args)  # SIGKILL mid-purge, normal pace again
    job = wait_for(
        lambda: api(server, "GET", "/admin/purges")["purges"][0],
        lambda j: j["state"] != "running",
    )
    assert job["state"] == "done", job
    acme = client(server, "acme-token")
    try:
        assert hits(acme, hashes, "after") == 0
    finally:
        acme.close()


def test_quota_changes_and_bad_requests(admin_server: tuple[Server, list[str]]) -> None:
    server, _ = admin_server
    acme = client(server, "acme-token")
    try:
        assert acme.store("s", w.chunk_hashes(256, 50, 4), w.payloads(50, 4, SIZE)) == 4
        written(server, "fs", 4)  # written back: nothing holds them in L1 any more
        written(server, "redis", 4)
        changed = api(server, "POST", "/admin/quota", {"tenant": "acme", "l1_bytes": SIZE})
        assert changed["evicted_bytes"] == 3 * SIZE  # down to one object
        cases = [
            ("POST", "/admin/purge", {}, 400, "give 'model'"),
            ("POST", "/admin/purge", {"tenant": "nobody"}, 404, "no tenant 'nobody'"),
            ("POST", "/admin/quota", {"tenant": "acme", "l1_bytes": "lots"}, 400, "l1_bytes"),
            ("POST", "/admin/quota", {"tenant": "acme", "l1_bytes": 10, "l1_hard_bytes": 5},
             400, "below"),
            ("POST", "/admin/pin", {"model": "x", "salt": "acme", "hashes": ["00" * 32]},
             404, "no engine registered"),
            ("POST", "/admin/pin", {"model": w.MODEL, "hashes": "ab"}, 400, "hashes"),
            ("POST", "/admin/drain", {"on": "yes"}, 400, "true or false"),
            ("GET", "/admin/nothing", None, 404, "the admin API has"),
        ]  # fmt: skip
        for method, path, body, code, says in cases:
            with pytest.raises(AdminError, match=f"{code} .*{says}"):
                api(server, method, path, body)
        with pytest.raises(AdminError, match="403"):
            call(server.http, "acme-token", "GET", "/admin/tenants")
    finally:
        acme.close()


def test_the_admin_command_line(admin_server: tuple[Server, list[str]], tmp_path: Path) -> None:
    server, _ = admin_server
    token = tmp_path / "ops.token"
    token.write_text("ops-token\n")
    token.chmod(0o600)  # a secret file group or others may read is refused
    base = [sys.executable, "-m", "kvtier", "admin", "--url", server.http]
    done = subprocess.run(
        [*base, "--token-file", str(token), "--json", "-", "tenants"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert {t["name"] for t in json.loads(done.stdout)["tenants"]} == {"acme", "globex", "ops"}
    assert "acme: salts acme" in done.stderr
    refused = subprocess.run([*base, "status"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "401" in refused.stderr
    digest = subprocess.run(
        [*base, "token-digest"], input="ops-token\n", capture_output=True, text=True, timeout=60
    )
    assert digest.stdout.strip() == token_digest("ops-token")


def test_purge_wait_fails_unless_every_job_is_done(
    admin_server: tuple[Server, list[str]], redis_server: RedisProcess, tmp_path: Path
) -> None:
    """A script's ``kvtier admin purge --wait && ...`` must not go on while the
    purge still runs (it exited 0 when --timeout-s ran out)."""
    server, _ = admin_server
    token = tmp_path / "ops.token"
    token.write_text("ops-token\n")
    token.chmod(0o600)  # a secret file group or others may read is refused
    purge = [sys.executable, "-m", "kvtier", "admin", "--url", server.http]
    purge += ["--token-file", str(token), "purge", "--tenant", "acme", "--wait"]
    with paused([redis_server.proc.pid]):  # the purge cannot end before Redis answers
        late = subprocess.run([*purge, "--timeout-s", "0"], capture_output=True, text=True)
    assert late.returncode == 1 and "purges not done" in late.stderr, late
    done = subprocess.run(purge, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and ": done," in done.stdout, done


def test_the_savings_ledger_counts_what_engines_were_served(
    admin_server: tuple[Server, list[str]],
) -> None:
    from kvtier.engine.hf import KVTierModel
    from tests.hf_helpers import prompt, tiny_model

    server, _ = admin_server
    engine = KVTierModel(tiny_model("llama"), server=server.rpc, auth_token="acme-token")
    try:
        ids = prompt(3, 600)
        engine.generate(ids, 2)  # computed, stored
        warm = engine.generate(ids, 2).prefill  # 512 tokens served from L1, and loaded
        assert warm.hit_tokens == 512 and warm.computed_tokens == 88
    finally:
        engine.close()

    def acme_rows() -> list[dict[str, Any]]:
        return [
            r for r in api(server, "GET", "/admin/ledger")["namespaces"] if r["tenant"] == "acme"
        ]

    rows = wait_for(acme_rows, lambda r: bool(r) and r[0]["loaded_tokens"] == 512)
    row = rows[0]
    assert row["namespace"].endswith("@acme") and row["served_tokens"] == {"L1": 512}
    assert row["rate_samples"] == 2 and row["load_s"] > 0  # the cold and the warm forward
    # the loaded tokens, at the per-token part of the fit over both forwards (600 and 88
    # tokens computed): what one more computed token cost, the forward's own time aside
    assert row["saved_s"] == pytest.approx(512 * row["prefill_s_per_token"])
    assert row["net_s"] == pytest.approx(row["saved_s"] - row["load_s"])
    totals = api(server, "GET", "/admin/ledger")["tenants"]["acme"]
    assert totals["served_tokens"] == 512 and totals["loaded_tokens"] == 512


def test_the_admin_api_says_what_became_of_a_hand_off(
    admin_server: tuple[Server, list[str]],
) -> None:
    from kvtier.protocol import messages as p

    server, _ = admin_server
    producer = client(server, "acme-token")
    try:
        hashes = w.chunk_hashes(256, 40, 2)
        assert producer.store("w", hashes, w.payloads(40, 2, SIZE)) == 2

        def outcome(message: p.Message) -> str:
            reply = producer.handoff(message).wait()  # type: ignore[arg-type]
            assert isinstance(reply, p.HandoffState), reply
            return reply.outcome

        assert outcome(p.HandoffOffer("h-1", hashes, 30.0)) == "offered"
        assert api(server, "POST", "/admin/handoff", {"id": "h-1"}) == {
            "id": "h-1",
            "state": "held",
            "taken": False,
            "refused": "",
        }
        assert outcome(p.HandoffTake("h-1", hashes)) == "granted"
        assert outcome(p.HandoffDone("h-1")) == "released"
        fate = api(server, "POST", "/admin/handoff", {"id": "h-1"})
        assert fate == {"id": "h-1", "state": "ended", "outcome": "consumed"}
        assert api(server, "POST", "/admin/handoff", {"id": "never"})["state"] == "unknown"
        with pytest.raises(AdminError, match="'id'"):
            api(server, "POST", "/admin/handoff", {})
    finally:
        producer.close()
