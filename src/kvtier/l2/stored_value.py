"""A stored object as one value, header and payload together, for the stores
whose client writes and reads one value per object (Redis, S3, the in-memory
mock): ``encode_object`` frames a payload (coded by the adapter's codec, if it
has one) and ``decode_object`` checks a whole value and writes its payload out.
The header itself is ``kvtier.l2.format``'s."""

from __future__ import annotations

import numpy as np

from kvtier.keys import ObjectKey
from kvtier.l2.format import (
    Corruption,
    CorruptObject,
    Payload,
    encode_header,
    parse_header,
    verify_payload,
    verify_stored,
)
from kvtier.l2.payload_codec import PayloadCodec
from kvtier.l2.seal import Sealer


def encode_object(
    key: ObjectKey,
    layout: str,
    payload: Payload,
    codec: PayloadCodec | None = None,
    seal: Sealer | None = None,
) -> bytes:
    """Header and stored payload in one value (for stores whose client wants
    one value); ``codec`` encodes the payload, if given; ``seal`` tags it."""
    ident, stored = (0, payload) if codec is None else codec.encode(layout, payload)
    header = encode_header(key, layout, stored, codec=ident, decoded_len=payload.nbytes, seal=seal)
    return b"".join((header, stored.data))


def decode_object(
    data: bytes | memoryview,
    key: ObjectKey,
    layout: str,
    out: Payload,
    codec: PayloadCodec | None = None,
    seal: Sealer | None = None,
) -> None:
    """Check a whole stored value (its tag, with ``seal``) and write its
    payload into ``out`` (decoded by ``codec`` when it was stored with one)."""
    header = parse_header(data, key, layout)
    view = memoryview(data)
    expected = header.header_len + header.payload_len
    if len(view) < expected:
        raise CorruptObject(Corruption.SHORT, f"{len(view)} of {expected} bytes stored")
    if len(view) > expected:
        raise CorruptObject(Corruption.LENGTH, f"{len(view)} bytes stored, {expected} expected")
    if out.nbytes != header.plain_len:
        raise CorruptObject(Corruption.LENGTH, f"reader expects {out.nbytes} bytes")
    payload = np.frombuffer(view, dtype=np.uint8, offset=header.header_len)
    if codec is None or header.codec == 0:
        verify_payload(header, payload, seal)
        np.copyto(out, payload)
    else:
        verify_stored(header, payload, seal)
        codec.decode(header.codec, layout, payload, out)
