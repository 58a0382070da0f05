"""Tensor parallelism through a real server: each rank's client stores and
loads its own rank's objects (``rank=r``); a client speaking for every rank
(``rank=-1``, as vLLM's scheduler) hits only chunks that all ranks have."""

from __future__ import annotations

import pytest

from kvtier.protocol.client import CacheClient
from tests.integration import workload as w
from tests.integration.harness import Server

RANKS = 2
CHUNKS = 4


@pytest.fixture
def clients(server: Server) -> dict[int, CacheClient]:
    made = {
        rank: CacheClient(w.client_config(server.rpc, num_ranks=RANKS, rank=rank))
        for rank in (-1, 0, 1)
    }
    yield made
    for client in made.values():
        client.close()


def test_a_chunk_hits_only_when_every_rank_stored_it(clients: dict[int, CacheClient]) -> None:
    chunk_size = clients[0].chunk_size
    assert chunk_size is not None
    size = w.object_bytes(chunk_size)
    hashes = w.chunk_hashes(chunk_size, 7, CHUNKS, num_ranks=RANKS)
    rank0 = [w.payload(7, c, 0, size) for c in range(CHUNKS)]
    rank1 = [w.payload(7, c, 1, size) for c in range(CHUNKS)]
    assert clients[0].store("s0", hashes, rank0) == CHUNKS  # one object per chunk: its rank's
    assert clients[1].store("s1", hashes[:2], rank1[:2]) == 2  # rank 1 has only 2 chunks

    scheduler = clients[-1]
    assert scheduler.query(scheduler.lookup("all", hashes), timeout_s=10.0) == 2  # common prefix
    scheduler.end_session("all")
    for rank, expected, mine in ((0, CHUNKS, rank0), (1, 2, rank1)):
        client = clients[rank]
        assert client.query(client.lookup(f"l{rank}", hashes), timeout_s=10.0) == expected
        out = w.empty_buffers(expected, size)
        assert client.retrieve_into(f"l{rank}", 0, expected, out)  # its own rank's bytes
        assert all((o == m).all() for o, m in zip(out, mine[:expected], strict=True))
        client.end_session(f"l{rank}")


def test_a_rank_outside_the_ranks_is_refused(server: Server) -> None:
    client = CacheClient(w.client_config(server.rpc, num_ranks=RANKS, rank=RANKS))
    try:
        assert client.degraded  # the server refused its hello
    finally:
        client.close()
