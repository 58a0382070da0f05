"""The stored-object format shared by every L2 adapter.

Each object is a header followed by the payload (the chunk's KV bytes)::

    offset  size  field
    0       4     magic b"KVTO"
    4       2     format version (1)
    6       2     header length in bytes (fixed part + key + the 49
                  bytes a sealed header adds, padded to 64; to 4096 for
                  O_DIRECT), i.e. where the payload starts: the same for
                  every version, so a reader may split header from payload
                  before parsing
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

A sealed object (a cluster secret is set, ``kvtier.l2.seal``) has a version 3
header, the fields of version 2 (codec 0: stored as it is) and its tag before
the key::

    51      8     the sealing key's id
    59      32    the tag: keyed BLAKE3 of the header, this field zeroed, and
                  the stored payload
    91      n     the key ...

A reader with the secret refuses anything but a sealed object whose tag
verifies (``Corruption.MAC``); one without reads a sealed object on its
checksum.
All integers are little-endian. A load whose magic, version, key, layout,
length or checksum does not match what the reader asked for is a miss, and
the adapter deletes or quarantines that copy: stale metadata can cost a miss,
never wrong KV (ARCHITECTURE §1).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import xxhash

from kvtier.keys import ObjectKey

if TYPE_CHECKING:
    from kvtier.l2.seal import Sealer

MAGIC = b"KVTO"
VERSION = 1
CODED_VERSION = 2
SEALED_VERSION = 3
_FIXED = struct.Struct(
    "<4sHH16sQQH"
)  # magic, version, header_len, layout, length, checksum, keylen
_CODED = struct.Struct("<BQ")  # version 2: codec, decoded length
_SEALED = struct.Struct("<BQ8s32s")  # version 3: codec, decoded length, key id, tag
_TAG_AT = _FIXED.size + 1 + 8 + 8  # where a sealed header's tag starts
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
    MAC = "mac"  # unsealed, sealed under an unknown key, or a tag that does not verify


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
    key_id: bytes = b""  # sealed: the sealing key's id
    tag: bytes = b""  # sealed: the tag ("" unsealed)
    signed: bytes = b""  # sealed: the header as tagged (its tag zeroed)

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
    seal: Sealer | None = None,
) -> bytes:
    """The header for ``payload`` (the stored bytes: encoded by ``codec``
    from ``decoded_len`` bytes, if not 0) stored under ``key`` (checksums the
    payload; with ``seal``, tags header and payload)."""
    key_bytes = key.to_str().encode("utf-8")
    header_len = header_length(key, align)
    if seal is not None:
        version, extra = SEALED_VERSION, _SEALED.pack(codec, decoded_len, seal.key_id, b"")
    elif codec:
        version, extra = CODED_VERSION, _CODED.pack(codec, decoded_len)
    else:
        version, extra = VERSION, b""
    fixed = _FIXED.pack(
        MAGIC,
        version,
        header_len,
        layout_bytes(layout),
        payload.nbytes,
        checksum(payload),
        len(key_bytes),
    )
    header = fixed + extra + key_bytes
    header += bytes(header_len - len(header))
    if seal is None:
        return header
    tag = seal.tag(header, payload)
    return header[:_TAG_AT] + tag + header[_TAG_AT + len(tag) :]


def header_length(key: ObjectKey, align: int = HEADER_ALIGN) -> int:
    """The bytes of ``key``'s header, padded to ``align``. Every version
    leaves room for the sealed fields, so a header is as long sealed or not
    and coded or not: a reader that splits header from payload before it
    parses either (Mooncake) reads both kinds."""
    used = _FIXED.size + _SEALED.size + len(key.to_str().encode("utf-8"))
    return -(-used // align) * align


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
    if version not in (VERSION, CODED_VERSION, SEALED_VERSION):
        raise CorruptObject(Corruption.VERSION, str(version))
    start, codec, decoded = _FIXED.size, 0, -1
    key_id = tag = signed = b""
    if version == CODED_VERSION:
        if len(view) < start + _CODED.size:
            raise CorruptObject(Corruption.SHORT, f"{len(view)} bytes")
        codec, decoded = _CODED.unpack_from(view, start)
        if codec == 0:  # written for coded payloads only; "none" has no decoded length
            raise CorruptObject(Corruption.CODEC, "version 2 header without a codec")
        start += _CODED.size
    elif version == SEALED_VERSION:
        if len(view) < max(start + _SEALED.size, header_len):
            raise CorruptObject(Corruption.SHORT, f"{len(view)} bytes")
        codec, decoded, key_id, tag = _SEALED.unpack_from(view, start)
        decoded = decoded if codec else -1
        zeroed = bytearray(view[:header_len])
        zeroed[_TAG_AT : _TAG_AT + len(tag)] = bytes(len(tag))
        signed = bytes(zeroed)
        start += _SEALED.size
    if header_len < start + key_len or len(view) < start + key_len:
        raise CorruptObject(Corruption.SHORT, "header shorter than its key")
    stored_key = bytes(view[start : start + key_len]).decode("utf-8", "replace")
    return Header(
        header_len, stored_layout, length, digest, stored_key, codec, decoded, key_id, tag, signed
    )


def parse_header(data: bytes | memoryview, key: ObjectKey, layout: str) -> Header:
    """Decode a header and check it against the key and layout the reader
    wants; ``CorruptObject`` names the first mismatch (see ``unpack_header``)."""
    header = unpack_header(data)
    if header.key != key.to_str():
        raise CorruptObject(Corruption.KEY, header.key)
    if header.layout != layout_bytes(layout):
        raise CorruptObject(Corruption.LAYOUT, header.layout.hex())
    return header


def verify_payload(header: Header, payload: Payload, seal: Sealer | None = None) -> None:
    """Check a payload already read into memory, for a reader that takes
    payloads as they are stored: its length and checksum (its tag, with
    ``seal``), and that it was stored as it is (a coded copy,
    ``Corruption.CODEC``, is not the KV)."""
    if header.codec:
        raise CorruptObject(Corruption.CODEC, f"codec {header.codec} where none is read")
    verify_stored(header, payload, seal)


def verify_stored(header: Header, payload: Payload, seal: Sealer | None = None) -> None:
    """Check the stored bytes (coded or not): their length, then their tag
    with ``seal`` (an unsealed object is refused), else their checksum."""
    size = payload.nbytes
    if size != header.payload_len:
        raise CorruptObject(Corruption.LENGTH, f"{size} != {header.payload_len}")
    if seal is not None:
        if not header.tag:
            raise CorruptObject(Corruption.MAC, "unsealed, and this reader has a secret")
        seal.verify(header.key_id, header.tag, header.signed, payload)
    elif checksum(payload) != header.checksum:
        raise CorruptObject(Corruption.CHECKSUM)
