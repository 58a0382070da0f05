"""The stored-object format: header encoding, checks, and every corruption reason."""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np
import pytest

from kvtier.keys import ObjectKey
from kvtier.l2.format import (
    HEADER_ALIGN,
    MAGIC,
    VERSION,
    Corruption,
    CorruptObject,
    Header,
    checksum,
    encode_header,
    header_length,
    layout_bytes,
    parse_header,
    unpack_header,
    verify_payload,
)
from kvtier.l2.seal import Sealer, parse_secrets
from kvtier.l2.stored_value import decode_object, encode_object
from tests.conftest import make_key
from tests.unit.l2.harness import payload

LAYOUT_A = "00112233445566778899aabbccddeeff"
LAYOUT_B = "ffeeddccbbaa99887766554433221100"
FIXED = 42  # bytes before the key: magic, version, header_len, layout, length, checksum, keylen
SEAL_ROOM = 49  # codec, decoded length, key id, tag: room in every header


def _expected_header_len(key: ObjectKey, align: int) -> int:
    used = FIXED + SEAL_ROOM + len(key.to_str().encode())
    return (used + align - 1) // align * align


def _corrupt_reason(data: bytes, key: ObjectKey, layout: str, out: np.ndarray) -> Corruption:
    """Decode ``data``; it must be refused, and ``out`` must stay untouched."""
    before = out.copy()
    with pytest.raises(CorruptObject) as info:
        decode_object(data, key, layout, out)
    assert np.array_equal(out, before), "a refused copy was copied into the reader's buffer"
    return info.value.reason


# ------------------------------------------------------------ round trip


@pytest.mark.parametrize("layout", ["", LAYOUT_A])
@pytest.mark.parametrize("size", [0, 1, 63, 64, 4096, 10_001])
def test_object_round_trip(layout: str, size: int) -> None:
    key = make_key(3)
    data = payload(size, seed=size)
    stored = encode_object(key, layout, data)
    out = np.zeros(size, dtype=np.uint8)
    decode_object(stored, key, layout, out)
    assert np.array_equal(out, data)
    header_len = _expected_header_len(key, HEADER_ALIGN)
    assert len(stored) == header_len + size
    assert stored[header_len:] == data.tobytes()


def test_header_round_trip_fields() -> None:
    key = make_key(7, rank=3, group=2, salt="tenant-1")
    data = payload(5000, seed=1)
    header_bytes = encode_header(key, LAYOUT_A, data)
    header = parse_header(header_bytes, key, LAYOUT_A)
    assert header == Header(
        header_len=len(header_bytes),
        layout=bytes.fromhex(LAYOUT_A),
        payload_len=5000,
        checksum=checksum(data),
        key=key.to_str(),
    )
    assert header_bytes[:4] == MAGIC
    assert struct.unpack_from("<H", header_bytes, 4)[0] == VERSION
    key_text = key.to_str().encode()
    assert struct.unpack_from("<H", header_bytes, 40)[0] == len(key_text)
    assert header_bytes[FIXED : FIXED + len(key_text)] == key_text
    assert header_bytes[FIXED + len(key_text) :] == bytes(len(header_bytes) - FIXED - len(key_text))
    verify_payload(header, data)  # does not raise


def test_parse_header_accepts_header_followed_by_payload() -> None:
    key = make_key(1)
    data = payload(100, seed=2)
    stored = encode_object(key, "", data)
    header = parse_header(stored, key, "")
    assert header.payload_len == 100
    verify_payload(header, np.frombuffer(stored, dtype=np.uint8, offset=header.header_len))


def test_empty_layout_is_zero_digest() -> None:
    key = make_key(1)
    data = payload(10, seed=0)
    header = encode_header(key, "", data)
    assert header[8:24] == bytes(16)
    assert parse_header(header, key, "").layout == bytes(16)


def test_checksum_differs_for_one_flipped_byte() -> None:
    data = payload(4096, seed=5)
    flipped = data.copy()
    flipped[2000] ^= 0x01
    assert checksum(flipped) != checksum(data)


# ------------------------------------------------------------ alignment


@pytest.mark.parametrize("align", [HEADER_ALIGN, 4096])
def test_header_length_is_a_multiple_of_the_alignment(align: int) -> None:
    data = payload(10, seed=0)
    lengths = set()
    for model_chars in range(1, 129):
        for salt in ("", "s", "x" * 64):
            key = ObjectKey(bytes(32), "m" * model_chars, 65535, 65535, salt)
            header = encode_header(key, LAYOUT_A, data, align)
            assert len(header) % align == 0
            assert len(header) == _expected_header_len(key, align)
            assert parse_header(header, key, LAYOUT_A).header_len == len(header)
            lengths.add(len(header))
    if align == HEADER_ALIGN:
        assert len(lengths) > 1  # the keys above span several 64-byte steps


# ------------------------------------------------------------ corruption


class Stored(NamedTuple):
    key: ObjectKey
    data: np.ndarray
    obj: bytes  # header and payload, as an adapter stores them


@pytest.fixture
def stored() -> Stored:
    key = make_key(11)
    data = payload(3000, seed=11)
    return Stored(key, data, encode_object(key, LAYOUT_A, data))


def test_bad_magic(stored: Stored) -> None:
    key, obj = stored.key, stored.obj
    bad = b"KVTX" + obj[4:]
    with pytest.raises(CorruptObject) as info:
        parse_header(bad, key, LAYOUT_A)
    assert info.value.reason is Corruption.MAGIC
    assert _corrupt_reason(bad, key, LAYOUT_A, np.zeros(3000, np.uint8)) is Corruption.MAGIC


@pytest.mark.parametrize("version", [0, 4, 0xFFFF])
def test_wrong_version(stored: Stored, version: int) -> None:
    key, obj = stored.key, stored.obj
    bad = obj[:4] + struct.pack("<H", version) + obj[6:]
    with pytest.raises(CorruptObject) as info:
        parse_header(bad, key, LAYOUT_A)
    assert info.value.reason is Corruption.VERSION
    assert _corrupt_reason(bad, key, LAYOUT_A, np.zeros(3000, np.uint8)) is Corruption.VERSION


@pytest.mark.parametrize(
    "other",
    [
        make_key(12),
        make_key(11, rank=1),
        make_key(11, group=1),
        make_key(11, salt="t"),
        ObjectKey((11).to_bytes(32, "big"), "other-model", 0),
    ],
    ids=["hash", "rank", "group", "salt", "model"],
)
def test_other_key(stored: Stored, other: ObjectKey) -> None:
    obj = stored.obj
    with pytest.raises(CorruptObject) as info:
        parse_header(obj, other, LAYOUT_A)
    assert info.value.reason is Corruption.KEY
    assert _corrupt_reason(obj, other, LAYOUT_A, np.zeros(3000, np.uint8)) is Corruption.KEY


@pytest.mark.parametrize(
    ("stored_layout", "wanted"),
    [(LAYOUT_A, LAYOUT_B), (LAYOUT_A, ""), ("", LAYOUT_A)],
)
def test_other_layout(stored_layout: str, wanted: str) -> None:
    key = make_key(1)
    data = payload(100, seed=1)
    obj = encode_object(key, stored_layout, data)
    with pytest.raises(CorruptObject) as info:
        parse_header(obj, key, wanted)
    assert info.value.reason is Corruption.LAYOUT
    assert _corrupt_reason(obj, key, wanted, np.zeros(100, np.uint8)) is Corruption.LAYOUT


def test_wrong_length(stored: Stored) -> None:
    key, data, obj = stored.key, stored.data, stored.obj
    header = parse_header(obj, key, LAYOUT_A)
    with pytest.raises(CorruptObject) as info:
        verify_payload(header, data[:-1])
    assert info.value.reason is Corruption.LENGTH
    with pytest.raises(CorruptObject) as info:
        verify_payload(header, np.concatenate([data, data[:1]]))
    assert info.value.reason is Corruption.LENGTH
    # the reader expects another size
    assert _corrupt_reason(obj, key, LAYOUT_A, np.zeros(2999, np.uint8)) is Corruption.LENGTH
    assert _corrupt_reason(obj, key, LAYOUT_A, np.zeros(3001, np.uint8)) is Corruption.LENGTH
    # more bytes stored than the header promises
    assert _corrupt_reason(obj + b"\0", key, LAYOUT_A, np.zeros(3000, np.uint8)) is (
        Corruption.LENGTH
    )
    # a header that promises more payload than is stored
    lying = bytearray(obj)
    struct.pack_into("<Q", lying, 24, 3001)
    assert _corrupt_reason(bytes(lying), key, LAYOUT_A, np.zeros(3001, np.uint8)) is (
        Corruption.SHORT
    )


def test_a_coded_copy_is_refused_by_a_reader_of_payloads_as_stored(stored: Stored) -> None:
    """fs and mooncake read the payload straight into the reader's buffer:
    a coded copy of the same length, checksum right, is not that KV."""
    key, data = stored.key, stored.data
    coded = encode_header(key, LAYOUT_A, data, codec=1, decoded_len=data.nbytes)
    header = parse_header(coded, key, LAYOUT_A)
    with pytest.raises(CorruptObject) as info:
        verify_payload(header, data)
    assert info.value.reason is Corruption.CODEC
    obj = coded + data.tobytes()
    assert _corrupt_reason(obj, key, LAYOUT_A, np.zeros(3000, np.uint8)) is Corruption.CODEC


def test_a_version_2_header_without_a_codec_is_refused(stored: Stored) -> None:
    """Its decoded length could differ from the stored one: a payload of 100
    bytes promising 200 is a corrupt copy, not a reader's crash."""
    key, data = stored.key, stored.data[:100]
    coded = bytearray(encode_header(key, LAYOUT_A, data, codec=1, decoded_len=200))
    coded[FIXED] = 0  # the codec field
    obj = bytes(coded) + data.tobytes()
    with pytest.raises(CorruptObject) as info:
        parse_header(obj, key, LAYOUT_A)
    assert info.value.reason is Corruption.CODEC
    assert _corrupt_reason(obj, key, LAYOUT_A, np.zeros(200, np.uint8)) is Corruption.CODEC


@pytest.mark.parametrize("keep", [0, 1, 4, 41, FIXED, FIXED + 40])
def test_truncated_header(stored: Stored, keep: int) -> None:
    key, obj = stored.key, stored.obj
    with pytest.raises(CorruptObject) as info:
        parse_header(obj[:keep], key, LAYOUT_A)
    assert info.value.reason is Corruption.SHORT
    assert _corrupt_reason(obj[:keep], key, LAYOUT_A, np.zeros(3000, np.uint8)) is (
        Corruption.SHORT
    )


def test_header_length_field_shorter_than_its_key(
    stored: Stored,
) -> None:
    key, obj = stored.key, stored.obj
    bad = bytearray(obj)
    struct.pack_into("<H", bad, 6, FIXED)  # header_len that cannot hold the key
    with pytest.raises(CorruptObject) as info:
        parse_header(bytes(bad), key, LAYOUT_A)
    assert info.value.reason is Corruption.SHORT


@pytest.mark.parametrize("cut", [1, 100, 2999, 3000])
def test_truncated_payload_is_refused(stored: Stored, cut: int) -> None:
    key, obj = stored.key, stored.obj
    reason = _corrupt_reason(obj[:-cut], key, LAYOUT_A, np.zeros(3000, np.uint8))
    assert reason in (Corruption.SHORT, Corruption.LENGTH)


def test_truncated_payload_is_short(stored: Stored) -> None:
    key, obj = stored.key, stored.obj
    assert _corrupt_reason(obj[:-1], key, LAYOUT_A, np.zeros(3000, np.uint8)) is Corruption.SHORT


@pytest.mark.parametrize("where", [0, 1, 1500, 2999])
def test_flipped_payload_byte(stored: Stored, where: int) -> None:
    key, data, obj = stored.key, stored.data, stored.obj
    header = parse_header(obj, key, LAYOUT_A)
    bad = bytearray(obj)
    bad[header.header_len + where] ^= 0x01
    out = np.zeros(3000, np.uint8)
    assert _corrupt_reason(bytes(bad), key, LAYOUT_A, out) is Corruption.CHECKSUM
    flipped = data.copy()
    flipped[where] ^= 0x01
    with pytest.raises(CorruptObject) as info:
        verify_payload(header, flipped)
    assert info.value.reason is Corruption.CHECKSUM


def test_corrupt_object_carries_reason_and_detail() -> None:
    error = CorruptObject(Corruption.LENGTH, "3 != 4")
    assert error.reason is Corruption.LENGTH
    assert str(error) == "length: 3 != 4"
    assert str(CorruptObject(Corruption.CHECKSUM)) == "checksum"


# ------------------------------------------------------------ layout digests


def test_layout_bytes() -> None:
    assert layout_bytes("") == bytes(16)
    assert layout_bytes(LAYOUT_A) == bytes.fromhex(LAYOUT_A)
    assert layout_bytes(LAYOUT_A.upper()) == bytes.fromhex(LAYOUT_A)


@pytest.mark.parametrize(
    "digest",
    ["ab", "ab" * 15, "ab" * 17, "abc", "zz" * 16, "0x" + "ab" * 15],
)
def test_layout_bytes_rejects_bad_digest(digest: str) -> None:
    with pytest.raises(ValueError):
        layout_bytes(digest)
    with pytest.raises(ValueError):
        encode_header(make_key(1), digest, payload(1, seed=0))


def test_layout_bytes_error_names_the_digest() -> None:
    with pytest.raises(ValueError, match="32 hex digits") as info:
        layout_bytes("ab" * 8)
    assert repr("ab" * 8) in str(info.value)


# -------------------------------------------------------------- sealed (v3)

SECRET = b"f" * 32


def test_a_sealed_header_carries_its_key_id_and_tag_where_the_format_says() -> None:
    key, data = make_key(21), payload(3000, seed=2)
    seal = Sealer([SECRET])
    obj = encode_object(key, LAYOUT_A, data, seal=seal)
    assert struct.unpack_from("<H", obj, 4)[0] == 3
    assert obj[42] == 0 and struct.unpack_from("<Q", obj, 43)[0] == 3000  # codec, length
    assert obj[51:59] == seal.key_id
    header = parse_header(obj, key, LAYOUT_A)
    assert header.tag == obj[59:91] and header.key == key.to_str()
    out = np.zeros(3000, np.uint8)
    decode_object(obj, key, LAYOUT_A, out, seal=seal)
    assert np.array_equal(out, data)
    decode_object(obj, key, LAYOUT_A, out)  # no secret: read on its checksum


def test_a_header_is_as_long_sealed_or_not_and_coded_or_not() -> None:
    """Mooncake's loads split header from payload by the length they expect:
    a copy of either kind must have it."""
    data = payload(64, seed=1)
    for model_chars in range(1, 129):
        key = ObjectKey(bytes(32), "m" * model_chars, 1, 0, "s")
        plain = encode_header(key, LAYOUT_A, data)
        coded = encode_header(key, LAYOUT_A, data, codec=1, decoded_len=128)
        sealed = encode_header(key, LAYOUT_A, data, seal=Sealer([SECRET]))
        assert len(plain) == len(coded) == len(sealed) == header_length(key)


@pytest.mark.parametrize("at", [8, 24, 32, 51, 60, 95, 200])
def test_any_byte_changed_in_a_sealed_object_fails_its_tag(at: int) -> None:
    """The layout (8), the length field (24), the checksum (32), the key id
    (51), the tag (60), the key (95), the payload (200): each is covered."""
    key, data = make_key(22), payload(3000, seed=3)
    seal = Sealer([SECRET])
    obj = bytearray(encode_object(key, LAYOUT_A, data, seal=seal))
    obj[at] ^= 0x01
    header = unpack_header(bytes(obj))
    stored = np.frombuffer(bytes(obj), np.uint8, offset=header.header_len)
    with pytest.raises(CorruptObject) as info:
        verify_payload(header, stored, seal)
    assert info.value.reason in (Corruption.MAC, Corruption.LENGTH)


def test_a_reader_with_a_secret_refuses_an_unsealed_object() -> None:
    key, data = make_key(23), payload(100, seed=4)
    obj = encode_object(key, LAYOUT_A, data)
    with pytest.raises(CorruptObject, match="unsealed") as info:
        decode_object(obj, key, LAYOUT_A, np.zeros(100, np.uint8), seal=Sealer([SECRET]))
    assert info.value.reason is Corruption.MAC


def test_secrets_are_checked_and_name_what_to_change() -> None:
    assert parse_secrets("a" * 32 + "\n\n" + "b" * 40 + "\n", "x") == (b"a" * 32, b"b" * 40)
    with pytest.raises(ValueError, match="x is empty"):
        parse_secrets(" \n", "x")
    with pytest.raises(ValueError, match="secret 2 is 31 characters"):
        parse_secrets("a" * 32 + "\n" + "b" * 31, "x")
    one, two = Sealer([b"a" * 32]), Sealer([b"a" * 32, b"b" * 32])
    assert one.key_id == two.key_id and two.key_ids[0] == one.key_ids[0]
    assert Sealer([b"b" * 32]).key_id != one.key_id
