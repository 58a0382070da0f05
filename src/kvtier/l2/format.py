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
_FIXED = struct.Struct(
    "<4sHH16sQQH"
)  # magic, version, header_len, layout, length, checksum, keylen
HEADER_ALIGN = 64
MAX_HEADER_BYTES = 4096


class Corruption(enum.Enum):
    """Why a stored copy was refused."""

    SHORT = "short"  # fewer bytes than a header, or than the header promises
    MAGIC = "magic"
    VERSION = "version"
    KEY = "key"
    LAYOUT = "layout"
    LENGTH = "length"
    CHECKSUM = "checksum"


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
    payload_len: int
    checksum: int
    key: str


def encode_header(
    key: ObjectKey,
    layout: str,
    payload: Payload,
    align: int = HEADER_ALIGN,
) -> bytes:
    """The header for ``payload`` stored under ``key`` (checksums the payload)."""
    key_bytes = key.to_str().encode("utf-8")
    used = _FIXED.size + len(key_bytes)
    header_len = -(-used // align) * align
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        header_len,
        layout_bytes(layout),
        payload.nbytes,
        checksum(payload),
        len(key_bytes),
    )
    return fixed + key_bytes + bytes(header_len - used)


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
    if version != VERSION:
        raise CorruptObject(Corruption.VERSION, str(version))
    if header_len < _FIXED.size + key_len or len(view) < _FIXED.size + key_len:
        raise CorruptObject(Corruption.SHORT, "header shorter than its key")
    stored_key = bytes(view[_FIXED.size : _FIXED.size + key_len]).decode("utf-8", "replace")
    return Header(header_len, stored_layout, length, digest, stored_key)


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
    """Check length and checksum of a payload already read into memory."""
    size = payload.nbytes
    if size != header.payload_len:
        raise CorruptObject(Corruption.LENGTH, f"{size} != {header.payload_len}")
    if checksum(payload) != header.checksum:
        raise CorruptObject(Corruption.CHECKSUM)


def encode_object(key: ObjectKey, layout: str, payload: Payload) -> bytes:
    """Header and payload in one ``bytes`` (for stores whose client wants one value)."""
    return encode_header(key, layout, payload) + payload.tobytes()


def decode_object(data: bytes | memoryview, key: ObjectKey, layout: str, out: Payload) -> None:
    """Check a whole stored value and copy its payload into ``out``."""
    header = parse_header(data, key, layout)
    view = memoryview(data)
    expected = header.header_len + header.payload_len
    if len(view) < expected:
        raise CorruptObject(Corruption.SHORT, f"{len(view)} of {expected} bytes stored")
    if len(view) > expected:
        raise CorruptObject(Corruption.LENGTH, f"{len(view)} bytes stored, {expected} expected")
    if out.nbytes != header.payload_len:
        raise CorruptObject(Corruption.LENGTH, f"reader expects {out.nbytes} bytes")
    payload = np.frombuffer(view, dtype=np.uint8, offset=header.header_len)
    verify_payload(header, payload)
    np.copyto(out, payload)
