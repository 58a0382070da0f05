"""Pipelined requests: a bytes-path store split over several messages, a
LOOKUP with its WAIT sent in one round trip, and a call nobody waits for."""

from __future__ import annotations

import os
import resource

import numpy as np
import pytest

from kvtier.protocol import client as client_module
from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient
from tests.integration import workload as w
from tests.integration.harness import Server, wait_for


def test_bytes_store_in_several_messages_round_trips(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = CacheClient(w.client_config(server.rpc, shm=False))
    reader = CacheClient(w.client_config(server.rpc, shm=False, client_id="reader"))
    try:
        assert writer.chunk_size is not None
        size = w.object_bytes(writer.chunk_size)
        monkeypatch.setattr(client_module, "PIPELINE_BYTES", 2 * size)  # 2 chunks a message
        hashes = w.chunk_hashes(writer.chunk_size, seed=21, n_chunks=7)
        data = w.payloads(21, 7, size)
        assert writer.store("s", hashes, data) == 7  # four messages in flight
        state = reader.lookup("r", hashes, wait_s=5.0)  # LOOKUP and WAIT pipelined
        assert state.done and state.hit_chunks == 7 and state.polls == 1
        out = w.empty_buffers(7, size)
        assert reader.retrieve_into("r", 0, 7, out)
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        reader.end_session("r")
        missing = reader.lookup(
            "m", w.chunk_hashes(writer.chunk_size, seed=22, n_chunks=2), wait_s=5.0
        )
        assert missing.done and missing.hit_chunks == 0  # done with a miss, not pending
    finally:
        writer.close()
        reader.close()


def test_a_call_nobody_waits_for_is_answered_past_fd_setsize(server: Server) -> None:
    """The client's I/O thread answers what callers posted without waiting,
    in a process holding more than select()'s 1024 descriptors (an engine
    with many connections): its wake-up pipe is then numbered past them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard) < 1200:
        pytest.skip(f"RLIMIT_NOFILE {soft}/{hard} cannot hold 1,200 descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        client = CacheClient(w.client_config(server.rpc))
        try:
            call = client.handoff(p.HandoffDone("nobody-offered-this", ""))
            wait_for(lambda: call.ready, lambda ready: ready)  # never led by this thread
            assert isinstance(call.reply, p.HandoffState), call.reply
        finally:
            client.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
