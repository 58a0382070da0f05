"""Hostile traffic for a live ``kvtier serve``: the fuzz suite and its benchmark.

``HostileMessages(seed)`` draws messages the way a hostile client, a buggy
engine and an unlucky operator would send them: random frames, truncated
messages, unknown fields nested thousands of levels deep, known operations
with junk in their fields (wrong types, integers at and past 64 bits, NaN and
infinities, long strings and lists), HELLOs with absurd layouts, ranks and
alignments, and session operations with out-of-range ids, ranges,
reservations and data frames. Draws are a pure function of the seed.

``blast(address, messages, ...)`` sends them over a few DEALER sockets, half
of them registered, ``window`` in flight per socket, and checks that every
message got exactly one reply (a PING after each socket's share is answered
by the very next reply), then ends every session and aborts every store
reservation the traffic left open. It returns what it saw.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kvtier.protocol import messages as p
from tests.integration import workload as w

ENCODE = msgspec.msgpack.encode
REQUEST_IDS = ["r0", "r1", "r2", "s0", "s1", "x" * 256]
EDGE_INTS = [0, 1, -1, 2, 255, 256, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, -(2**63), 2**64 - 1]
EDGE_FLOATS = [0.0, -0.0, 1e-300, 1e300, math.nan, math.inf, -math.inf, 0.05, 2.0]


@dataclass(frozen=True, slots=True)
class Message:
    kind: str
    frames: list[bytes]
    registered: bool  # send it on a socket that said hello


class HostileMessages:
    """Draws hostile messages; see the module docstring."""

    def __init__(self, seed: int, chunk_size: int = 256) -> None:
        self.rng = random.Random(seed)
        self.size = w.object_bytes(chunk_size)
        self.hashes = w.chunk_hashes(chunk_size, seed=seed, n_chunks=4)
        self.valid = [
            p.encode(m)
            for m in (
                w.hello(),
                p.Lookup("r0", self.hashes),
                p.Wait("r0", 0.05),
                p.Retrieve("r0", 0, 1),
                p.Store("s0", self.hashes[:1]),
                p.StoreCommit(7),
                p.Ping(),
            )
        ]
        self.kinds: list[tuple[str, Callable[[], list[bytes]], bool]] = [
            ("random_bytes", self.random_bytes, False),
            ("truncated", self.truncated, False),
            ("deep_nesting", self.deep_nesting, False),
            ("junk_fields", self.junk_fields, False),
            ("junk_fields_registered", self.junk_fields, True),
            ("hostile_hello", self.hostile_hello, False),
            ("session_ops", self.session_ops, True),
            ("before_hello", self.session_ops, False),
            ("huge", self.huge, True),
            ("frames", self.frames, True),
        ]
        self.weights = [10, 6, 4, 12, 10, 10, 30, 6, 1, 6]

    def __iter__(self) -> Iterator[Message]:
        while True:
            kind, draw, registered = self.rng.choices(self.kinds, self.weights)[0]
            yield Message(kind, draw(), registered)

    # ------------------------------------------------------------ families

    def random_bytes(self) -> list[bytes]:
        return [self.rng.randbytes(self.rng.randint(0, 300))]

    def truncated(self) -> list[bytes]:
        body = self.rng.choice(self.valid)
        return [body[: self.rng.randrange(len(body))]]

    def deep_nesting(self) -> list[bytes]:
        """An unknown field nested past msgspec's recursion limit (the finding
        that stopped the server), as an array or a map."""
        depth = self.rng.choice([100, 1_000, 5_000, 10_000, 50_000])
        level = b"\x91" if self.rng.random() < 0.5 else b"\x81\xa1k"
        return [b"\x82\xa2zz" + level * depth + b"\xc0" + b"\xa2op\xa4ping"]

    def edge_int(self) -> int:
        """An integer at an edge, within what MessagePack can carry."""
        return max(-(2**63), self.rng.choice(EDGE_INTS) * self.rng.choice([1, -1]))

    def junk(self, depth: int = 0) -> Any:
        r = self.rng.random()
        if r < 0.25:
            return self.edge_int()
        if r < 0.4:
            return self.rng.choice(EDGE_FLOATS)
        if r < 0.55:
            return "é" * self.rng.choice([0, 1, 300, 70_000])
        if r < 0.65:
            return self.rng.randbytes(self.rng.choice([0, 31, 32, 33, 1000]))
        if r < 0.75 and depth < 3:
            return [self.junk(depth + 1) for _ in range(self.rng.choice([0, 1, 3]))]
        if r < 0.8:
            return list(range(self.rng.choice([10, 1000, 50_000])))
        if r < 0.9 and depth < 3:
            return {"k": self.junk(depth + 1), "op": "ping"}
        return self.rng.choice([None, True, False])

    def junk_fields(self) -> list[bytes]:
        """A known operation with junk in some fields, or a field it lacks."""
        cls = self.rng.choice(REQUESTS)
        names = list(cls.__struct_fields__)
        message: dict[str, Any] = {"op": cls.__struct_config__.tag}
        for name in self.rng.sample(names, self.rng.randint(0, len(names))):
            message[name] = self.junk()
        if not names or self.rng.random() < 0.3:
            message[self.rng.choice(["unexpected", "zz", ""])] = self.junk()
        return [ENCODE(message)]

    def layout(self) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "group": 0,
            "num_layers": 2,
            "kv_heads": 2,
            "head_dim": 16,
            "dtype": "float16",
        }
        field_, value = self.rng.choice(
            [
                ("num_layers", 2**62),
                ("num_layers", 0),
                ("kv_heads", 2**40),
                ("head_dim", -(2**63)),
                ("head_dim", 2**20),
                ("group", 2**40),
                ("group", -1),
                ("dtype", "float128"),
                ("kind", "latent"),
                ("kind", "mystery"),
                ("format", "x" * 10_000),
            ]
        )
        spec[field_] = value
        return spec

    def hostile_hello(self) -> list[bytes]:
        fields: dict[str, Any] = {
            "op": "hello",
            "version": p.PROTOCOL_VERSION,
            "client_id": "fuzz",
            "model": w.MODEL,
            "layouts": [self.layout()],
        }
        change = self.rng.choice(
            ["layout", "alignment", "ranks", "rank", "layouts", "model", "salt", "id", "version"]
        )
        if change == "alignment":
            fields["block_alignment"] = self.rng.choice([2**40, 2**63 - 1, 0, -5, 3, 65_537])
            fields["layouts"] = [{**self.layout(), "num_layers": 2}]
        elif change == "ranks":
            fields["num_ranks"] = self.rng.choice([0, -1, 1025, 2**62])
        elif change == "rank":
            fields["rank"] = self.rng.choice([-2, 1, 2**62])
        elif change == "layouts":
            n = self.rng.choice([0, 17, 1000])
            fields["layouts"] = [{**self.layout(), "group": i % 3} for i in range(n)]
        elif change == "model":
            fields["model"] = self.rng.choice(["", "a@b", "x" * 500, "a\x00b", "é"])
        elif change == "salt":
            fields["salt"] = self.rng.choice(["alice@example.com", "x" * 100, "a/b"])
        elif change == "id":
            fields["client_id"] = "c" * self.rng.choice([257, 100_000])
        elif change == "version":
            fields["version"] = self.rng.choice(EDGE_INTS)
        return [ENCODE(fields)]

    def session_ops(self) -> list[bytes]:
        rid = self.rng.choice(REQUEST_IDS)
        big = self.edge_int()
        small = self.rng.randint(-2, 6)
        n = self.rng.randint(0, 6)
        hashes = [self.rng.choice(self.hashes) for _ in range(n)]
        if self.rng.random() < 0.2:
            hashes = [self.rng.randbytes(self.rng.choice([0, 31, 33])) for _ in range(n)]
        choice = self.rng.randrange(10)
        frames: list[bytes] = []
        message: p.Message
        if choice == 0:
            message = p.Lookup(rid, list(dict.fromkeys(hashes)), self.rng.choice([0, 0, 1, 2**40]))
        elif choice == 1:
            message = p.Wait(rid, self.rng.choice(EDGE_FLOATS))
        elif choice == 2:
            message = p.Query(rid)
        elif choice == 3:
            message = p.Retrieve(rid, self.rng.choice([small, big]), self.rng.choice([small, big]))
        elif choice == 4:
            message = p.Release(rid, self.rng.choice([small, big]), self.rng.choice([small, big]))
        elif choice == 5:
            message = p.StoreReserve(rid, list(dict.fromkeys(hashes)))
        elif choice == 6:
            message = self.rng.choice([p.StoreCommit, p.StoreAbort])(
                self.rng.choice([small, big, self.rng.randint(1, 200)])
            )
        elif choice == 7:
            message = p.Store(rid, list(dict.fromkeys(hashes)))
            count = len(message.hashes) + self.rng.choice([0, 0, -1, 1])
            size = self.rng.choice([self.size, self.size, 0, self.size - 1, 7])
            frames = [bytes(size)] * max(count, 0)
        elif choice == 8:
            message = p.EndSession(rid)
        else:
            message = self.rng.choice([p.Ping(), p.Status()])
        return [p.encode(message), *frames]

    def huge(self) -> list[bytes]:
        """Sizes past the limits: too many chunks, a long id, a long body."""
        choice = self.rng.randrange(3)
        if choice == 0:
            many = [i.to_bytes(32, "big") for i in range((1 << 16) + 1)]
            return [p.encode(p.Lookup("big", many))]
        if choice == 1:
            return [p.encode(p.Query("q" * 1_000_000))]
        return [ENCODE({"op": "ping", "pad": list(range(200_000))})]

    def frames(self) -> list[bytes]:
        """Frame-level oddities: an empty body, extra data frames on any op."""
        if self.rng.random() < 0.3:
            return [b""]
        body = self.rng.choice(self.valid[1:])
        return [body, *[self.rng.randbytes(self.rng.randint(0, 64)) for _ in range(3)]]


REQUESTS: list[Any] = list(p.Request.__args__)  # type: ignore[attr-defined]


@dataclass(slots=True)
class BlastReport:
    messages: int = 0
    seconds: float = 0.0
    kinds: Counter[str] = field(default_factory=Counter)
    replies: Counter[str] = field(default_factory=Counter)  # reply type or error code


def blast(
    address: str,
    messages: Iterator[Message],
    count: int,
    *,
    sockets: int = 4,
    window: int = 32,
    timeout_s: float = 30.0,
) -> BlastReport:
    """Send ``count`` messages; every one must get exactly one reply."""
    report = BlastReport()
    context = zmq.Context.instance()
    pool = []
    for i in range(sockets):
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        registered = i % 2 == 0
        if registered:
            welcome, _ = w.call(socket, w.hello(client_id=f"fuzz-{i}"))
            assert isinstance(welcome, p.Welcome), welcome
        pool.append((socket, registered, [0]))  # outstanding replies
    reservations: set[int] = set()
    started = time.perf_counter()
    try:
        for message in _take(messages, count):
            socket, _, outstanding = _pick(pool, message.registered, report)
            while outstanding[0] >= window:
                _receive(socket, outstanding, report, reservations, timeout_s)
            socket.send_multipart(message.frames)
            outstanding[0] += 1
            report.messages += 1
            report.kinds[message.kind] += 1
        for socket, _, outstanding in pool:
            while outstanding[0]:
                _receive(socket, outstanding, report, reservations, timeout_s)
            # Exactly one reply each: the next reply on this socket answers this ping.
            assert w.call(socket, p.Ping(), timeout_s=timeout_s)[0].__class__ is p.Pong
        report.seconds = time.perf_counter() - started
        for socket, registered, _ in pool:
            if registered:
                _clean_up(socket, reservations)
    finally:
        for socket, _, _ in pool:
            socket.close(linger=0)
    return report


def _take(messages: Iterator[Message], count: int) -> Iterator[Message]:
    for _, message in zip(range(count), messages, strict=False):
        yield message


def _pick(
    pool: list[tuple[zmq.Socket[bytes], bool, list[int]]], registered: bool, report: BlastReport
) -> tuple[zmq.Socket[bytes], bool, list[int]]:
    choices = [entry for entry in pool if entry[1] == registered]
    return choices[report.messages % len(choices)]


def _receive(
    socket: zmq.Socket[bytes],
    outstanding: list[int],
    report: BlastReport,
    reservations: set[int],
    timeout_s: float,
) -> None:
    reply, _ = w.recv_reply(socket, timeout_s)
    outstanding[0] -= 1
    name = reply.code if isinstance(reply, p.Error) else type(reply).__name__
    report.replies[name] += 1
    if isinstance(reply, p.Reserved):
        reservations.add(reply.reservation)


def _clean_up(socket: zmq.Socket[bytes], reservations: set[int]) -> None:
    """End the sessions and abort the reservations the traffic left open (a
    reservation belongs to the socket that made it: others get an error)."""
    for rid in REQUEST_IDS:
        w.call(socket, p.EndSession(rid))
    for reservation in reservations:
        w.call(socket, p.StoreAbort(reservation))
