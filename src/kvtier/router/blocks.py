"""``BlockIndex``: the prefix blocks each engine holds itself (vLLM's prefix cache).

vLLM's own KV events (``--kv-events-config``) name blocks by vLLM's hashes,
which a router cannot compute (their seed is per deployment), but each
``BlockStored`` carries the blocks' token ids and its parent's hash. So the
index names every block by a *router key* of its own, chained over tokens
like vLLM's::

    key_0 = xxh3_128(b"kvtier-route-v1" + salt + LE32 tokens of block 0)
    key_i = xxh3_128(key_{i-1} + LE32 tokens of block i)

``salt`` is the request's ``cache_salt`` (vLLM folds it into the first
block's hash and publishes it in that block's ``extra_keys``). Blocks with
other extra keys (LoRA, multimodal inputs) are skipped: this router sends
neither. A block whose parent the index never saw cannot be keyed and is
skipped too (a miss, never a false claim). Per engine, vLLM hash -> key, so
``BlockRemoved`` and ``AllBlocksCleared`` take exactly what they name.

Thread safety: one lock; event threads apply, request handlers read.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from kvtier.events.wire import AllBlocksCleared, BlockHash, BlockRemoved, DecodedBatch

ROOT = b"kvtier-route-v1"


def block_keys(
    tokens: npt.NDArray[np.uint32], block_size: int, salt: str, parent: bytes | None = None
) -> list[bytes]:
    """Router keys of the full blocks of ``tokens``, chained from ``parent``
    (None: the prompt's first block, keyed with ``salt``)."""
    data = tokens.astype("<u4", copy=False).tobytes()
    step = block_size * 4
    keys = []
    previous = ROOT + salt.encode() if parent is None else parent
    for start in range(0, len(data) - step + 1, step):
        previous = _chain(previous, data[start : start + step])
        keys.append(previous)
    return keys


class BlockIndex:
    """See the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[bytes, int] = {}  # router key -> node mask
        self._keys: dict[int, dict[BlockHash, bytes]] = {}  # node -> vLLM hash -> router key
        self.block_size: dict[int, int] = {}  # node -> its engine's block size
        self.skipped = 0  # blocks that could not be keyed

    def apply(self, node: int, batch: DecodedBatch) -> None:
        """One batch of an engine's own events (medium GPU or CPU)."""
        with self._lock:
            keys = self._keys.setdefault(node, {})
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    for key in keys.values():
                        self._drop(key, node)
                    keys.clear()
                elif isinstance(event, BlockRemoved):
                    for block in event.block_hashes:
                        if block in keys:
                            self._drop(keys.pop(block), node)
                else:
                    self._stored(node, keys, event)

    def prefix_tokens(self, tokens: npt.NDArray[np.uint32], salt: str) -> dict[int, int]:
        """node -> how many tokens of ``tokens`` it holds as a prefix (whole blocks).
        Keys are computed only while some engine still holds the prefix."""
        out: dict[int, int] = {}
        for size in set(self.block_size.values()):
            data = tokens.astype("<u4", copy=False).tobytes()
            step = size * 4
            previous = ROOT + salt.encode()
            alive: int | None = None
            count = 0
            with self._lock:
                for start in range(0, len(data) - step + 1, step):
                    previous = _chain(previous, data[start : start + step])
                    mask = self._holders.get(previous, 0)
                    if alive is not None:
                        mask &= alive
                        for node in _bits(alive & ~mask):
                            out[node] = count * size
                    alive = mask
                    if not mask:
                        break
                    count += 1
                else:
                    for node in _bits(alive or 0):
                        out[node] = count * size
        return out

    def __len__(self) -> int:
        return len(self._holders)

    def status(self) -> dict[str, object]:
        with self._lock:
            return {"blocks": len(self._holders), "skipped_blocks": self.skipped}

    # ------------------------------------------------------------ internals

    def _stored(self, node: int, keys: dict[BlockHash, bytes], event: Any) -> None:
        size = event.block_size
        hashes = event.block_hashes
        if size <= 0 or len(event.token_ids) != size * len(hashes):
            self.skipped += len(hashes)
            return
        self.block_size[node] = size
        extra = event.extra_keys or [None] * len(hashes)
        if event.parent_block_hash is None:
            parent = None
            salt = _salt(extra[0])
            if salt is None:
                self.skipped += len(hashes)
                return
        else:
            parent = keys.get(event.parent_block_hash)
            salt = ""
            if parent is None:
                self.skipped += len(hashes)
                return
        if any(e for e in extra[1:]) or (parent is not None and extra[0]):
            self.skipped += len(hashes)  # LoRA or multimodal: not this router's requests
            return
        tokens = np.asarray(event.token_ids, dtype=np.uint32)
        for block, key in zip(hashes, block_keys(tokens, size, salt, parent), strict=True):
            keys[block] = key
            self._holders[key] = self._holders.get(key, 0) | (1 << node)

    def _drop(self, key: bytes, node: int) -> None:
        mask = self._holders.get(key, 0) & ~(1 << node)
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)


def _chain(parent: bytes, block: bytes) -> bytes:
    return xxhash.xxh3_128_digest(parent + block)


def _salt(extra: object) -> str | None:
    """The cache salt of a first block's extra keys ("" without one), or None
    when they hold anything else."""
    if not extra:
        return ""
    if isinstance(extra, list | tuple) and len(extra) == 1 and isinstance(extra[0], str):
        return extra[0]
    return None


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


__all__ = ["BlockIndex", "block_keys"]
