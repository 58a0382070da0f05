"""Chunk hashes: the identity of a prompt prefix, computed the same everywhere.

Specification (version 1; golden vectors in ``tests/unit/keys/test_hasher.py``,
prose in ``docs/hashing.md``)::

    root = blake3(b"kvtier-ns-v1\\x00" + canonical_json(namespace)).digest()
    h_i  = blake3(h_{i-1} + tokens[i*C:(i+1)*C] as little-endian uint32).digest()
    h_-1 = root

``canonical_json`` is ``Namespace.canonical_json()``: sorted keys, separators
``(",", ":")``, UTF-8, all six fields present. ``C`` is the chunk size in
tokens. Only full chunks get a chain hash. A prompt's trailing partial chunk
gets one only where a request's own KV is handed off whole (prefill to
decode, ``kvtier.server.handoff.table``)::

    tail = blake3(b"kvtier-tail-v1\x00" + h_{n-1} + tokens[n*C:] as little-endian uint32).digest()

with ``n`` the full chunks; the domain prefix keeps it apart from every chain
hash, so no lookup of full chunks can ever name a tail.
Digests are 32 bytes. Token ids are integers in ``[0, 2**32)``.

Because ``h_i`` folds in ``h_{i-1}``, a chunk's hash names the whole prefix up
to and including it: the same text after another system prompt, at another
position, or under another model or tenant has another hash.
Python's builtin ``hash()`` is salted per process and never used.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
from blake3 import blake3

from kvtier.keys.namespace import Namespace

HASH_BYTES = 32
if array.array("I").itemsize != 4:  # pragma: no cover - no such platform in use
    raise ImportError("kvtier needs a 4-byte C unsigned int for token encoding")
ROOT_DOMAIN = b"kvtier-ns-v1\x00"
TAIL_DOMAIN = b"kvtier-tail-v1\x00"
_TOKEN_LIMIT = 2**32

Tokens: TypeAlias = Sequence[int] | npt.NDArray[np.integer]
ChunkHash: TypeAlias = bytes


def root_hash(namespace: Namespace) -> ChunkHash:
    """The chain's parent for chunk 0, derived from the namespace alone."""
    return blake3(ROOT_DOMAIN + namespace.canonical_json()).digest()


def token_array(tokens: Tokens) -> npt.NDArray[np.uint32]:
    """Validate token ids and return them as a contiguous little-endian uint32 array.

    A uint32 array is returned as is (no copy). Anything that is not a
    one-dimensional sequence of integers in [0, 2**32) raises ValueError
    naming the first offending position.
    """
    if isinstance(tokens, list | tuple):
        return _from_sequence(tokens)
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    if arr.dtype.kind == "u" and arr.dtype.itemsize <= 4:
        return np.ascontiguousarray(arr, dtype="<u4")
    if arr.dtype.kind in "iu":
        bad = (arr < 0) | (arr >= _TOKEN_LIMIT)
        if bad.any():
            pos = int(np.argmax(bad))
            raise ValueError(
                f"token at position {pos} is {arr[pos]!r}: token ids must be in [0, 2**32)"
            )
        return np.ascontiguousarray(arr, dtype="<u4")
    raise _invalid_token(tokens)


def _from_sequence(tokens: Sequence[int]) -> npt.NDArray[np.uint32]:
    # array("I") converts a list of Python ints in C, checking the range as it
    # goes: about four times faster than np.asarray on a 32K-token list.
    try:
        packed = array.array("I", tokens)
    except (OverflowError, TypeError):
        raise _invalid_token(tokens) from None
    return np.frombuffer(packed, dtype="=u4").astype("<u4", copy=False)


def _invalid_token(tokens: Tokens) -> ValueError:
    # Only built on the error path, so a Python loop is fine here. An array
    # of a non-integer dtype is wrong from its first element on.
    pos = 0
    if not isinstance(tokens, np.ndarray):
        for pos, value in enumerate(tokens):  # noqa: B007 - pos is the answer
            if not isinstance(value, int) or not 0 <= value < _TOKEN_LIMIT:
                break
    value = tokens[pos]
    return ValueError(
        f"token at position {pos} is {value!r} ({type(value).__name__}): "
        "token ids must be integers in [0, 2**32)"
    )


def chain_hashes(parent: ChunkHash, tokens: npt.NDArray[np.uint32], chunk_size: int) -> list[bytes]:
    """Extend the chain from ``parent`` over every full chunk of ``tokens``."""
    data = memoryview(tokens.data).cast("B")
    step = chunk_size * 4
    hashes: list[bytes] = []
    for start in range(0, len(data) - step + 1, step):
        parent = blake3(parent).update(data[start : start + step]).digest()
        hashes.append(parent)
    return hashes


class TokenHasher:
    """Chunk hashes for one namespace and chunk size.

    ``chunk_hashes(tokens)`` hashes a whole prompt; ``stream()`` returns a
    ``ChunkHashStream`` for a request whose tokens arrive over time.
    """

    def __init__(self, namespace: Namespace, chunk_size: int = 256) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.namespace = namespace
        self.chunk_size = chunk_size
        self.root = root_hash(namespace)

    def chunk_hashes(self, tokens: Tokens) -> list[bytes]:
        """One 32-byte hash per full chunk of ``tokens``, in order."""
        return chain_hashes(self.root, token_array(tokens), self.chunk_size)

    def tail_hash(self, tokens: Tokens, chunk_hashes: Sequence[bytes]) -> bytes | None:
        """The hash of the trailing partial chunk of ``tokens`` (whose full
        chunks hash to ``chunk_hashes``), or None when there is none."""
        data = token_array(tokens)
        full = len(chunk_hashes) * self.chunk_size
        if len(data) // self.chunk_size != len(chunk_hashes):
            raise ValueError(
                f"{len(chunk_hashes)} chunk hashes for {len(data)} tokens in chunks of "
                f"{self.chunk_size}: pass the hashes of these tokens' full chunks"
            )
        if full == len(data):
            return None
        parent = chunk_hashes[-1] if chunk_hashes else self.root
        return blake3(TAIL_DOMAIN + parent).update(memoryview(data[full:].data).cast("B")).digest()

    def stream(self) -> ChunkHashStream:
        return ChunkHashStream(self)


class ChunkHashStream:
    """The incremental form: feed a growing request, get each chunk's hash once.

    Holds the last hash and the tokens of the unfinished chunk; ``hashes`` is
    the list of every full chunk's hash so far.
    """

    def __init__(self, hasher: TokenHasher) -> None:
        self._chunk_size = hasher.chunk_size
        self._parent = hasher.root
        self._pending: npt.NDArray[np.uint32] = np.empty(0, dtype="<u4")
        self.hashes: list[bytes] = []
        self.num_tokens = 0

    def extend(self, tokens: Tokens) -> list[bytes]:
        """Append ``tokens``; return the hashes of the chunks they completed."""
        new = token_array(tokens)
        self.num_tokens += len(new)
        data = np.concatenate((self._pending, new)) if len(self._pending) else new
        full = len(data) - len(data) % self._chunk_size
        added = chain_hashes(self._parent, data[:full], self._chunk_size)
        if added:
            self._parent = added[-1]
            self.hashes.extend(added)
        self._pending = data[full:].copy()
        return added
