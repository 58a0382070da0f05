"""Objects a shared store cannot forge: a keyed MAC on every stored object.

An object's checksum (``format.py``) is keyless: whoever can write to a
shared Redis or bucket, and knows or guesses a key, can plant a well-formed
object, and it would be served as that prefix's KV to every tenant that
shares the store. With a cluster secret (``kvtier serve
--cluster-secret-file``, or ``KVTIER_CLUSTER_SECRET``), every object an L2
adapter writes is *sealed*: its header carries a tag, keyed BLAKE3 over the
header (the tag zeroed) and the stored payload, under a key derived from the
secret. A reader with the secret takes an object only if its tag verifies
under one of its keys; anything else (a forged object, one tampered with and
given a valid checksum, an unsealed one) is refused as ``Corruption.MAC``:
counted as corrupt, a miss, removed. Without the secret, a writer can cost
misses, never plant KV. The tag covers the checksum, the key, the layout and
the lengths, so a reader that verified it skips the checksum.

Rotation: the secret holds one or two secrets, one a line. The first seals;
either verifies. Each is named in the header by an 8-byte id derived from
it (never the key). Roll a new secret in as the second line everywhere,
then make it the first, then drop the old one.

Without a secret, objects are written unsealed and sealed ones are read on
their checksum alone, as before the secret existed; ``kvtier serve`` says at
start which it is.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import blake3

from kvtier.l2.format import Corruption, CorruptObject, Payload

MIN_SECRET_CHARS = 32
MAX_SECRETS = 2  # the current one, and the previous one during a rotation
TAG_BYTES = 32
KEY_ID_BYTES = 8
_KEY_CONTEXT = "kvtier 2026-12-06 L2 object MAC key"
_ID_CONTEXT = "kvtier 2026-12-06 L2 object MAC key id"
_THREADED_BYTES = 8 << 20  # payloads from this size are hashed on every core


def parse_secrets(text: str, where: str) -> tuple[bytes, ...]:
    """The secrets in a secret file's text (one a line, one or two), checked;
    ``ValueError`` naming ``where`` (the setting) for an empty, short or
    malformed one."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    advice = f"at least {MIN_SECRET_CHARS} printable characters each (e.g. openssl rand -hex 32)"
    if not lines:
        raise ValueError(f"{where} is empty: give one secret a line, {advice}")
    if len(lines) > MAX_SECRETS:
        raise ValueError(
            f"{where} holds {len(lines)} secrets: at most {MAX_SECRETS} (the current one first, "
            "then the one being rotated out)"
        )
    for number, line in enumerate(lines, 1):
        if not (line.isascii() and line.isprintable()) or any(c.isspace() for c in line):
            raise ValueError(f"{where}: secret {number} is malformed: {advice}, no spaces")
        if len(line) < MIN_SECRET_CHARS:
            raise ValueError(f"{where}: secret {number} is {len(line)} characters: {advice}")
    return tuple(line.encode("ascii") for line in lines)


class Sealer:
    """Seals with the first secret's key, verifies with any. Thread-safe."""

    def __init__(self, secrets: Sequence[bytes]) -> None:
        if not 1 <= len(secrets) <= MAX_SECRETS:
            raise ValueError(f"a sealer takes 1 to {MAX_SECRETS} secrets, got {len(secrets)}")
        self._keys: dict[bytes, bytes] = {}  # key id -> MAC key
        for secret in secrets:
            key = blake3.blake3(secret, derive_key_context=_KEY_CONTEXT).digest()
            ident = blake3.blake3(secret, derive_key_context=_ID_CONTEXT).digest(KEY_ID_BYTES)
            self._keys.setdefault(ident, key)
        self.key_id = next(iter(self._keys))  # the id objects are sealed under

    @property
    def key_ids(self) -> list[str]:
        """Every accepted key's id, hex (the sealing one first)."""
        return [ident.hex() for ident in self._keys]

    def tag(self, header: bytes | memoryview, payload: Payload) -> bytes:
        """The tag of a header (its tag field zeroed) and stored payload."""
        return _mac(self._keys[self.key_id], header, payload)

    def verify(
        self, key_id: bytes, tag: bytes, header: bytes | memoryview, payload: Payload
    ) -> None:
        """Raise ``CorruptObject(Corruption.MAC)`` unless ``tag`` is the tag of
        ``header`` (its tag field zeroed) and ``payload`` under the key
        ``key_id`` names."""
        key = self._keys.get(key_id)
        if key is None:
            raise CorruptObject(Corruption.MAC, f"sealed under unknown key {key_id.hex()}")
        if not hmac.compare_digest(_mac(key, header, payload), tag):
            raise CorruptObject(Corruption.MAC, "tag does not verify")


def _mac(key: bytes, header: bytes | memoryview, payload: Payload) -> bytes:
    threads = blake3.blake3.AUTO if payload.nbytes >= _THREADED_BYTES else 1
    hasher = blake3.blake3(key=key, max_threads=threads)
    hasher.update(header)
    hasher.update(payload.data)
    return hasher.digest(TAG_BYTES)


__all__ = ["KEY_ID_BYTES", "MIN_SECRET_CHARS", "TAG_BYTES", "Sealer", "parse_secrets"]
