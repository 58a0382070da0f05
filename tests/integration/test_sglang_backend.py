"""kvtier as SGLang's HiCache storage backend, driven by SGLang's own
``HiCacheController`` on CPU (tests/integration/sglang_host.py) against real
``kvtier serve`` processes. Skipped without SGLang (.ci/sglang installs it)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import Server, ServerFactory, wait_for
from tests.integration.sglang_host import HostEngine, backend_config, import_sglang

import_sglang()

CONTROLLER_LOG = "sglang.srt.managers.cache_controller"


def config(server: Server, **extra: Any) -> dict[str, Any]:
    return backend_config(server.rpc, **extra)


@pytest.fixture
def engines() -> Iterator[list[HostEngine]]:
    made: list[HostEngine] = []
    yield made
    for engine in made:
        engine.close()


def engine(
    made: list[HostEngine],
    server: Server,
    page: int = 16,
    layout: str = "layer_first",
    **extra: Any,
) -> HostEngine:
    made.append(HostEngine(page, layout, "dynamic", config(server, **extra)))
    return made[-1]


def prompt(pages: int, page: int, first: int = 1000) -> list[int]:
    return list(range(first, first + pages * page))


@pytest.fixture
def sglang_errors(caplog: pytest.LogCaptureFixture) -> Iterator[list[logging.LogRecord]]:
    """Errors SGLang's controller logged: an exception that reached its threads
    is logged there (``logger.exception``) instead of raised."""
    caplog.set_level(logging.WARNING, logger=CONTROLLER_LOG)
    records: list[logging.LogRecord] = []
    yield records
    records.extend(r for r in caplog.records if r.name == CONTROLLER_LOG and r.exc_info)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page", [16, 64])
def test_round_trip_is_byte_exact(
    kvtier_server: ServerFactory, engines: list[HostEngine], layout: str, page: int
) -> None:
    server = kvtier_server.start("--chunk-size", str(page))
    writer = engine(engines, server, page, layout)
    tokens = prompt(6, page)
    indices = writer.fill(len(tokens), seed=page)
    assert writer.write_back(tokens, indices) == len(tokens)

    fetched = writer.fetch("again", [*tokens, 7, 8, 9])  # a partial page is never a hit
    assert (fetched.hit_tokens, fetched.loaded_tokens) == (len(tokens), len(tokens))
    assert writer.pages(fetched.indices) == writer.pages(indices)
    assert writer.storage.status()["failures"] == {}


def test_batch_exists_counts_leading_pages(
    kvtier_server: ServerFactory, engines: list[HostEngine]
) -> None:
    server = kvtier_server.start("--chunk-size", "16")
    a = engine(engines, server)
    tokens = prompt(5, 16)
    keys = a.hashes(tokens)
    indices = a.fill(len(tokens), seed=1)
    storage = a.storage
    # Pages 0, 1 and 3 stored, 2 and 4 not.
    assert storage.batch_set_v1(keys[:2], indices[:32]) == [True, True]
    assert storage.batch_set_v1([keys[3]], indices[48:64]) == [True]
    assert storage.batch_exists(keys) == 2
    assert storage.batch_exists(keys[3:]) == 1
    assert storage.batch_exists(keys[2:]) == 0
    assert storage.batch_exists([]) == 0
    assert [storage.exists(k) for k in keys] == [True, True, False, True, False]
    # The page transfer copies the leading hits only.
    target = a.host.alloc(len(tokens))
    assert storage.batch_get_v1(keys, target) == [True, True, False, False, False]
    assert a.pages(target[:32]) == a.pages(indices[:32])


def test_tenants_are_apart(kvtier_server: ServerFactory, engines: list[HostEngine]) -> None:
    server = kvtier_server.start("--chunk-size", "16")
    tokens = prompt(4, 16)
    a = engine(engines, server, salt="tenant-a")
    indices = a.fill(len(tokens), seed=2)
    assert a.write_back(tokens, indices) == len(tokens)

    other = engine(engines, server, salt="tenant-b")
    assert other.fetch("b", tokens).hit_tokens == 0
    unsalted = engine(engines, server)
    assert unsalted.fetch("none", tokens).hit_tokens == 0
    same = engine(engines, server, salt="tenant-a")
    fetched = same.fetch("a", tokens)
    assert fetched.loaded_tokens == len(tokens)
    assert same.pages(fetched.indices) == a.pages(indices)


def test_two_engines_share_pages_through_one_server(
    kvtier_server: ServerFactory, engines: list[HostEngine]
) -> None:
    server = kvtier_server.start("--chunk-size", "16")
    first, second = engine(engines, server), engine(engines, server)
    tokens = prompt(8, 16)
    indices = first.fill(len(tokens), seed=3)
    assert first.write_back(tokens, indices) == len(tokens)

    fetched = second.fetch("second", tokens)
    assert fetched.loaded_tokens == len(tokens)
    assert second.pages(fetched.indices) == first.pages(indices)
    # A different layout or model is another namespace: never read across.
    assert engine(engines, server, layout="page_first").fetch("x", tokens).hit_tokens == 0
    assert engine(engines, server, model="other-model").fetch("y", tokens).hit_tokens == 0


def test_a_server_killed_mid_transfer_gives_misses_then_hits_after_restart(
    kvtier_server: ServerFactory, engines: list[HostEngine], sglang_errors: list[Any]
) -> None:
    server = kvtier_server.start("--chunk-size", "16")
    a = engine(engines, server, request_timeout_s=1.0)
    tokens = prompt(200, 16)  # many batches: the kill lands while pages move
    indices = a.fill(len(tokens), seed=4)
    assert a.write_back(tokens, indices) == len(tokens)

    results: list[Any] = []
    reader = threading.Thread(target=lambda: results.append(a.fetch("during", tokens)))
    reader.start()
    kvtier_server.kill(server)
    reader.join()
    assert results and results[0].loaded_tokens <= results[0].hit_tokens
    # Dead: misses and refused writes, each answered in the client's timeout.
    assert a.fetch("dead", tokens).hit_tokens == 0
    assert a.write_back(tokens[:32], indices[:32]) == 0
    keys = a.hashes(tokens[:32])
    assert a.storage.batch_get_v1(keys, indices[:32]) == [False, False]
    assert a.storage.batch_exists(keys) == 0

    restarted = kvtier_server.start("--chunk-size", "16", port=server.port)
    deadline = time.monotonic() + 60
    while not a.storage.status()["connected"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert a.storage.status()["connected"]
    # A fresh server (its own empty L2 directory): misses, then what is stored hits.
    assert a.fetch("fresh", tokens[:64]).hit_tokens == 0
    assert a.write_back(tokens[:64], indices[:64]) == 64
    fetched = a.fetch("back", tokens[:64])
    assert fetched.loaded_tokens == 64
    assert a.pages(fetched.indices) == a.pages(indices[:64])
    assert restarted.rpc == server.rpc
    assert sglang_errors == []


def test_a_refusing_server_gives_misses_and_no_exceptions(
    kvtier_server: ServerFactory,
    engines: list[HostEngine],
    sglang_errors: list[Any],
    tmp_path: Path,
) -> None:
    """A server that refuses this engine (a token it does not know): every
    call misses, nothing raises into SGLang's threads; with the right token
    (from a file) the same pages go through."""
    server = kvtier_server.start("--chunk-size", "16", token="right-token")
    tokens = prompt(4, 16)
    refused = engine(engines, server, auth_token="wrong-token")
    indices = refused.fill(len(tokens), seed=5)
    assert refused.write_back(tokens, indices) == 0
    assert refused.fetch("refused", tokens).hit_tokens == 0
    keys = refused.hashes(tokens)
    assert refused.storage.batch_exists(keys) == 0
    assert refused.storage.batch_get_v1(keys, indices) == [False] * 4
    assert not refused.storage.status()["connected"]

    token_file = tmp_path / "token"
    token_file.write_text("right-token\n")
    token_file.chmod(0o600)
    allowed = engine(engines, server, auth_token_file=str(token_file))
    assert allowed.write_back(tokens, indices) == len(tokens)
    assert allowed.fetch("allowed", tokens).loaded_tokens == len(tokens)
    assert sglang_errors == []


def storage_config(extra: dict[str, Any], model: str = "m", **fields: Any) -> Any:
    """SGLang's ``HiCacheStorageConfig`` for one TP rank, one stage, one CP rank
    (``fields`` change any of them), as its controller builds it."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    values: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": False,
        "model_name": model,
        "extra_config": extra,
        **fields,
    }
    return HiCacheStorageConfig(**values)


def test_bad_config_fails_at_construction_naming_the_key() -> None:
    from kvtier.engine.sglang import KvtierStorage

    with pytest.raises(ValueError, match="'address'"):
        KvtierStorage(storage_config({}), None)
    with pytest.raises(ValueError, match="'salt'"):
        KvtierStorage(storage_config({"address": "tcp://127.0.0.1:1", "salt": 3}), None)
    with pytest.raises(ValueError, match="'request_timeout_s'"):
        KvtierStorage(
            storage_config({"address": "tcp://127.0.0.1:1", "request_timeout_s": 0}), None
        )


def test_a_page_of_the_wrong_size_is_refused(
    kvtier_server: ServerFactory, engines: list[HostEngine]
) -> None:
    import torch

    server = kvtier_server.start("--chunk-size", "16")
    a = engine(engines, server)
    page = a.host.get_dummy_flat_data_page()
    assert a.storage.set("k", page)
    with pytest.raises(ValueError, match="page of key 'short'"):
        a.storage.set("short", page[:-1])
    out = torch.zeros_like(page)
    assert a.storage.get("k", out) is out
    assert a.storage.get("missing") is None


def test_another_chunk_size_misses_with_a_named_error(
    kvtier_server: ServerFactory, engines: list[HostEngine], caplog: pytest.LogCaptureFixture
) -> None:
    server = kvtier_server.start("--chunk-size", "64")
    a = engine(engines, server, page=32)  # the server's chunk stays 64: not one page
    tokens = prompt(4, 32)
    indices = a.fill(len(tokens), seed=5)
    assert a.write_back(tokens, indices) == 0
    assert a.fetch("r", tokens).hit_tokens == 0
    assert "--chunk-size 32" in caplog.text


def stage(made: list[HostEngine], server: Server, pp_rank: int, start_layer: int) -> HostEngine:
    """Pipeline stage ``pp_rank`` of 2 of the same model and tenant, holding
    the 2 layers from ``start_layer``."""
    made.append(
        HostEngine(
            16,
            "layer_first",
            "dynamic",
            config(server),
            pp_rank=pp_rank,
            pp_size=2,
            start_layer=start_layer,
        )
    )
    return made[-1]


def test_pipeline_stages_never_read_each_others_pages(
    kvtier_server: ServerFactory, engines: list[HostEngine]
) -> None:
    """Two stages of equal layer count, same model and tenant: SGLang's page
    keys are the same for both (the tokens'), and the stages' layouts were
    the same, so stage 1 hit stage 0's pages and loaded its layers."""
    server = kvtier_server.start("--chunk-size", "16")
    first, second = stage(engines, server, 0, 0), stage(engines, server, 1, 2)
    tokens = prompt(4, 16)
    first_pages = first.fill(len(tokens), seed=20)
    assert first.write_back(tokens, first_pages) == len(tokens)

    assert second.fetch("before", tokens).hit_tokens == 0
    second_pages = second.fill(len(tokens), seed=21)
    assert second.write_back(tokens, second_pages) == len(tokens)
    for engine_, stored in ((first, first_pages), (second, second_pages)):
        fetched = engine_.fetch(f"own-{engine_.pp_rank}", tokens)
        assert fetched.loaded_tokens == len(tokens)
        assert engine_.pages(fetched.indices) == engine_.pages(stored)
    # The stage is in the layout each registers, so the server's digests differ.
    assert first.storage.format.layout.format == "sglang-layer_first-pp0of2-layers0-2"
    assert second.storage.format.layout.format == "sglang-layer_first-pp1of2-layers2-4"
    status = wait_for(server.status, lambda s: len(s["hash_namespaces"]) == 2)
    assert len({entry["layout"] for entry in status["hash_namespaces"]}) == 2
    # A one-stage engine of the model is a third layout: it reads neither stage.
    assert engine(engines, server).fetch("whole", tokens).hit_tokens == 0


def test_context_parallel_ranks_never_read_each_others_pages(
    kvtier_server: ServerFactory, engines: list[HostEngine]
) -> None:
    """Each attention context-parallel rank holds its own slice of every page:
    two ranks of one TP rank keep their pages apart (SGLang's controller takes
    the CP rank from its CP group, which one process cannot have two ranks of,
    so the backends are made from SGLang's storage config directly)."""
    from kvtier.engine.sglang import KvtierStorage

    server = kvtier_server.start("--chunk-size", "16")
    host = engine(engines, server)
    tokens = prompt(4, 16)
    keys = host.hashes(tokens)
    ranks = []
    for cp_rank in (0, 1):
        cfg = storage_config(config(server), attn_cp_rank=cp_rank, attn_cp_size=2)
        backend = KvtierStorage(cfg, None)
        backend.register_mem_pool_host(host.host)
        ranks.append((backend, host.fill(len(tokens), seed=30 + cp_rank)))
    try:
        (rank0, pages0), (rank1, pages1) = ranks
        assert rank0.batch_set_v1(keys, pages0) == [True] * 4
        assert rank1.batch_exists(keys) == 0
        assert rank1.batch_set_v1(keys, pages1) == [True] * 4
        for backend, stored in ranks:
            target = host.host.alloc(len(tokens))
            assert backend.batch_get_v1(keys, target) == [True] * 4
            assert host.pages(target) == host.pages(stored)
        assert rank1.format.layout.format == "sglang-layer_first-cp1of2"
    finally:
        for backend, _ in ranks:
            backend.close()


def test_decode_context_parallelism_is_refused_by_name() -> None:
    from kvtier.engine.sglang import KvtierStorage

    cfg = storage_config(
        {"address": "tcp://127.0.0.1:1"},
        tp_rank=1,
        tp_size=2,
        is_mla_model=True,
        dcp_size=2,
        dcp_rank=1,
        logical_page_size=64,
    )
    with pytest.raises(ValueError, match="--dcp-size 2"):
        KvtierStorage(cfg, None)


def test_a_chunk_size_fixed_by_another_page_size_names_what_helps(
    kvtier_server: ServerFactory, engines: list[HostEngine], caplog: pytest.LogCaptureFixture
) -> None:
    """``--chunk-size 16`` is a minimum: a page-64 engine registering first
    fixes it at 64. A page-16 engine then misses, and restarting the server
    with ``--chunk-size 16`` would not help (the page-64 engine fixes 64
    again): the log says what does."""
    server = kvtier_server.start("--chunk-size", "16")
    big = engine(engines, server, page=64)
    big_tokens = prompt(2, 64)
    assert big.write_back(big_tokens, big.fill(len(big_tokens), seed=40)) == len(big_tokens)

    small = engine(engines, server, page=16)
    tokens = prompt(4, 16)
    assert small.write_back(tokens, small.fill(len(tokens), seed=41)) == 0
    assert small.fetch("small", tokens).hit_tokens == 0
    assert big.fetch("big", big_tokens).loaded_tokens == len(big_tokens)
    text = caplog.text
    assert "restart kvtier serve with --chunk-size 16" not in text
    assert "chunk size is 64 tokens and SGLang's page size is 16" in text
    assert "--chunk-size is a minimum: the first engine that registers" in text
    assert "SGLang engines of another page size need a server of their own" in text
