"""A second client process for the integration tests.

``python -m tests.integration.peer COMMAND --address tcp://... [options]``
prints one JSON line with what it did, then exits (``store``, ``fetch``) or,
for the ``*-and-hang`` commands, keeps its connection alive with pings until
it is killed (the tests SIGKILL it to leave its reservations or locks behind).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import zmq

from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient
from tests.integration import workload as w


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _store(args: argparse.Namespace) -> None:
    client = CacheClient(w.client_config(args.address, shm=args.shm, num_ranks=args.ranks))
    try:
        assert client.chunk_size is not None, "the server refused this client"
        size = w.object_bytes(client.chunk_size)
        hashes = w.chunk_hashes(client.chunk_size, args.seed, args.chunks, args.ranks)
        buffers = w.payloads(args.seed, args.chunks, size, args.ranks)
        stored = client.store(f"store-{args.seed}", hashes, buffers)
        # shared_memory: whether the arena is mapped here, i.e. the shared-memory path ran.
        _emit(stored=stored, chunk_size=client.chunk_size, arena=client.shared_memory)
    finally:
        client.close()


def _fetch(args: argparse.Namespace) -> None:
    client = CacheClient(w.client_config(args.address, shm=args.shm, num_ranks=args.ranks))
    try:
        assert client.chunk_size is not None, "the server refused this client"
        size = w.object_bytes(client.chunk_size)
        hashes = w.chunk_hashes(client.chunk_size, args.seed, args.chunks, args.ranks)
        request_id = f"fetch-{args.seed}"
        state = client.lookup(request_id, hashes)
        hit = client.query(state, timeout_s=10.0)
        ok = False
        if hit:
            out = w.empty_buffers(hit * args.ranks, size)
            ok = client.retrieve_into(request_id, 0, hit, out)
            np.save(args.out, np.stack(out))
        client.end_session(request_id)
        _emit(hit=hit, retrieved=ok, acked=state.acked, arena=client.shared_memory)
    finally:
        client.close()


def _hang(socket: zmq.Socket[bytes]) -> None:
    """Ping every 0.1 s (so the server sees a live client) until killed."""
    while True:
        reply, _ = w.call(socket, p.Ping())
        assert isinstance(reply, p.Pong), reply
        time.sleep(0.1)


def _reserve_and_hang(args: argparse.Namespace) -> None:
    with w.raw_dealer(args.address) as socket:
        welcome, _ = w.call(socket, w.hello(shm=True, client_id="reserver"))
        assert isinstance(welcome, p.Welcome), welcome
        hashes = w.chunk_hashes(welcome.chunk_size, args.seed, args.chunks)
        reply, _ = w.call(socket, p.StoreReserve("reserve", hashes))
        assert isinstance(reply, p.Reserved), reply
        _emit(reserved=sum(o >= 0 for o in reply.offsets), sizes=reply.sizes)
        _hang(socket)


def _lookup_and_hang(args: argparse.Namespace) -> None:
    with w.raw_dealer(args.address) as socket:
        welcome, _ = w.call(socket, w.hello(shm=False, client_id="reader"))
        assert isinstance(welcome, p.Welcome), welcome
        hashes = w.chunk_hashes(welcome.chunk_size, args.seed, args.chunks)
        ack, _ = w.call(socket, p.Lookup("read", hashes))
        assert isinstance(ack, p.Ack), ack
        result, _ = w.call(socket, p.Wait("read", 10.0))
        assert isinstance(result, p.QueryResult), result
        hit = result.hit_chunks
        assert hit, result
        objects, frames = w.call(socket, p.Retrieve("read", 0, 1))  # mid-retrieve: no release
        assert isinstance(objects, p.Objects), objects
        _emit(hit=hit, retrieved_frames=len(frames))
        _hang(socket)


COMMANDS = {
    "store": _store,
    "fetch": _fetch,
    "reserve-and-hang": _reserve_and_hang,
    "lookup-and-hang": _lookup_and_hang,
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="peer")
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("--address", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--shm", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
