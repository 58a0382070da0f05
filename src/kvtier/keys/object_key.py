"""``ObjectKey``: the name of one stored object, with one string form.

An object is the bytes of one chunk for one KV rank and one object group. Its
string form is the only one used by every tier, the RPC and the router::

    {model}@{salt}@r{kv_rank}g{group}@{chunk_hash as 64 lowercase hex digits}

``model`` and ``salt`` are restricted to ``[A-Za-z0-9._-]`` so the form is a
safe file name and remote key (no path separators, no NUL, no ``@``).
``model_label()`` turns a Hugging Face id such as ``org/name`` into
``org--name`` (the convention of the Hugging Face cache). The chunk hash
already covers the whole namespace; ``model`` and ``salt`` are in the key so
that a tier can list or drop one model's or one tenant's objects.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from blake3 import blake3

from kvtier.keys.hasher import HASH_BYTES

MAX_MODEL_CHARS = 128
MAX_SALT_CHARS = 64
MAX_RANK = 1 << 16
MAX_GROUP = 1 << 16
_SAFE = re.compile(r"[A-Za-z0-9._-]*")
_SEP = "@"
_HEX_DIGEST = re.compile(f"[0-9a-f]{{{2 * HASH_BYTES}}}")
_PLACEMENT = re.compile(r"r(\d{1,5})g(\d{1,5})")
_HASHED_SALT = re.compile(r"s-[0-9a-f]{32}")


def model_label(model: str) -> str:
    """A model name made safe for ``ObjectKey.model``: ``/`` becomes ``--``
    (the Hugging Face cache's convention); a name that is still too long or
    not key-safe (a local path with a space or a ``+``) becomes ``m-`` and 32
    hex digits of its blake3. A label is its own label (engines send labels,
    and the server labels what it is sent), so two labels may coincide: the
    label is for people and listings, the chunk hash covers the full name."""
    label = model.replace("/", "--")
    if 0 < len(label) <= MAX_MODEL_CHARS and _SAFE.fullmatch(label):
        return label
    return "m-" + blake3(model.encode()).hexdigest(length=16)


def salt_label(salt: str) -> str:
    """A tenant salt made safe for ``ObjectKey.salt``: kept when it already is
    safe, else ``s-`` and 32 hex digits of its blake3. A safe salt that has
    that very form is hashed too, so a kept salt never looks like a hashed
    one and distinct salts always get distinct labels (short of a blake3
    collision). Apply it once: a label is not a fixed point."""
    if len(salt) <= MAX_SALT_CHARS and _SAFE.fullmatch(salt) and not _HASHED_SALT.fullmatch(salt):
        return salt
    return "s-" + blake3(salt.encode()).hexdigest(length=16)


def is_salt_label(text: str) -> bool:
    """Whether ``text`` can be an ``ObjectKey.salt``: ``salt_label``'s
    answer for some salt (a kept safe salt, or ``s-`` and 32 hex digits)."""
    return len(text) <= MAX_SALT_CHARS and _SAFE.fullmatch(text) is not None


def given_salt_label(salt: str) -> str:
    """The label of a salt as an operator names it: a salt label (as
    listings show it) is kept, anything else is labelled (``salt_label``),
    so both the label and a tenants file's own spelling name one namespace.
    A salt that has itself the form ``s-`` and 32 hex digits is read as a
    label: name such a salt's namespace by its label or by its tenant."""
    return salt if is_salt_label(salt) else salt_label(salt)


def key_hash(chunk_hash: bytes, kv_rank: int, group: int) -> int:
    """``ObjectKey``'s hash (computed once per key; ``chunk_keys`` builds keys
    without ``__post_init__`` and uses this too)."""
    return hash(chunk_hash) ^ (kv_rank * 0x9E3779B1 + group)


def _check_label(field: str, value: object, limit: int, *, empty_ok: bool) -> None:
    if not isinstance(value, str):
        raise TypeError(f"ObjectKey.{field} must be a str, got {type(value).__name__}")
    if not value and not empty_ok:
        raise ValueError(f"ObjectKey.{field} must not be empty")
    if len(value) > limit:
        raise ValueError(f"ObjectKey.{field} is {len(value)} characters; the limit is {limit}")
    if _SAFE.fullmatch(value) is None:
        raise ValueError(
            f"ObjectKey.{field} {value!r} may only use letters, digits, '.', '_' and '-' "
            "(no path separators, NUL or '@'); for a model id use model_label()"
        )


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
        _check_label("model", self.model, MAX_MODEL_CHARS, empty_ok=False)
        _check_label("salt", self.salt, MAX_SALT_CHARS, empty_ok=True)
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
            f"{self.model}{_SEP}{self.salt}{_SEP}r{self.kv_rank}g{self.group}"
            f"{_SEP}{self.chunk_hash.hex()}"
        )

    @classmethod
    def from_str(cls, text: str) -> ObjectKey:
        """Parse ``to_str()``'s form; ValueError says which part is wrong."""
        parts = text.split(_SEP)
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
