"""Payload codecs for L2: what an object's payload is stored as.

A codec turns a chunk's KV bytes (``KVLayout``'s canonical order, or an
engine's own page format for the lossless one) into the bytes a tier stores,
and back. It is chosen per adapter (``AdapterConfig.codec``) and named in each
object's header (``kvtier.l2.format``), so any reader decodes what any writer
stored, and a copy whose codec this node cannot decode is a miss:

- ``none`` (0): the bytes as they are.
- ``zstd`` (1), lossless: the elements' bytes split into planes (every
  element's first byte, then every second byte...), so that the slowly varying
  sign-and-exponent bytes of floats sit together, then zstd. Bit-exact; any
  layout.
- ``int8`` (2) and ``int4`` (3), lossy, for canonical ``kv`` layouts of a float
  dtype: keys quantized per channel (one scale and offset per layer, head and
  channel, over the chunk's tokens: key outliers live in channels), values per
  token (over the channels); ``int4`` in groups of 32 along the same axes.
  Scales and offsets are float16. A chunk they cannot describe (KV beyond
  float16's range, a group's lowest value among it, or codes that would
  decode past its dtype's largest finite value) is stored with ``none``,
  exact; a reader refuses a copy whose scales
  decode to anything but finite values of its dtype (such as one written from
  such KV before this rule).

A lossy codec is used only for objects whose layout asks for it
(``KVLayout.lossy_codec``): that field is in the layout digest, hence in the
namespace and the chunk hashes, so lossy KV lives under keys of its own and
is never taken for exact KV. Elsewhere an adapter configured with a lossy
codec stores ``none``.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvtier.l2.format import Corruption, CorruptObject, Payload
from kvtier.layout import LOSSY_CODECS, KVLayout

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]


class Codec(ABC):
    name: ClassVar[str]
    ident: ClassVar[int]  # the header's codec field
    lossy: ClassVar[bool] = False

    def applies(self, layout: KVLayout | None) -> bool:
        """Whether objects of ``layout`` (None: unknown here) may be stored with this codec."""
        return True

    @abstractmethod
    def encode(self, payload: Payload, layout: KVLayout | None) -> Payload | None:
        """The stored bytes of ``payload``; None when this codec cannot code
        it (it is then stored as it is)."""

    @abstractmethod
    def decode(self, stored: Payload, layout: KVLayout | None, out: Payload) -> None:
        """Write the payload ``stored`` encodes into ``out``; ``CorruptObject``
        (``Corruption.CODEC``) when ``stored`` cannot be that."""


class Plain(Codec):
    name, ident = "none", 0

    def encode(self, payload: Payload, layout: KVLayout | None) -> Payload:
        return payload

    def decode(self, stored: Payload, layout: KVLayout | None, out: Payload) -> None:
        if stored.nbytes != out.nbytes:
            raise CorruptObject(Corruption.LENGTH, f"{stored.nbytes} != {out.nbytes}")
        np.copyto(out, stored)


class Zstd(Codec):
    """Byte planes, then zstd (the ``zstandard`` package: ``pip install kvtier[codecs]``)."""

    name, ident = "zstd", 1
    LEVEL = 1  # faster levels gain little on float planes; see BENCHMARKS.md

    def __init__(self) -> None:
        self._local = threading.local()  # zstandard's (de)compressors are per thread

    def encode(self, payload: Payload, layout: KVLayout | None) -> Payload:
        """One byte, the plane count (the element width: the reader may not
        know the layout), then the zstd frame."""
        width = _width(layout, payload.nbytes)
        planes = _split(payload, width) if width > 1 else payload
        packed = self._tools()[0].compress(planes.data)
        return np.frombuffer(bytes([width]) + packed, dtype=np.uint8)

    def decode(self, stored: Payload, layout: KVLayout | None, out: Payload) -> None:
        width = int(stored[0]) if stored.nbytes else 0
        if width not in (1, *_WORDS) or out.nbytes % width:
            raise CorruptObject(Corruption.CODEC, f"zstd: {width} byte planes")
        frame = stored[1:].data
        declared = self._declared_size(frame)
        if declared != out.nbytes:
            # The frame's own size is what the decompressor allocates and fills,
            # whatever limit it is given: a frame that declares more than the
            # object is refused before any of it is decompressed. (Frames
            # that declare no size are refused too: the writer always declares.)
            what = "no size" if declared is None else f"{declared} bytes"
            raise CorruptObject(Corruption.CODEC, f"zstd frame declares {what} for {out.nbytes}")
        try:  # gives the declared size, or raises
            raw = self._tools()[1].decompress(frame, allow_extra_data=False)
        except Exception as exc:  # zstandard.ZstdError: not a zstd frame, truncated
            raise CorruptObject(Corruption.CODEC, f"zstd: {exc}") from None
        planes = np.frombuffer(raw, dtype=np.uint8)
        if width > 1:
            _join(planes, width, out)
        else:
            np.copyto(out, planes)

    @staticmethod
    def _declared_size(frame: memoryview) -> int | None:
        """The decompressed size a zstd frame's header declares (None: none declared)."""
        zstd = _zstandard()
        try:
            size = int(zstd.get_frame_parameters(frame).content_size)
        except Exception as exc:  # zstandard.ZstdError: not a zstd frame header
            raise CorruptObject(Corruption.CODEC, f"zstd: {exc}") from None
        return None if size == zstd.CONTENTSIZE_UNKNOWN else size

    def _tools(self) -> tuple[Any, Any]:
        tools = getattr(self._local, "tools", None)
        if tools is None:
            zstd = _zstandard()
            tools = self._local.tools = (
                zstd.ZstdCompressor(level=self.LEVEL),
                zstd.ZstdDecompressor(),
            )
        return tools


class Quantized(Codec):
    """``int8``/``int4``: see the module docstring. Stored, in order: key
    codes, value codes (both ``[layers][heads][tokens][channels]``, two 4-bit
    codes per byte for int4), then the float16 scales and offsets of keys
    (``[layers][heads][token groups][channels]``) and of values
    (``[layers][heads][tokens][channel groups]``). A group decodes to
    ``offset + code * scale``."""

    lossy = True
    bits: ClassVar[int]
    group: ClassVar[int | None]  # elements per scale along the axis (None: the whole axis)

    def applies(self, layout: KVLayout | None) -> bool:
        return layout is not None and layout.lossy_codec == self.name

    def encode(self, payload: Payload, layout: KVLayout | None) -> Payload | None:
        """The codes and scales; None for KV that float16 scales and offsets
        cannot describe (a group whose lowest value is past float16's largest,
        or whose codes would decode beyond its dtype: ``_decodes_finite``)."""
        layout = self._check(layout, payload.nbytes)
        k, v = _planes(payload, layout)
        keys = self._quantize(k, self._grouped(layout, 2), 3, layout.dtype)
        values = self._quantize(v, self._grouped(layout, 3), 4, layout.dtype)
        if keys is None or values is None:
            return None
        (ck, sk, ok), (cv, sv, ov) = keys, values
        parts = [ck, cv] + [a.view(np.uint8).reshape(-1) for a in (sk, ok, sv, ov)]
        return np.concatenate(parts)

    def decode(self, stored: Payload, layout: KVLayout | None, out: Payload) -> None:
        layout = self._check(layout, out.nbytes)
        gk, gv = self._grouped(layout, 2), self._grouped(layout, 3)
        codes = self._code_bytes(layout)
        scales_k, scales_v = 2 * self._scale_count(gk, 3), 2 * self._scale_count(gv, 4)
        sizes = [codes, codes, scales_k, scales_k, scales_v, scales_v]
        if stored.nbytes != sum(sizes):
            raise CorruptObject(Corruption.CODEC, f"{self.name}: {stored.nbytes} != {sum(sizes)}")
        ck, cv, sk, ok, sv, ov = np.split(stored, np.cumsum(sizes)[:-1])
        top = (1 << self.bits) - 1
        halves = [(s.view(np.float16), o.view(np.float16)) for s, o in ((sk, ok), (sv, ov))]
        if not all(_decodes_finite(s, o, top, layout.dtype) for s, o in halves):
            raise CorruptObject(Corruption.CODEC, f"{self.name}: scales beyond {layout.dtype}")
        target = _float_view(out, layout).reshape(
            layout.num_layers, 2, layout.kv_heads, layout.tokens_per_chunk, layout.head_dim
        )
        shape = target[:, 0].shape
        k = self._dequantize(ck, sk, ok, gk, 3).reshape(shape)
        v = self._dequantize(cv, sv, ov, gv, 4).reshape(shape)
        _store_floats(target[:, 0], k, layout.dtype)
        _store_floats(target[:, 1], v, layout.dtype)

    # ------------------------------------------------------------ internals

    def _check(self, layout: KVLayout | None, nbytes: int) -> KVLayout:
        if layout is None or not self.applies(layout):
            raise CorruptObject(Corruption.CODEC, f"{self.name} copy for a layout not asking it")
        if layout.object_bytes() != nbytes:
            raise CorruptObject(Corruption.LENGTH, f"{nbytes} != {layout.object_bytes()}")
        return layout

    def _grouped(self, layout: KVLayout, axis: int) -> tuple[int, ...]:
        """``[layers][heads][tokens][channels]`` with ``axis`` (2: tokens,
        3: channels) split into (groups, group size)."""
        shape = [layout.num_layers, layout.kv_heads, layout.tokens_per_chunk, layout.head_dim]
        size = shape[axis]
        group = size if self.group is None or size % self.group else self.group
        return (*shape[:axis], size // group, group, *shape[axis + 1 :])

    @staticmethod
    def _scale_count(grouped: tuple[int, ...], axis: int) -> int:
        return int(np.prod(grouped)) // grouped[axis]

    def _code_bytes(self, layout: KVLayout) -> int:
        count = layout.num_layers * layout.kv_heads * layout.tokens_per_chunk * layout.head_dim
        return count * self.bits // 8

    def _quantize(
        self, x: F32, grouped: tuple[int, ...], axis: int, dtype: str
    ) -> tuple[Payload, npt.NDArray[np.float16], npt.NDArray[np.float16]] | None:
        """Codes, scales and offsets of ``x`` (KV of ``dtype``) with one scale
        per group along ``axis`` of its ``grouped`` shape; None where float16
        scales cannot describe a group (see ``_decodes_finite``)."""
        g = x.reshape(grouped)
        top = (1 << self.bits) - 1
        low, high = g.min(axis=axis, keepdims=True), g.max(axis=axis, keepdims=True)
        if np.any(np.abs(low) > _FINITE_MAX["float16"]):
            # the offset is a float16: past its largest value it would saturate
            # and the codes of a narrow group would be whole steps off
            return None
        # float16 scale and offset, rounded outwards so that [low, high] maps
        # into [0, top]; KV beyond float16 overflows here and is caught below
        with np.errstate(over="ignore", invalid="ignore"):
            offset = low.astype(np.float16)
            offset = np.where(offset > low, np.nextafter(offset, np.float16(-np.inf)), offset)
            scale = ((high - offset) / top).astype(np.float16)
            short = offset.astype(np.float32) + scale.astype(np.float32) * top < high
            scale = np.where(short, np.nextafter(scale, np.float16(np.inf)), scale)
        if not _decodes_finite(scale, offset, top, dtype):
            return None
        wide = scale.astype(np.float32)
        inverse = np.divide(1.0, wide, out=np.zeros_like(wide), where=wide > 0)
        codes = (g - offset.astype(np.float32)) * inverse
        np.rint(codes, out=codes)
        np.clip(codes, 0, top, out=codes)
        flat = codes.astype(np.uint8).reshape(-1)
        if self.bits == 4:
            flat = flat[0::2] | (flat[1::2] << 4)
        return flat, scale, offset

    def _dequantize(
        self, codes: Payload, scale: Payload, offset: Payload, grouped: tuple[int, ...], axis: int
    ) -> F32:
        if self.bits == 4:
            codes = np.stack([codes & 0x0F, codes >> 4], axis=1).reshape(-1)
        shape = list(grouped)
        shape[axis] = 1
        x = np.multiply(
            codes.reshape(grouped), scale.view(np.float16).astype(np.float32).reshape(shape)
        )
        x += offset.view(np.float16).astype(np.float32).reshape(shape)
        return x


class Int8(Quantized):
    name, ident, bits, group = "int8", 2, 8, None


class Int4(Quantized):
    name, ident, bits, group = "int4", 3, 4, 32


CODECS: dict[str, type[Codec]] = {c.name: c for c in (Plain, Zstd, Int8, Int4)}
CODECS_BY_IDENT: dict[int, type[Codec]] = {c.ident: c for c in CODECS.values()}
assert set(LOSSY_CODECS) == {n for n, c in CODECS.items() if c.lossy}


def codec_named(name: str) -> Codec:
    """A codec by name; a ValueError naming the choices, or the install
    command when its library is missing."""
    cls = CODECS.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r}; choose one of {sorted(CODECS)}")
    codec = cls()
    if isinstance(codec, Zstd):
        _zstandard()
    return codec


# ------------------------------------------------------------------ helpers


def _zstandard() -> Any:
    try:
        import zstandard
    except ImportError:
        raise RuntimeError(
            "codec 'zstd' needs the zstandard package: pip install 'kvtier[codecs]'"
        ) from None
    return zstandard


_WORDS = {2: np.uint16, 4: np.uint32}


def _width(layout: KVLayout | None, nbytes: int) -> int:
    """Bytes per element to split planes by: the dtype's (1 when that does not divide)."""
    width = layout.dtype_bytes if layout is not None else 2
    return width if width in _WORDS and nbytes % width == 0 else 1


def _split(payload: Payload, width: int) -> Payload:
    """Byte planes of ``width``-byte elements (2 or 4): every element's byte
    0, then byte 1... (shifts of whole words: much faster than a strided copy)."""
    words = payload.view(_WORDS[width])
    planes = np.empty((width, words.size), np.uint8)
    for i in range(width):
        planes[i] = words >> words.dtype.type(8 * i)  # the low byte is kept
    return planes.reshape(-1)


def _join(planes: Payload, width: int, out: Payload) -> None:
    """The inverse of ``_split``, into ``out``."""
    word = _WORDS[width]
    rows = planes.reshape(width, -1)
    words = out.view(word)
    np.copyto(words, rows[0], casting="unsafe")
    for i in range(1, width):
        words |= rows[i].astype(word) << word(8 * i)


# The largest finite value of each float dtype a lossy codec takes.
_FINITE_MAX = {
    "float32": float(np.finfo(np.float32).max),
    "float16": float(np.finfo(np.float16).max),
    "bfloat16": float(np.array(0x7F7F0000, np.uint32).view(np.float32)),
}


def _decodes_finite(
    scale: npt.NDArray[np.float16], offset: npt.NDArray[np.float16], top: int, dtype: str
) -> bool:
    """Whether every code from 0 to ``top`` decodes, with these scales and
    offsets, to a finite value of ``dtype`` (the two ends are the extremes;
    computed as ``_dequantize`` does, in float32)."""
    low = offset.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are what is looked for
        high = low + scale.astype(np.float32) * np.float32(top)
    limit = _FINITE_MAX[dtype]
    return bool(np.all(np.abs(low) <= limit) and np.all(np.abs(high) <= limit))


def _float_view(payload: Payload, layout: KVLayout) -> npt.NDArray[Any]:
    return payload.view(np.uint16 if layout.dtype == "bfloat16" else np.dtype(layout.dtype))


def _planes(payload: Payload, layout: KVLayout) -> tuple[F32, F32]:
    """K and V as float32, ``[layers][heads][tokens][channels]`` each."""
    x = _float_view(payload, layout)
    if layout.dtype == "bfloat16":
        x = (x.astype(np.uint32) << 16).view(np.float32)
    x = x.astype(np.float32, copy=False).reshape(
        layout.num_layers, 2, layout.kv_heads, layout.tokens_per_chunk, layout.head_dim
    )
    return x[:, 0], x[:, 1]


def _store_floats(target: npt.NDArray[Any], x: F32, dtype: str) -> None:
    """Write float32 ``x`` (contiguous, a scratch array) into ``target`` in ``dtype``."""
    if dtype != "bfloat16":
        target[...] = x
        return
    bits = x.view(np.uint32)
    bits += 0x8000  # round half away from zero (ties are rare and this is lossy anyway)
    target[...] = bits.view(np.uint16)[..., 1::2]  # the high halves (little-endian)


__all__ = ["CODECS", "CODECS_BY_IDENT", "Codec", "codec_named"]
