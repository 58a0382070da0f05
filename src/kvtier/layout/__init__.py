"""``KVLayout``: the shape of one object group's KV, and the bytes it takes.

One descriptor per object group (full attention, a sliding-window size, an MLA
latent...). Per token and per rank, an object group stores::

    kind "kv":     2 x layers x kv_heads x head_dim x dtype_bytes   (K and V)
    kind "latent": 1 x layers x 1        x head_dim x dtype_bytes   (MLA latent)

(for example 32 layers, 8 KV heads, head dim 128, bf16 -> 128 KiB per token).
``kv_heads`` is per rank: with TP 4 and 8 KV heads each rank holds 2; when TP
exceeds the KV heads (or for MLA) every rank holds a replica. One
object is one chunk of one rank, so ``object_bytes() = bytes_per_token() x
tokens_per_chunk``. ``digest()`` is a stable blake3 of the canonical
description; it goes into the namespace, so any layout change is a miss, never
a misread.

An object's bytes are, by default, kvtier's canonical order
``[num_layers][K, V][kv_heads][tokens_per_chunk][head_dim]`` (C order), which
any engine can produce. An engine whose pages are packed in a way only it can
read (vLLM's CPU backend packs blocks per instruction set) stores its pages
as they are and names that with ``format`` (e.g. ``"vllm-cpu-vec-bs128"``):
the format is in the digest, so such objects are only ever read back by an
engine with the same format.

A sliding-window model's layers that attend only to the last ``W`` tokens
need, for a hit ending at a chunk's end, only that chunk's last blocks: of
``num_layers``, ``window_layers`` keep only the last ``window_tokens`` tokens
of each chunk (whole engine blocks), the rest every token. Such an object is
``[num_layers][kept blocks][page]`` in the engine's format, and
``object_bytes()`` counts what is kept.

``lossy_codec`` (``"int8"``, ``"int4"``; ``""`` for none) lets slower tiers
store the group's KV with that lossy codec (``kvtier.l2.codecs``); it is in
the digest, so KV that may come back lossy has keys of its own.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Literal

from blake3 import blake3

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

LayoutKind = Literal["kv", "latent"]
LOSSY_CODECS = ("int8", "int4")
_FLOAT_DTYPES = ("float32", "float16", "bfloat16")
_KIND_FACTOR: dict[str, int] = {"kv": 2, "latent": 1}


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV of one object group on one rank; see the module docstring."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_chunk: int
    kind: LayoutKind = "kv"
    num_ranks: int = 1
    format: str = ""  # "": the canonical byte order; else an engine's own page format
    lossy_codec: str = ""  # a lossy codec slower tiers may store this KV with
    window_layers: int = 0  # layers that keep only the last window_tokens of a chunk
    window_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "tokens_per_chunk", "num_ranks"):
            _positive(name, getattr(self, name))
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.kind not in _KIND_FACTOR:
            raise ValueError(f"KVLayout.kind must be 'kv' or 'latent', got {self.kind!r}")
        if self.kind == "latent" and self.kv_heads != 1:
            raise ValueError(
                "KVLayout.kv_heads must be 1 for kind 'latent' (MLA keeps one latent per "
                f"token per layer), got {self.kv_heads}"
            )
        if self.lossy_codec:
            self._check_lossy()
        if self.window_layers or self.window_tokens:
            self._check_window()

    def _check_window(self) -> None:
        if not 0 < self.window_layers <= self.num_layers:
            raise ValueError(
                f"KVLayout.window_layers must be in [1, num_layers {self.num_layers}] with "
                f"window_tokens, got {self.window_layers}"
            )
        if not 0 < self.window_tokens < self.tokens_per_chunk or not self.format:
            raise ValueError(
                "KVLayout.window_tokens must be in [1, tokens_per_chunk "
                f"{self.tokens_per_chunk}) with window_layers, in an engine's page format; "
                f"got {self.window_tokens}, format {self.format!r}"
            )

    def _check_lossy(self) -> None:
        if self.lossy_codec not in LOSSY_CODECS:
            raise ValueError(
                f"KVLayout.lossy_codec {self.lossy_codec!r} is not one of {list(LOSSY_CODECS)}"
            )
        if self.kind != "kv" or self.format or self.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                "KVLayout.lossy_codec needs the canonical byte order (no format) of a 'kv' "
                f"group in one of {list(_FLOAT_DTYPES)}; this one is {self.kind!r}, "
                f"{self.dtype!r}, format {self.format!r}"
            )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def bytes_per_token(self) -> int:
        """Bytes one token takes in this group on one rank (every layer's)."""
        return (
            _KIND_FACTOR[self.kind]
            * self.num_layers
            * self.kv_heads
            * self.head_dim
            * self.dtype_bytes
        )

    def object_bytes(self) -> int:
        """Bytes of one object: one chunk of one rank (a window layer's kept tokens only)."""
        tokens = self.num_layers * self.tokens_per_chunk
        tokens -= self.window_layers * (self.tokens_per_chunk - self.window_tokens)
        return self.bytes_per_token() // self.num_layers * tokens

    def chunk_bytes(self) -> int:
        """Bytes of one chunk over all ranks (replicas included)."""
        return self.object_bytes() * self.num_ranks

    def canonical_json(self) -> bytes:
        fields = dataclasses.asdict(self)
        for name in ("format", "lossy_codec", "window_layers", "window_tokens"):
            if not fields[name]:
                del fields[name]  # layouts without them keep the digests they always had
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")

    def digest(self) -> str:
        """A stable 32-hex-digit id of this layout, for the namespace."""
        return blake3(b"kvtier-layout-v1\x00" + self.canonical_json()).hexdigest(length=16)


def windowed(layout: KVLayout, window_layers: int, window_tokens: int) -> KVLayout:
    """``layout`` whose ``window_layers`` keep the last ``window_tokens`` of
    each chunk: unchanged when that is the whole chunk."""
    if not 0 < window_layers <= layout.num_layers or window_tokens <= 0:
        raise ValueError(
            f"KVLayout window: window_layers must be in [1, num_layers {layout.num_layers}] "
            f"and window_tokens positive, got {window_layers} and {window_tokens}"
        )
    if window_tokens >= layout.tokens_per_chunk:
        return layout
    return dataclasses.replace(layout, window_layers=window_layers, window_tokens=window_tokens)


__all__ = ["DTYPE_BYTES", "LOSSY_CODECS", "KVLayout", "LayoutKind", "windowed"]
