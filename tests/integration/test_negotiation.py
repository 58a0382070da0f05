"""Chunk-size negotiation and the protocol version in hello."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvtier.l1 import L1Config
from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient
from kvtier.protocol.negotiation import round_up
from kvtier.server.core import CacheServer
from kvtier.storage import StorageConfig, StorageManager
from tests.integration import workload as w
from tests.integration.harness import Server, ServerFactory, wait_for


@pytest.mark.parametrize(
    ("minimum", "alignment", "expected"),
    [(256, 640, 640), (1024, 544, 1088), (256, 32, 256), (256, 1, 256), (1, 7, 7)],
)
def test_round_up(minimum: int, alignment: int, expected: int) -> None:
    assert round_up(minimum, alignment) == expected


@pytest.mark.parametrize(("minimum", "alignment"), [(0, 16), (256, 0), (256, -32), (-1, 1)])
def test_round_up_refuses_non_positive(minimum: int, alignment: int) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        round_up(minimum, alignment)


MakeCore = Callable[[int], CacheServer]


@pytest.fixture
def make_core() -> Iterator[MakeCore]:
    """In-process servers over a small L1, closed at teardown."""
    made: list[tuple[CacheServer, StorageManager]] = []

    def factory(chunk_size: int) -> CacheServer:
        storage = StorageManager(StorageConfig(l1=L1Config(size_bytes=1 << 20, populate=False)))
        core = CacheServer(storage, chunk_size)
        made.append((core, storage))
        return core

    yield factory
    for core, storage in made:
        core.close()
        storage.close()


def hello_reply(core: CacheServer, peer: bytes, alignment: int, **fields: object) -> p.Reply:
    reply, frames = core.handle(peer, w.hello(chunk_alignment=alignment, **fields), [])
    assert frames == []
    return reply


@pytest.mark.parametrize(
    ("minimum", "alignment", "expected"), [(256, 640, 640), (1024, 544, 1088), (256, 32, 256)]
)
def test_first_hello_fixes_the_chunk_size(
    make_core: MakeCore, minimum: int, alignment: int, expected: int
) -> None:
    core = make_core(minimum)
    assert core.status().chunk_size == minimum
    assert core.status().chunk_size_frozen is False
    reply = hello_reply(core, b"a", alignment)
    assert isinstance(reply, p.Welcome) and reply.chunk_size == expected
    assert core.status().chunk_size == expected
    assert core.status().chunk_size_frozen is True


def test_chunk_size_is_frozen_once_a_client_registered(make_core: MakeCore) -> None:
    core = make_core(256)
    first = hello_reply(core, b"a", 640)
    assert isinstance(first, p.Welcome) and first.chunk_size == 640
    # Any alignment dividing 640 gets 640, even one that alone would give 256.
    for peer, alignment in [(b"b", 1), (b"c", 32), (b"d", 320), (b"e", 640)]:
        reply = hello_reply(core, peer, alignment)
        assert isinstance(reply, p.Welcome) and reply.chunk_size == 640, (alignment, reply)
    # One that does not divide it is refused, naming both sizes.
    for alignment in (256, 1280, 3):
        reply = hello_reply(core, b"f", alignment)
        assert isinstance(reply, p.Error), reply
        assert reply.code == "bad_request"
        assert f"block alignment {alignment}" in reply.message
        assert "chunk size 640" in reply.message
    assert core.status().clients == 5
    assert core.status().chunk_size == 640


def test_a_refused_client_is_not_registered(make_core: MakeCore) -> None:
    core = make_core(256)
    assert isinstance(hello_reply(core, b"a", 1), p.Welcome)
    assert isinstance(hello_reply(core, b"b", 3), p.Error)
    reply, _ = core.handle(b"b", p.Lookup("r", w.chunk_hashes(256, 1, 1)), [])
    assert isinstance(reply, p.Error) and reply.code == "no_hello"


def test_a_refused_hello_does_not_freeze_the_chunk_size(make_core: MakeCore) -> None:
    """Regression: a hello refused after negotiation (bad layout or model) used
    to fix the chunk size for every later engine."""
    core = make_core(256)
    bad_layout = [p.LayoutSpec(0, 2, 2, 16, "not-a-dtype")]
    refused = hello_reply(core, b"a", 640, layouts=bad_layout)
    assert isinstance(refused, p.Error) and refused.code == "bad_request"
    assert core.status().clients == 0
    reply = hello_reply(core, b"b", 1)
    assert isinstance(reply, p.Welcome)
    assert reply.chunk_size == 256  # not 640, which only the refused hello asked for


# ----------------------------------------------------------------- live


@pytest.fixture
def big_chunk_server(kvtier_server: ServerFactory) -> Server:
    return kvtier_server.start("--chunk-size", "1024")


def test_live_server_negotiates_with_engine_block_sizes(big_chunk_server: Server) -> None:
    server = big_chunk_server
    first = CacheClient(w.client_config(server.rpc, block_alignment=544, shm=False))
    fits = CacheClient(w.client_config(server.rpc, block_alignment=32, shm=False))
    misfit = CacheClient(w.client_config(server.rpc, block_alignment=256, retry_s=60.0))
    try:
        assert first.chunk_size == fits.chunk_size == 1088
        assert misfit.chunk_size is None and misfit.degraded

        # Objects are sized for the negotiated chunk; another client finds them.
        size = w.object_bytes(1088)
        assert size == 2 * 2 * 2 * 16 * 2 * 1088
        hashes = w.chunk_hashes(1088, seed=8, n_chunks=2)
        data = w.payloads(8, 2, size)
        assert first.store("s", hashes, data) == 2
        assert fits.query(fits.lookup("r", hashes), timeout_s=10.0) == 2
        out = w.empty_buffers(2, size)
        assert fits.retrieve_into("r", 0, 2, out)
        assert all(bytes(a) == bytes(b) for a, b in zip(out, data, strict=True))
        # A buffer of the configured minimum (1024 tokens) is the wrong size.
        assert first.store("t", w.chunk_hashes(1088, 9, 1), w.payloads(9, 1, 1024 * 64)) == 0
        assert first.stats.errors == {"bad_request": 1}
    finally:
        for client in (first, fits, misfit):
            client.close()
    status = wait_for(server.status, lambda s: s["chunk_size_frozen"])  # a snapshot per tick
    assert status["chunk_size"] == 1088 and status["chunk_size_frozen"] is True


def test_hello_with_another_protocol_version_is_refused(server: Server) -> None:
    for version in (0, 1, p.PROTOCOL_VERSION + 1, -1, 2**63 - 1):
        with w.raw_dealer(server.rpc) as socket:
            reply, _ = w.call(socket, w.hello(version=version))
            assert isinstance(reply, p.Error), (version, reply)
            assert reply.code == "version"
            assert f"protocol {version} is not {p.PROTOCOL_VERSION}" in reply.message
            reply, _ = w.call(socket, p.Lookup("r", w.chunk_hashes(256, 1, 1)))
            assert isinstance(reply, p.Error) and reply.code == "no_hello"
            reply, _ = w.call(socket, w.hello())
            assert isinstance(reply, p.Welcome) and reply.version == p.PROTOCOL_VERSION
