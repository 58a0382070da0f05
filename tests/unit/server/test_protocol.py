from __future__ import annotations

import msgspec
import pytest

from kvtier.protocol import messages as p


@pytest.mark.parametrize(
    "message",
    [
        p.Hello(p.PROTOCOL_VERSION, "c", "org/m", [p.LayoutSpec(0, 2, 2, 64, "bfloat16")]),
        p.Lookup("r", [bytes(32)], 1),
        p.Query("r"),
        p.Wait("r", 0.5),
        p.Retrieve("r", 0, 3),
        p.Release("r", 1, 2),
        p.StoreReserve("r", [bytes(32)]),
        p.StoreCommit(7),
        p.StoreAbort(7),
        p.Store("r", [bytes(32)]),
        p.EndSession("r"),
        p.Ping(),
        p.Status(),
    ],
)
def test_requests_round_trip_with_stable_op_names(message: p.Message) -> None:
    body = p.encode(message)
    assert p.decode_request(body) == message
    op = msgspec.msgpack.decode(body)["op"]
    assert op == type(message).__struct_config__.tag


def test_replies_round_trip() -> None:
    for reply in (
        p.Welcome(256, "boot", "kvtier-1-ab"),
        p.QueryResult(None),
        p.QueryResult(0),
        p.Objects([0, 4096], [10, 10]),
        p.Reserved(1, [-1, 0], [10, 10]),
        p.Error("bad_request", "why"),
    ):
        assert p.decode_reply(p.encode(reply)) == reply


def test_pending_and_miss_are_different_on_the_wire() -> None:
    assert p.encode(p.QueryResult(None)) != p.encode(p.QueryResult(0))


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xff\xfe",
        msgspec.msgpack.encode({"op": "explode"}),
        msgspec.msgpack.encode({"op": "lookup", "request_id": 5, "hashes": []}),
        msgspec.msgpack.encode({"op": "query", "request_id": "r", "extra": 1}),
        msgspec.msgpack.encode([1, 2, 3]),
    ],
)
def test_malformed_requests_raise_msgspec_errors(body: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        p.decode_request(body)


def test_replies_are_not_requests() -> None:
    with pytest.raises(msgspec.ValidationError):
        p.decode_request(p.encode(p.Ack()))
