"""``TenantTable``: token digests to tenants in constant time, which salt a
HELLO gets, and a tenants file whose every mistake names its line and field;
then the server: HELLO refusals, read-only namespaces, keys that carry the
granted salt whatever the client sends."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.keys import KeySelector, Namespace, ObjectKey, TokenHasher, salt_label
from kvtier.l1 import L1Config, L1Result, WriterTag
from kvtier.protocol import messages as p
from kvtier.server.core import CacheServer
from kvtier.storage import StorageConfig, StorageManager
from kvtier.tenancy.purge import PurgeConfig, Purger
from kvtier.tenancy.tenants import ANY_SALT, Quota, Tenant, TenantTable, token_digest
from tests import storage_parts
from tests.integration.harness import wait_for

GOOD = """
[[tenant]]
name = "acme"
token_sha256 = ["{acme}"]
salts = ["acme", "acme rag"]
read = ["public"]
[tenant.quota]
l1_bytes = "1MiB"
l1_hard_bytes = 2097152
pin_bytes = "64KiB"
l2_bytes = {{ fs = "1GiB" }}

[[tenant]]
name = "ops"
token_sha256 = ["{ops}"]
salts = ["public"]
admin = true
"""


def table_text(**digests: str) -> str:
    return GOOD.format(acme=token_digest("a-token"), ops=token_digest("o-token"), **digests)


def test_a_tenants_file(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(table_text())
    table = TenantTable.from_file(path)
    acme, ops = table.tenants["acme"], table.tenants["ops"]
    assert acme.quota == Quota(1 << 20, 2 << 20, 64 << 10, {"fs": 1 << 30})
    assert acme.salts[0] == "acme" and acme.salts[1].startswith("s-")  # "acme rag" as a label
    assert ops.admin and not acme.admin
    assert table.authenticate("a-token") is acme and table.authenticate("o-token") is ops
    assert table.authenticate("wrong") is None and table.authenticate("") is None
    assert table.authenticate("ä-token") is None  # any text, never an exception
    # which salt a hello gets
    access = table.access(acme, "")
    assert access is not None and (access.salt, access.writable) == ("acme", True)
    access = table.access(acme, "public")
    assert access is not None and not access.writable  # it may read the shared namespace
    assert table.access(ops, "acme") is None  # another tenant's salt
    assert table.access(acme, "nobody") is None  # a salt it does not own
    assert table.tenant_of("acme") == "acme" and table.tenant_of("public") == "ops"


def test_the_single_token_is_one_admin_tenant_with_any_salt() -> None:
    table = TenantTable.single("s3cret")
    tenant = table.authenticate("s3cret")
    assert tenant is not None and tenant.admin and ANY_SALT in tenant.salts
    access = table.access(tenant, "whatever")
    assert access is not None and access.salt == "whatever" and access.writable
    assert table.authenticate("nope") is None
    open_table = TenantTable.single()
    assert open_table.open and open_table.authenticate("anything") is not None


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda t: t.replace('name = "ops"', 'nam = "ops"'), r"line 14: tenant 2 nam: unknown"),
        (lambda t: t.replace(f'["{token_digest("o-token")}"]', '["o-token"]'),
         r"line 15: tenant 2 token_sha256: 'o-token'\.\.\. is not a lowercase SHA-256"),
        (lambda t: t.replace('l1_bytes = "1MiB"', 'l1_bytes = "lots"'),
         r"line 8: tenant 1 quota.l1_bytes: l1_bytes: cannot read 'lots' as a size"),
        (lambda t: t.replace('pin_bytes = "64KiB"', "pin_bytes = -1"),
         r"line 10: tenant 1 quota.pin_bytes:"),
        (lambda t: t.replace("l1_hard_bytes = 2097152", "l1_hard_bytes = 1"),
         r"quota.l1_hard_bytes: 1 is below l1_bytes"),
        (lambda t: t.replace('salts = ["public"]', 'salts = ["acme"]'),
         r"salt 'acme' belongs to both 'acme' and 'ops'"),
        (lambda t: t.replace('salts = ["public"]', "salts = []"), r"tenant 2 salts: a tenant owns"),
        (lambda t: t.replace("admin = true", 'admin = "yes"'), r"line 17: tenant 2 admin:"),
        (lambda t: t.replace("admin = true", "admin = true\nretention_s = nan"),
         r"line 18: tenant 2 retention_s: must be a number of seconds > 0, got nan"),
        (lambda t: t.replace('l1_bytes = "1MiB"', f'l1_bytes = "1{"0" * 400}"'),
         r"line 8: tenant 1 quota.l1_bytes:"),
        (lambda t: "[extra]\nx = 1\n" + t, r"unknown top-level key 'extra'"),
        (lambda t: t + "\n[[tenant\n", r"tenants file .*: .*line"),
    ],
)  # fmt: skip
def test_mistakes_name_the_line_and_field(tmp_path: Path, edit: object, says: str) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(edit(table_text()))  # type: ignore[operator]
    with pytest.raises(ValueError, match=says):
        TenantTable.from_file(path)


def test_a_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tenants file .*nope\.toml"):
        TenantTable.from_file(tmp_path / "nope.toml")


# ----------------------------------------------------------- the server

LAYOUT = p.LayoutSpec(0, num_layers=1, kv_heads=1, head_dim=8, dtype="float32")
OBJECT = 2 * 8 * 4 * 16


@pytest.fixture
def server() -> Iterator[CacheServer]:
    tenants = TenantTable([
        Tenant("acme", (token_digest("a"),), ("acme",), read=("public",)),
        Tenant("ops", (token_digest("o"),), ("public",), admin=True),
    ])  # fmt: skip
    config = StorageConfig(l1=L1Config(size_bytes=1 << 20, populate=False))
    storage = StorageManager(config, owners=tenants.owners())
    yield CacheServer(storage, 16, tenants)
    storage.close()


def hello(server: CacheServer, peer: bytes, token: str, salt: str = "") -> p.Reply:
    msg = p.Hello(p.PROTOCOL_VERSION, peer.decode(), "m", [LAYOUT], 1, 16, salt=salt, token=token)
    reply, _ = server.handle(peer, msg, [])
    return reply


def store(server: CacheServer, peer: bytes, hashes: list[bytes]) -> p.Reply:
    frames = [np.zeros(OBJECT, np.uint8).tobytes() for _ in hashes]
    reply, _ = server.handle(peer, p.Store("w", hashes), frames)
    return reply


def test_hello_gets_the_tenants_salt_and_nothing_else(server: CacheServer) -> None:
    welcome = hello(server, b"A", "a")
    assert isinstance(welcome, p.Welcome) and (welcome.salt, welcome.writable) == ("acme", True)
    refused = hello(server, b"B", "a", salt="public2")
    assert isinstance(refused, p.Error) and refused.code == "forbidden"
    assert "'acme'" in refused.message and "public2" in refused.message
    refused = hello(server, b"B", "o", salt="acme")  # another tenant's namespace
    assert isinstance(refused, p.Error) and refused.code == "forbidden"
    bad = hello(server, b"B", "nobody")
    assert isinstance(bad, p.Error) and bad.code == "unauthorized"
    assert server.counters.snapshot()["errors.forbidden"] == 2


def test_a_readable_namespace_is_read_only(server: CacheServer) -> None:
    hashes = TokenHasher(Namespace("m"), 16).chunk_hashes(np.arange(32, dtype=np.uint32))
    assert isinstance(hello(server, b"O", "o"), p.Welcome)
    assert isinstance(store(server, b"O", hashes), p.Committed)  # the owner writes
    reader = hello(server, b"A", "a", salt="public")
    assert isinstance(reader, p.Welcome) and not reader.writable
    refused = store(server, b"A", hashes)
    assert isinstance(refused, p.Error) and refused.code == "read_only"
    server.handle(b"A", p.Lookup("r", hashes), [])
    found, _ = server.handle(b"A", p.Query("r"), [])
    assert isinstance(found, p.QueryResult) and found.hit_chunks == 2  # it reads
    # the same hashes in acme's own namespace are other objects
    assert isinstance(hello(server, b"A2", "a"), p.Welcome)
    server.handle(b"A2", p.Lookup("r", hashes), [])
    found, _ = server.handle(b"A2", p.Query("r"), [])
    assert isinstance(found, p.QueryResult) and found.hit_chunks == 0


def test_a_saved_purge_of_a_salt_that_is_not_a_label_resumes(
    storage: StorageManager, tmp_path: Path
) -> None:
    """A tenant's salt such as an e-mail address is keyed by its hashed label
    (``s-`` and hex, not its own label): a job saved for it loads and runs."""
    label = salt_label("alice@example.com")
    key = ObjectKey(bytes(32), "m", 0, 0, label)
    assert storage.store([key], [np.zeros(64, np.uint8)]) == [L1Result.SUCCESS]
    state = tmp_path / "purges.json"
    job = {"id": "j1", "model": None, "salt": label, "state": "running", "tiers": {}}
    state.write_text(json.dumps([job]))
    purger = Purger(storage, state, PurgeConfig(settle_s=0.0))
    try:
        done = wait_for(lambda: purger.job("j1"), lambda j: j is not None and j["state"] == "done")
    finally:
        purger.close()
    assert done is not None and done["tiers"]["L1"]["deleted"] == 1, done
    assert not storage.in_l1(key)


def test_only_the_last_finished_purges_are_kept(storage: StorageManager) -> None:
    """Purges of many namespaces (a script, a fuzzer) cost bounded memory:
    the last 100 finished jobs are kept (``purge.KEPT_FINISHED_JOBS``)."""
    purger = Purger(storage, None, PurgeConfig(settle_s=0.0, pause_s=0.0))
    try:
        started = [purger.start(KeySelector(salt=f"t{i}")).id for i in range(105)]
        wait_for(purger.jobs, lambda jobs: all(j["state"] == "done" for j in jobs))
        kept = [j["id"] for j in purger.jobs()]
    finally:
        purger.close()
    assert kept == started[5:]


def test_a_purge_is_done_only_after_the_loads_in_flight_landed(storage: StorageManager) -> None:
    """A load from L2 that began before the purge publishes into L1 after
    its passes: the last pass waits for it and purges it too."""
    key = ObjectKey(bytes(32), "m", 0, 0, "acme")
    l1 = storage_parts.l1(storage)  # a load's own steps, as the prefetch controller takes them
    (placement,) = l1.reserve_write([key], [64], WriterTag("load"))
    assert placement.result is L1Result.SUCCESS
    purger = Purger(storage, None, PurgeConfig(settle_s=0.0))
    try:
        job = purger.start(KeySelector(salt="acme"))
        wait_for(lambda: purger.job(job.id), lambda j: j is not None and bool(j["tiers"]))
        assert l1.finish_write([key], WriterTag("load")) == [L1Result.SUCCESS]  # it lands
        done = wait_for(
            lambda: purger.job(job.id), lambda j: j is not None and j["state"] != "running"
        )
    finally:
        purger.close()
    assert done is not None and done["state"] == "done", done
    assert not l1.contains(key)
