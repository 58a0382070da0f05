"""Malformed and out-of-order requests against a live server, from raw DEALERs.

Every case gets exactly one ``Error`` reply with the expected code (the next
reply on the same socket is the answer to a ``Ping``), the server counts no
internal error, and between cases a well-behaved client still stores and hits.
"""

from __future__ import annotations

import itertools
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.protocol import messages as p
from kvtier.protocol.client import CacheClient
from kvtier.protocol.status import ServerStatus
from tests.integration import hostile
from tests.integration import workload as w
from tests.integration.harness import Server, ServerFactory, wait_for

MAX_EXAMPLES = 600  # about 3 s here
HIT = 3  # chunks the fuzz socket's own lookup hits, for out-of-range cases
REQUESTS: tuple[Any, ...] = typing.get_args(p.Request)
OPS = [cls.__struct_config__.tag for cls in REQUESTS]
FIELDS: dict[str, list[str]] = {
    cls.__struct_config__.tag: list(cls.__struct_fields__) for cls in REQUESTS
}
ENCODE = msgspec.msgpack.encode
SIZE = w.object_bytes(256)


@dataclass
class Case:
    kind: str
    frames: list[bytes]
    codes: frozenset[str]
    register: bool = False  # say hello first
    lookup: bool = False  # and hold an answered lookup "fz" of HIT chunks


def undecodable(body: bytes) -> bool:
    try:
        p.decode_request(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return True
    return False


HASHES = w.chunk_hashes(256, seed=999, n_chunks=HIT)
VALID = [
    p.encode(m)
    for m in (
        w.hello(),
        p.Lookup("r", HASHES),
        p.Wait("r", 1.0),
        p.Retrieve("r", 0, 1),
        p.Store("s", HASHES[:1]),
        p.Ping(),
        p.StoreCommit(7),
    )
]
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=40),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-(2**63), 2**63 - 1), max_size=2),
)


@st.composite
def random_bytes(draw: st.DrawFn) -> Case:
    body = draw(st.binary(max_size=200).filter(undecodable))
    return Case("random", [body], frozenset({"bad_request", "unknown_op"}), draw(st.booleans()))


@st.composite
def truncated(draw: st.DrawFn) -> Case:
    body = draw(st.sampled_from(VALID))
    cut = draw(st.integers(0, len(body) - 1))
    return Case("truncated", [body[:cut]], frozenset({"bad_request"}), draw(st.booleans()))


@st.composite
def wrong_types(draw: st.DrawFn) -> Case:
    """A known op with junk in some of its fields, or a field it does not have."""
    op = draw(st.sampled_from(OPS))
    names = FIELDS[op]
    chosen = draw(st.lists(st.sampled_from(names), unique=True)) if names else []
    message = {name: draw(junk) for name in chosen}
    if not chosen or draw(st.booleans()):
        message["unexpected"] = draw(junk)
    message["op"] = op
    body = ENCODE(message)
    if not undecodable(body):  # junk that happens to fit: break one field for sure
        message[chosen[0]] = [[["not", "this"]]]
        body = ENCODE(message)
    return Case("wrong_types", [body], frozenset({"bad_request"}), draw(st.booleans()))


@st.composite
def huge_lengths(draw: st.DrawFn) -> Case:
    declared = draw(st.integers(1 << 16, (1 << 32) - 1)).to_bytes(4, "big")
    header = draw(st.sampled_from([b"\xc6", b"\xdb", b"\xdd", b"\xdf"]))  # bin/str/array/map 32
    prefix = draw(
        st.sampled_from(
            [
                b"",
                b"\x82\xa2op\xa6lookup\xaahashes",
                b"\x83\xa2op\xa6lookup\xaarequest_id",
                b"\x82\xa2op\xa5query\xaarequest_id",
            ]
        )
    )
    body = prefix + header + declared + draw(st.binary(max_size=16))
    return Case("huge_length", [body], frozenset({"bad_request"}), draw(st.booleans()))


@st.composite
def unknown_ops(draw: st.DrawFn) -> Case:
    op = draw(st.text(max_size=12).filter(lambda s: s not in OPS))
    extra = draw(st.dictionaries(st.sampled_from(["request_id", "x", "hashes"]), junk, max_size=2))
    body = ENCODE({**extra, "op": op})
    return Case("unknown_op", [body], frozenset({"unknown_op"}), draw(st.booleans()))


big = st.integers(-(2**63), 2**64 - 1)
edge = st.one_of(st.integers(-2, HIT + 2), big)  # mostly around the hit's bounds


@st.composite
def bad_ranges(draw: st.DrawFn) -> Case:
    if draw(st.booleans()):
        start, end = draw(st.tuples(edge, edge).filter(lambda r: not 0 <= r[0] < r[1] <= HIT))
        message: p.Message = p.Retrieve("fz", start, end)
    else:
        start, end = draw(st.tuples(edge, edge).filter(lambda r: not 0 <= r[0] <= min(r[1], HIT)))
        message = p.Release("fz", start, end)
    return Case("bad_range", [p.encode(message)], frozenset({"bad_range"}), True, True)


session_ops = st.one_of(
    st.builds(p.Lookup, st.just("r"), st.just(HASHES)),
    st.builds(p.Query, st.text(min_size=1, max_size=8)),
    st.builds(p.Wait, st.text(min_size=1, max_size=8), st.floats(0, 1)),
    st.builds(p.Retrieve, st.text(min_size=1, max_size=8), big, big),
    st.builds(p.Release, st.text(min_size=1, max_size=8), big, big),
    st.builds(p.StoreReserve, st.just("s"), st.just(HASHES)),
    st.builds(p.StoreCommit, big),
    st.builds(p.StoreAbort, big),
    st.builds(p.Store, st.just("s"), st.just(HASHES[:1])),
    st.builds(p.EndSession, st.text(min_size=1, max_size=8)),
)


@st.composite
def before_hello(draw: st.DrawFn) -> Case:
    message = draw(session_ops)
    frames = [p.encode(message)]
    if isinstance(message, p.Store):
        frames.append(bytes(SIZE))
    return Case("before_hello", frames, frozenset({"no_hello"}))


@st.composite
def unknown_session(draw: st.DrawFn) -> Case:
    rid = draw(st.text(min_size=1, max_size=8).filter(lambda r: r != "fz"))
    message = draw(
        st.sampled_from(
            [p.Query(rid), p.Wait(rid, 0.5), p.Retrieve(rid, 0, 1), p.Release(rid, 0, 1)]
        )
    )
    extra = draw(st.lists(st.binary(max_size=8), max_size=2))
    return Case("unknown_session", [p.encode(message), *extra], frozenset({"no_session"}), True)


@st.composite
def unknown_reservation(draw: st.DrawFn) -> Case:
    rid = draw(big)
    message = draw(st.sampled_from([p.StoreCommit(rid), p.StoreAbort(rid)]))
    return Case("no_reservation", [p.encode(message)], frozenset({"no_reservation"}), True)


@st.composite
def extra_frames(draw: st.DrawFn) -> Case:
    n = draw(st.integers(0, HIT))
    count = draw(st.integers(0, 4).filter(lambda c: c != n))
    data = [bytes(SIZE)] * count
    if draw(st.booleans()) and n:  # right count, wrong size
        data = [bytes(draw(st.integers(0, 64)))] * n
    frames = [p.encode(p.Store("s", HASHES[:n])), *data]
    return Case("data_frames", frames, frozenset({"bad_request"}), True)


@st.composite
def bad_hello(draw: st.DrawFn) -> Case:
    what = draw(st.sampled_from(["version", "ranks", "layouts", "dtype", "model", "alignment"]))
    fields: dict[str, Any] = {}
    code = "bad_request"
    if what == "version":
        fields["version"] = draw(st.integers(-(2**63), 2**63 - 1).filter(lambda v: v != 1))
        code = "version"
    elif what == "ranks":
        fields["num_ranks"] = draw(
            st.one_of(st.integers(-(2**63), 0), st.integers(1025, 2**64 - 1))
        )
    elif what == "layouts":
        fields["layouts"] = []
    elif what == "dtype":
        dtype = draw(st.text(max_size=10).filter(lambda d: d not in ("float16", "bfloat16")))
        fields["layouts"] = [p.LayoutSpec(0, 2, 2, 16, dtype)]
    elif what == "model":
        # Any other name is hashed into a key-safe label (tests/unit/keys).
        fields["model"] = draw(st.sampled_from(["", "x" * 5000]))
    else:  # the chunk size is frozen at 256: an alignment must divide it
        fields["chunk_alignment"] = draw(
            st.integers(-(2**31), 2**31).filter(lambda a: a <= 0 or 256 % a)
        )
    return Case("bad_hello", [p.encode(w.hello(**fields))], frozenset({code}), draw(st.booleans()))


cases = st.one_of(
    random_bytes(),
    truncated(),
    wrong_types(),
    huge_lengths(),
    unknown_ops(),
    bad_ranges(),
    before_hello(),
    unknown_session(),
    unknown_reservation(),
    extra_frames(),
    bad_hello(),
)


def run_case(server: Server, case: Case, tables: Callable[[], ServerStatus | None]) -> p.Error:
    with w.raw_dealer(server.rpc) as socket:
        if case.register:
            welcome, _ = w.call(socket, w.hello(client_id="fuzz"))
            assert isinstance(welcome, p.Welcome), welcome
        if case.lookup:
            assert w.call(socket, p.Lookup("fz", HASHES))[0] == p.Ack()
            assert w.call(socket, p.Wait("fz", 10.0))[0].hit_chunks == HIT
        w.send_raw(socket, case.frames)
        reply, data = w.recv_reply(socket)
        assert isinstance(reply, p.Error), (case, reply)
        assert reply.code in case.codes, (case, reply)
        assert data == []
        # Exactly one reply: the next one on this socket answers the ping.
        assert w.call(socket, p.Ping())[0] == p.Pong(server.boot_id)
        # Refused requests leave nothing behind (the lookup "fz" holds HIT locks).
        status = tables()
        assert status is not None and status.store_reservations == 0, case
        storage = status.storage
        assert storage.held_lookup_locks == (HIT if case.lookup else 0), case
        assert storage.l1.staging_objects == 0, case
        if case.lookup:
            assert w.call(socket, p.EndSession("fz"))[0] == p.Ack()
        return reply


@pytest.fixture(scope="module")
def fuzz_server(module_servers: ServerFactory) -> Server:
    return module_servers.start()


@pytest.mark.slow
def test_every_malformed_request_gets_exactly_one_error(fuzz_server: Server) -> None:
    server = fuzz_server
    client = CacheClient(w.client_config(server.rpc, shm=True, client_id="good"))
    seeds = itertools.count(1)
    seen: dict[str, int] = {}
    try:
        assert client.chunk_size == 256  # registers first: the chunk size is frozen now
        assert client.store("seed", HASHES, w.payloads(999, HIT, SIZE)) == HIT

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        @given(case=cases)
        def check(case: Case) -> None:
            run_case(server, case, client.status)
            seen[case.kind] = seen.get(case.kind, 0) + 1
            seed = next(seeds)
            hashes = w.chunk_hashes(256, seed, 1)
            assert client.store(f"good-{seed}", hashes, w.payloads(seed, 1, SIZE)) == 1
            state = client.lookup(f"good-{seed}", hashes)
            assert client.query(state, timeout_s=10.0) == 1
            client.end_session(f"good-{seed}")

        check()
        assert client.stats.errors == {}
        assert client.stats.degraded_requests == 0 and client.stats.server_restarts == 0
    finally:
        client.close()
    assert len(seen) >= 8, seen  # the strategy reached most kinds of case
    status = w.live_status(server.rpc)  # the live tables, not the HTTP snapshot
    assert status["storage"]["held_lookup_locks"] == 0
    assert status["store_reservations"] == 0
    assert "internal" not in status["server"]["errors"]
    assert "Traceback" not in server.log


def test_too_many_chunks_in_one_request_is_refused(fuzz_server: Server) -> None:
    hashes = [i.to_bytes(32, "big") for i in range((1 << 16) + 1)]
    with w.raw_dealer(fuzz_server.rpc) as socket:
        assert isinstance(w.call(socket, w.hello())[0], p.Welcome)
        for message in (p.Lookup("big", hashes), p.StoreReserve("big", hashes)):
            reply, _ = w.call(socket, message)
            assert isinstance(reply, p.Error) and reply.code == "bad_request", reply
            assert "65537 chunks" in reply.message
        assert w.call(socket, p.Ping())[0] == p.Pong(fuzz_server.boot_id)


def test_wrong_hash_length_and_unregistered_group(fuzz_server: Server) -> None:
    with w.raw_dealer(fuzz_server.rpc) as socket:
        assert isinstance(w.call(socket, w.hello())[0], p.Welcome)
        cases = [
            p.Lookup("a", [b"short"]),
            p.Lookup("b", HASHES, group=1),
            p.StoreReserve("c", [bytes(33)]),
            p.Lookup("", HASHES),
            p.Lookup("x" * 257, HASHES),
            p.Lookup("d", [HASHES[0], HASHES[0]]),
        ]
        for message in cases:
            reply, _ = w.call(socket, message)
            assert isinstance(reply, p.Error) and reply.code == "bad_request", (message, reply)
        assert w.status_via(socket)["storage"]["held_lookup_locks"] == 0


# ------------------------------------------------------------ volume


FUZZ_MESSAGES = 10_000  # about 10 s here; benchmarks/bench_fuzz_server.py runs longer


def rss_anon_bytes(pid: int) -> int:
    """The server's private resident memory (the shared-memory arena excluded)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc status")


def test_ten_thousand_hostile_messages_get_one_reply_each(
    fuzz_server: Server, tmp_path: Path
) -> None:
    """The issue's target: at least 10,000 hostile messages against a live
    server, each answered exactly once; the server alive, its memory bounded,
    nothing left held, and a normal client correct afterwards."""
    server = fuzz_server
    before = rss_anon_bytes(server.pid)
    report = hostile.blast(server.rpc, iter(hostile.HostileMessages(seed=14)), FUZZ_MESSAGES)
    after = rss_anon_bytes(server.pid)
    assert report.messages == FUZZ_MESSAGES
    assert len(report.kinds) == 10, report.kinds  # every family was drawn
    assert server.proc.poll() is None, server.log
    assert "internal" not in report.replies, report.replies
    assert after - before < 64 << 20, (before, after)  # transient buffers, not one per message
    status = w.live_status(server.rpc)
    assert status["storage"]["held_lookup_locks"] == 0
    assert status["store_reservations"] == 0
    assert status["session_objects"] == 0
    assert status["storage"]["l1"]["staging_objects"] == 0
    assert "internal" not in status["server"]["errors"]
    assert status["transport"]["loop_errors"] == 0
    assert "Traceback" not in server.log
    # A well-behaved client still stores, hits and reads back its own bytes.
    client = CacheClient(w.client_config(server.rpc, shm=True, client_id="after-fuzz"))
    try:
        hashes = w.chunk_hashes(256, seed=77, n_chunks=3)
        data = w.payloads(77, 3, SIZE)
        assert client.store("after", hashes, data) == 3
        state = client.lookup("after-read", hashes)
        assert client.query(state, timeout_s=10.0) == 3
        out = w.empty_buffers(3, SIZE)
        assert client.retrieve_into("after-read", 0, 3, out)
        assert all((a == b).all() for a, b in zip(out, data, strict=True))
        client.end_session("after-read")
    finally:
        client.close()


def test_a_message_nested_past_the_recursion_limit_is_an_error(fuzz_server: Server) -> None:
    """The finding that stopped the server: one unauthenticated message with
    an unknown field nested ~10,000 levels deep (RecursionError in msgspec)."""
    for level in (b"\x91", b"\x81\xa1k"):
        body = b"\x82\xa2zz" + level * 10_000 + b"\xc0" + b"\xa2op\xa4ping"
        with w.raw_dealer(fuzz_server.rpc) as socket:
            w.send_raw(socket, [body])
            reply, _ = w.recv_reply(socket)
            assert isinstance(reply, p.Error) and reply.code == "bad_request", reply
            assert w.call(socket, p.Ping())[0] == p.Pong(fuzz_server.boot_id)
    assert fuzz_server.proc.poll() is None


def test_a_stolen_routing_id_does_not_inherit_a_registration(server: Server) -> None:
    """The finding: with ROUTER_HANDOVER a peer with no token that presented an
    authenticated client's routing id inherited its registration. Its own
    server: the owner's session stays there until its client's time-to-live."""
    context = zmq.Context.instance()
    owner = context.socket(zmq.DEALER)
    owner.setsockopt(zmq.ROUTING_ID, b"victim-id")
    owner.setsockopt(zmq.LINGER, 0)
    owner.connect(server.rpc)
    try:
        assert isinstance(w.call(owner, w.hello(client_id="victim"))[0], p.Welcome)
        assert w.call(owner, p.Lookup("mine", HASHES))[0] == p.Ack()
    finally:
        owner.close(linger=0)

    def query() -> p.Reply | None:
        # Until the server has dropped the owner's connection, the id is taken
        # and the thief's connection is refused: ask again, on a new connection
        # each time (not relying on a refused socket's reconnection).
        thief = context.socket(zmq.DEALER)
        thief.setsockopt(zmq.ROUTING_ID, b"victim-id")
        thief.setsockopt(zmq.LINGER, 0)
        thief.connect(server.rpc)
        try:
            return w.call(thief, p.Query("mine"), timeout_s=2.0)[0]
        except AssertionError:
            return None
        finally:
            thief.close(linger=0)

    reply = wait_for(query, lambda r: r is not None, timeout_s=30.0)
    assert isinstance(reply, p.Error) and reply.code == "no_hello", reply
