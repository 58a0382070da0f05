"""``ObjectKey``: the name of one stored object, with one string form.

An object is the bytes of one chunk for one KV rank and one object group. Its
string form is the only one used by every tier, the RPC and the router::

    {model}@{salt}@r{kv_rank}g{group}@{chunk_hash as 64 lowercase hex digits}

``model`` and ``salt`` are restricted to ``[A-Za-z0-9._-]`` so the form is a
safe file name and remote key (no path separators, no NUL, no ``@``): they
are labels (``kvtier.keys.label``), and ``{model}@{salt}`` is the text form
of the key's ``NamespaceLabel``. The chunk hash already covers the whole
namespace; ``model`` and ``salt`` are in the key so that a tier can list or
drop one model's or one tenant's objects.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.keys.hasher import HASH_BYTES
from kvtier.keys.label import MAX_MODEL_CHARS, MAX_SALT_CHARS, SEP, check_label

MAX_RANK = 1 << 16
MAX_GROUP = 1 << 16
_HEX_DIGEST = re.compile(f"[0-9a-f]{{{2 * HASH_BYTES}}}")
_PLACEMENT = re.compile(r"r(\d{1,5})g(\d{1,5})")


def key_hash(chunk_hash: bytes, kv_rank: int, group: int) -> int:
    """``ObjectKey``'s hash (computed once per key; ``chunk_keys`` builds keys
    without ``__post_init__`` and uses this too)."""
    return hash(chunk_hash) ^ (kv_rank * 0x9E3779B1 + group)


def _check_index(field: str, value: object, limit: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ObjectKey.{field} must be an int, got {type(value).__name__}")
    if not 0 <= value < limit:
        raise ValueError(f"ObjectKey.{field} is {value}; it must be in [0, {limit})")


@dataclass(frozen=True, slots=True, eq=False)
class ObjectKey:
    """One chunk of one KV rank of one object group. Frozen, hashable, validated.

    ``__eq__`` and ``__hash__`` are written out, and the hash is computed
    once, because keys are hashed many times per tier operation: the
    generated methods build a 5-tuple on every call.
    """

    chunk_hash: bytes
    model: str
    kv_rank: int
    group: int = 0
    salt: str = ""
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_hash, bytes):
            raise TypeError(
                f"ObjectKey.chunk_hash must be bytes, got {type(self.chunk_hash).__name__}"
            )
        if len(self.chunk_hash) != HASH_BYTES:
            raise ValueError(
                f"ObjectKey.chunk_hash is {len(self.chunk_hash)} bytes; "
                f"it must be a {HASH_BYTES}-byte chunk hash"
            )
        check_label("ObjectKey.model", self.model, MAX_MODEL_CHARS, empty_ok=False)
        check_label("ObjectKey.salt", self.salt, MAX_SALT_CHARS, empty_ok=True)
        _check_index("kv_rank", self.kv_rank, MAX_RANK)
        _check_index("group", self.group, MAX_GROUP)
        object.__setattr__(self, "_hash", key_hash(self.chunk_hash, self.kv_rank, self.group))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ObjectKey):
            return NotImplemented
        return (
            self.chunk_hash == other.chunk_hash
            and self.kv_rank == other.kv_rank
            and self.group == other.group
            and self.model == other.model
            and self.salt == other.salt
        )

    def __hash__(self) -> int:
        return self._hash

    def to_str(self) -> str:
        """The one string form (see the module docstring)."""
        return (
            f"{self.model}{SEP}{self.salt}{SEP}r{self.kv_rank}g{self.group}"
            f"{SEP}{self.chunk_hash.hex()}"
        )

    @classmethod
    def from_str(cls, text: str) -> ObjectKey:
        """Parse ``to_str()``'s form; ValueError says which part is wrong."""
        parts = text.split(SEP)
        if len(parts) != 4:
            raise ValueError(f"object key {text!r} must have 4 '@'-separated parts")
        model, salt, placement, digest = parts
        match = _PLACEMENT.fullmatch(placement)
        if match is None:
            raise ValueError(f"object key {text!r}: third part must look like 'r0g0'")
        if _HEX_DIGEST.fullmatch(digest) is None:
            raise ValueError(
                f"object key {text!r}: last part must be {2 * HASH_BYTES} lowercase hex digits"
            )
        key = cls(bytes.fromhex(digest), model, int(match[1]), int(match[2]), salt)
        if key.to_str() != text:
            raise ValueError(f"object key {text!r} is not in canonical form (leading zeros?)")
        return key


def chunk_keys(
    hashes: Sequence[bytes], model: str, ranks: int, group: int = 0, salt: str = ""
) -> list[list[ObjectKey]]:
    """Keys for every rank of every chunk: ``[[chunk 0 rank 0, rank 1, ...], ...]``.

    ``model``, ``salt``, ``ranks`` and ``group`` are validated once, each hash
    for its length; the keys are then built without re-checking the labels
    (a lookup of 128 chunks builds hundreds of keys on the request path).
    """
    template = ObjectKey(bytes(HASH_BYTES), model, max(ranks - 1, 0), group, salt)
    out = []
    for chunk_hash in hashes:
        if not isinstance(chunk_hash, bytes) or len(chunk_hash) != HASH_BYTES:
            ObjectKey(chunk_hash, model, 0, group, salt)  # raises the precise error
        row = []
        for rank in range(ranks):
            key = object.__new__(ObjectKey)
            for name, value in (
                ("chunk_hash", chunk_hash),
                ("model", template.model),
                ("kv_rank", rank),
                ("group", group),
                ("salt", template.salt),
                ("_hash", key_hash(chunk_hash, rank, group)),
            ):
                object.__setattr__(key, name, value)
            row.append(key)
        out.append(row)
    return out
