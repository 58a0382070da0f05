"""The stored-object format shared by every L2 adapter.

Each object is a header followed by the payload (the chunk's KV bytes)::

    offset  size  field
    0       4     magic b"KVTO"
    4       2     format version (1)
    6       2     header length in bytes (fixed part + key, padded to 64;
                  to 4096 for O_DIRECT), i.e. where the payload starts
    8       16    layout digest (``KVLayout.digest()``, 16 bytes; zeros if none)
    24      8     payload length in bytes
    32      8     xxh3-64 of the payload
    40      2     key length in bytes
    42      n     the object key's string form (``ObjectKey.to_str()``), UTF-8
    42+n    ...   zero padding up to the header length

A payload stored with a codec (``kvtier.l2.codecs``) has a version 2 header:
the same fields, the payload length and checksum being those of the stored
(encoded) bytes, then before the key::

    42      1     codec (``Codec.ident``)
    43      8     the decoded payload's length
    51      n     the key ...

Uncoded objects keep version 1, which readers of every version read. A
reader that takes payloads as they are stored (``verify_payload``) refuses a
coded copy: its bytes are not the KV.
All integers are little-endian. A load whose magic, version, key, layout,
length or checksum does not match what the reader asked for is a miss, and
the adapter deletes or quarantines that copy: stale metadata can cost a miss,
never wrong KV (ARCHITECTURE §1).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from kvtier.keys import ObjectKey

MAGIC = b"KVTO"
VERSION = 1
CODED_VERSION = 2
_FIXED = struct.Struct(
    "<4sHH16sQQH"
)  # magic, version, header_len, layout, length, checksum, keylen
_CODED = struct.Struct("<BQ")  # version 2: codec, decoded length
HEADER_ALIGN = 64
MAX_HEADER_BYTES = 4096
# A stored copy of n payload bytes is at most this factor of n, plus a header
# and slack. zstd grows incompressible bytes by under 1 % and a lossy copy is
# smaller than the plain bytes for any real chunk: four times over, no honest
# copy is ever refused, and a planted one costs a reader a bounded read.
STORED_BOUND_FACTOR = 4
STORED_BOUND_SLACK = 64 << 10


def stored_bound(payload_bytes: int) -> int:
    """The most bytes an honest stored copy of ``payload_bytes`` can take. A
    reader of a store other nodes write (Redis, S3) reads no more than this
    (plus one byte, to see that a copy is longer): a copy made of whatever
    another writer chose never costs more memory than the object's size."""
    return STORED_BOUND_FACTOR * payload_bytes + MAX_HEADER_BYTES + STORED_BOUND_SLACK


class Corruption(enum.Enum):
    """Why a stored copy was refused."""

    SHORT = "short"  # fewer bytes than a header, or than the header promises
    MAGIC = "magic"
    VERSION = "version"
    KEY = "key"
    LAYOUT = "layout"
    LENGTH = "length"
    CHECKSUM = "checksum"
    CODEC = "codec"  # an unknown codec, one this node lacks, or bytes it cannot decode


class CorruptObject(Exception):
    """Raised by ``parse_header``/``verify_payload``; adapters turn it into a miss."""

    def __init__(self, reason: Corruption, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason


def layout_bytes(layout: str) -> bytes:
    """The 16-byte field for a ``KVLayout.digest()`` hex string ("" -> zeros)."""
    if not layout:
        return bytes(16)
    raw = bytes.fromhex(layout)
    if len(raw) != 16:
        raise ValueError(f"layout digest {layout!r} must be 32 hex digits (KVLayout.digest())")
    return raw


Payload = npt.NDArray[np.uint8]


def checksum(payload: Payload) -> int:
    return xxhash.xxh3_64_intdigest(payload.data)


@dataclass(frozen=True, slots=True)
class Header:
    header_len: int
    layout: bytes
    payload_len: int  # stored bytes (encoded, if coded)
    checksum: int  # of the stored bytes
    key: str
    codec: int = 0
    decoded_len: int = -1  # the payload's length once decoded (-1: payload_len)

    @property
    def plain_len(self) -> int:
        return self.payload_len if self.decoded_len < 0 else self.decoded_len


def encode_header(
    key: ObjectKey,
    layout: str,
    payload: Payload,
    align: int = HEADER_ALIGN,
    codec: int = 0,
    decoded_len: int = 0,
) -> bytes:
    """The header for ``payload`` (the stored bytes: encoded by ``codec``
    from ``decoded_len`` bytes, if not 0) stored under ``key`` (checksums the
    payload)."""
    key_bytes = key.to_str().encode("utf-8")
    coded = _CODED.pack(codec, decoded_len) if codec else b""
    used = _FIXED.size + len(coded) + len(key_bytes)
    header_len = -(-used // align) * align
    fixed = _FIXED.pack(
        MAGIC,
        CODED_VERSION if codec else VERSION,
        header_len,
        layout_bytes(layout),
        payload.nbytes,
        checksum(payload),
        len(key_bytes),
    )
    return fixed + coded + key_bytes + bytes(header_len - used)


def unpack_header(data: bytes | memoryview) -> Header:
    """Decode a header (whatever key and layout it names). ``data`` must hold
    at least the whole header (``MAX_HEADER_BYTES`` is always enough).
    Raises ``CorruptObject`` for one that is not a header."""
    view = memoryview(data)
    if len(view) < _FIXED.size:
        raise CorruptObject(Corruption.SHORT, f"{len(view)} bytes")
    magic, version, header_len, stored_layout, length, digest, key_len = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptObject(Corruption.MAGIC, repr(magic))
    if version not in (VERSION, CODED_VERSION):
        raise CorruptObject(Corruption.VERSION, str(version))
    start, codec, decoded = _FIXED.size, 0, -1
    if version == CODED_VERSION:
        if len(view) < start + _CODED.size:
            raise CorruptObject(Corruption.SHORT, f"{len(view)} bytes")
        codec, decoded = _CODED.unpack_from(view, start)
        if codec == 0:  # written for coded payloads only; "none" has no decoded length
            raise CorruptObject(Corruption.CODEC, "version 2 header without a codec")
        start += _CODED.size
    if header_len < start + key_len or len(view) < start + key_len:
        raise CorruptObject(Corruption.SHORT, "header shorter than its key")
    stored_key = bytes(view[start : start + key_len]).decode("utf-8", "replace")
    return Header(header_len, stored_layout, length, digest, stored_key, codec, decoded)


def parse_header(data: bytes | memoryview, key: ObjectKey, layout: str) -> Header:
    """Decode a header and check it against the key and layout the reader
    wants; ``CorruptObject`` names the first mismatch (see ``unpack_header``)."""
    header = unpack_header(data)
    if header.key != key.to_str():
        raise CorruptObject(Corruption.KEY, header.key)
    if header.layout != layout_bytes(layout):
        raise CorruptObject(Corruption.LAYOUT, header.layout.hex())
    return header


def verify_payload(header: Header, payload: Payload) -> None:
    """Check a payload already read into memory, for a reader that takes
    payloads as they are stored: its length and checksum, and that it was
    stored as it is (a coded copy, ``Corruption.CODEC``, is not the KV)."""
    if header.codec:
        raise CorruptObject(Corruption.CODEC, f"codec {header.codec} where none is read")
    verify_stored(header, payload)


def verify_stored(header: Header, payload: Payload) -> None:
    """Check length and checksum of the stored bytes (coded or not)."""
    size = payload.nbytes
    if size != header.payload_len:
        raise CorruptObject(Corruption.LENGTH, f"{size} != {header.payload_len}")
    if checksum(payload) != header.checksum:
        raise CorruptObject(Corruption.CHECKSUM)
