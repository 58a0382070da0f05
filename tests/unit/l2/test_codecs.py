"""Payload codecs (``kvtier.l2.codecs``): lossless ones are bit-exact, lossy
ones stay within their quantization step and are used only where the layout
asks for them, and a copy that cannot be decoded is a miss, never a crash or
a wrong tensor."""

from __future__ import annotations

import logging
import struct
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from kvtier.keys import ObjectKey
from kvtier.l2 import CompletionQueue, L2Adapter, make_adapter
from kvtier.l2.codecs import CODECS, Int4, Int8, Zstd, codec_named
from kvtier.l2.format import (
    Corruption,
    CorruptObject,
    checksum,
    encode_header,
    unpack_header,
)
from kvtier.l2.fs import FSAdapter
from kvtier.l2.mock import MockAdapter
from kvtier.l2.payload_codec import PayloadCodec
from kvtier.l2.stored_value import decode_object, encode_object
from kvtier.layout import KVLayout
from tests.conftest import make_key
from tests.unit.l2.harness import Change, Harness, payload

SHAPE = dict(num_layers=3, kv_heads=2, head_dim=64, tokens_per_chunk=64)


def layout(dtype: str = "bfloat16", lossy: str = "") -> KVLayout:
    return KVLayout(dtype=dtype, lossy_codec=lossy, **SHAPE)  # type: ignore[arg-type]


def kv(shape: KVLayout, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A payload of ``shape`` like real KV (keys with outlier channels) and
    its values as float32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((shape.num_layers, 2, shape.kv_heads, shape.tokens_per_chunk, 64))
    x[:, 0] *= rng.uniform(0.1, 8.0, size=(shape.num_layers, shape.kv_heads, 1, 64))
    return typed(x.astype(np.float32), shape.dtype)


def typed(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Float32 ``x`` as a payload of ``dtype`` (bfloat16: truncated), and
    that payload's values as float32."""
    if dtype == "bfloat16":
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8).reshape(-1), (bits.astype(np.uint32) << 16).view(np.float32)
    data = x.astype(dtype)
    return data.view(np.uint8).reshape(-1), data.astype(np.float32)


def floats(data: np.ndarray, shape: KVLayout) -> np.ndarray:
    if shape.dtype == "bfloat16":
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return data.view(shape.dtype).astype(np.float32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("size", [0, 1, 3, 4096, 10_001])
def test_zstd_is_bit_exact(dtype: str, size: int) -> None:
    codec, shape = Zstd(), layout(dtype)
    data = payload(size, seed=size)
    out = np.full(size, 0xAA, np.uint8)
    codec.decode(codec.encode(data, shape), shape, out)
    assert out.tobytes() == data.tobytes()
    real, _ = kv(shape)
    out = np.zeros_like(real)
    stored = codec.encode(real, shape)
    codec.decode(stored, shape, out)
    assert out.tobytes() == real.tobytes()
    assert stored.nbytes < real.nbytes  # float planes compress


def test_zstd_needs_no_layout_to_decode() -> None:
    """A node that never saw the writer's layout still gets the exact bytes
    (the plane count travels with the payload)."""
    shape = layout("float32")
    data, _ = kv(shape)
    out = np.zeros_like(data)
    Zstd().decode(Zstd().encode(data, shape), None, out)
    assert out.tobytes() == data.tobytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize(("codec", "ratio"), [(Int8(), 1.8), (Int4(), 3.0)])
def test_quantized_error_is_within_a_step(dtype: str, codec: Int8 | Int4, ratio: float) -> None:
    shape = layout(dtype, codec.name)
    data, x = kv(shape, seed=3)
    stored = codec.encode(data, shape)
    out = np.zeros_like(data)
    codec.decode(stored, shape, out)
    assert_within_a_step(x, floats(out, shape), shape, codec)
    width = shape.dtype_bytes
    assert data.nbytes / stored.nbytes >= ratio * width / 2


def assert_within_a_step(x: np.ndarray, y: np.ndarray, shape: KVLayout, codec: Int8 | Int4) -> None:
    """Every decoded value ``y`` is finite and within half a quantization
    step of its input ``x``, plus the rounding of float16 scales and offsets
    and of the output dtype."""
    assert np.isfinite(y).all()
    levels = (1 << codec.bits) - 1
    lhtd = (shape.num_layers, shape.kv_heads, shape.tokens_per_chunk, shape.head_dim)
    x, y = x.reshape(lhtd[0], 2, *lhtd[1:]), y.reshape(lhtd[0], 2, *lhtd[1:])
    rounding = {"float32": 2**-20, "float16": 2**-10, "bfloat16": 2**-7}[shape.dtype]
    # keys: a step per (layer, head, channel) over a group of tokens;
    # values: a step per (layer, head, token) over a group of channels
    for half, axis in ((0, 2), (1, 3)):
        size = lhtd[axis]
        group = codec.group if codec.group and size % codec.group == 0 else size
        grouped = (*lhtd[:axis], size // group, group, *lhtd[axis + 1 :])
        a, b = x[:, half].reshape(grouped), y[:, half].reshape(grouped)
        low, high = a.min(axis=axis + 1, keepdims=True), a.max(axis=axis + 1, keepdims=True)
        step = (high.astype(np.float64) - low) / levels
        top = np.maximum(np.abs(low), np.abs(high))
        bound = 0.51 * step + 2**-10 * top / levels + rounding * np.abs(a) + 2**-23
        assert np.all(np.abs(b.astype(np.float64) - a) <= bound)


def test_a_constant_group_decodes_exactly() -> None:
    shape = layout("float32", "int8")
    data = np.full(shape.object_bytes() // 4, 1.5, np.float32).view(np.uint8)
    out = np.zeros_like(data)
    Int8().decode(Int8().encode(data, shape), shape, out)
    assert np.array_equal(out.view(np.float32), data.view(np.float32))


SMALL = dict(num_layers=1, kv_heads=2, head_dim=64, tokens_per_chunk=32)


def _through_the_format(shape: KVLayout, data: np.ndarray) -> tuple[int, np.ndarray]:
    """Store ``data`` with the layout's lossy codec and load it back: the
    codec it was stored with, and the loaded payload."""
    reader = PayloadCodec(shape.lossy_codec, {shape.digest(): shape})
    value = encode_object(make_key(1), shape.digest(), data, reader)
    out = np.zeros_like(data)
    decode_object(value, make_key(1), shape.digest(), out, reader)
    return unpack_header(value).codec, out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("magnitude", [1e5, 1e30, 3e38])
def test_kv_beyond_float16_scales_is_stored_exact(dtype: str, codec: str, magnitude: float) -> None:
    """Float16 scales cannot describe it: such a chunk is stored uncoded, not
    as inf or NaN."""
    shape = layout(dtype, codec)
    real, x = kv(shape, seed=4)
    data, _ = typed((x / np.abs(x).max() * magnitude).astype(np.float32), dtype)
    ident, out = _through_the_format(shape, data)
    assert ident == 0
    assert out.tobytes() == data.tobytes()
    ident, out = _through_the_format(shape, real)  # ordinary KV is still coded
    assert ident == codec_named(codec).ident


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("codec", [Int8(), Int4()])
def test_narrow_kv_past_float16s_largest_value_is_stored_exact(
    dtype: str, codec: Int8 | Int4
) -> None:
    """KV near 131,072 with a spread of a few units: a float16 offset would
    saturate at 65,504 and every code be tens of units off (Hypothesis found
    30 for float32 int8). Such a chunk is stored exact."""
    shape = layout(dtype, codec.name)
    _, x = kv(shape, seed=6)
    data, _ = typed((131072 + x / 4).astype(np.float32), dtype)
    ident, out = _through_the_format(shape, data)
    assert ident == 0
    assert out.tobytes() == data.tobytes()


@pytest.mark.parametrize("codec", [Int8(), Int4()])
def test_float16_kv_whose_top_code_would_pass_its_largest_value_is_stored_exact(
    codec: Int8 | Int4,
) -> None:
    """A key channel spanning float16's whole range: its scale, rounded up to
    a float16, carries the top code past 65504 (to inf once written as
    float16), so the chunk is stored exact."""
    shape = layout("float16", codec.name)
    _, x = kv(shape, seed=5)
    x[0, 0, 0, :, 0] = np.linspace(-65504, 65504, shape.tokens_per_chunk)
    data, x = typed(x, "float16")
    ident, out = _through_the_format(shape, data)
    assert ident == 0
    assert out.tobytes() == data.tobytes()


def _finite_kv(dtype: str) -> st.SearchStrategy[np.ndarray]:
    """Float32 KV of ``SMALL``'s shape whose values are finite in ``dtype``,
    of any magnitude: normal noise around a centre, each scaled by a power of
    two (often one float16 scales can describe, often any), with a few values
    anywhere in the dtype's range."""
    limit = float(np.finfo(np.float16 if dtype == "float16" else np.float32).max)
    value = st.floats(-limit, limit, width=32)
    power = st.one_of(st.integers(-24, 15), st.integers(-149, 127)).map(lambda e: 2.0**e)
    count = 2 * SMALL["num_layers"] * SMALL["kv_heads"] * SMALL["tokens_per_chunk"] * 64

    @st.composite
    def kv_of(draw: st.DrawFn) -> np.ndarray:
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        centre = draw(st.floats(-2, 2)) * draw(power)
        x = centre + rng.standard_normal(count) * draw(power)
        for where, v in draw(st.lists(st.tuples(st.integers(0, count - 1), value), max_size=4)):
            x[where] = v
        return np.clip(x, -limit, limit).astype(np.float32)

    return kv_of()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("codec", [Int8(), Int4()])
def test_finite_kv_of_any_magnitude_loads_finite_and_within_a_step(
    dtype: str, codec: Int8 | Int4
) -> None:
    shape = KVLayout(dtype=dtype, lossy_codec=codec.name, **SMALL)  # type: ignore[arg-type]

    @given(_finite_kv(dtype))
    def check(x: np.ndarray) -> None:
        data, x = typed(x, dtype)
        ident, out = _through_the_format(shape, data)
        if ident == 0:
            assert out.tobytes() == data.tobytes()
        else:
            assert_within_a_step(x, floats(out, shape), shape, codec)

    check()


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [("bfloat16", np.inf), ("bfloat16", np.nan), ("float16", np.inf), ("float16", 600.0)],
)
def test_scales_that_decode_beyond_the_dtype_are_refused(dtype: str, scale: float) -> None:
    """Such as a copy written from KV beyond float16 before such KV was
    stored exact (inf and NaN scales), or one whose finite scale takes the
    top code past float16's largest value (255 * 600 for float16 KV)."""
    shape = layout(dtype, "int8")
    data, _ = kv(shape)
    codes = Int8().encode(data, shape)
    assert codes is not None
    bad = codes.copy()
    scales_at = 2 * Int8()._code_bytes(shape)  # the key scales follow the codes
    bad[scales_at : scales_at + 2] = np.array([scale], np.float16).view(np.uint8)
    header = encode_header(
        make_key(1), shape.digest(), bad, codec=Int8.ident, decoded_len=data.nbytes
    )
    reader = PayloadCodec("int8", {shape.digest(): shape})
    assert _refused(header + bad.tobytes(), reader, shape, data.nbytes) is Corruption.CODEC


def test_a_lossy_codec_is_used_only_where_the_layout_asks_for_it() -> None:
    exact, lossy = layout(), layout(lossy="int8")
    assert exact.digest() != lossy.digest()  # its own keys: never taken for exact KV
    book = {exact.digest(): exact, lossy.digest(): lossy}
    codec = PayloadCodec("int8", book)
    data, _ = kv(exact)
    assert codec.encode(exact.digest(), data) == (0, data)  # stored as it is
    assert codec.encode("", data) == (0, data)  # a layout it does not know
    ident, stored = codec.encode(lossy.digest(), data)
    assert ident == Int8.ident and stored.nbytes < data.nbytes
    assert codec_named("int4").applies(lossy) is False  # asked for int8, not int4
    # a lossy copy under a key whose layout did not ask for it is refused
    with pytest.raises(CorruptObject) as info:
        codec.decode(Int8.ident, exact.digest(), stored, np.zeros_like(data))
    assert info.value.reason is Corruption.CODEC


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"lossy_codec": "int3"}, "not one of"),
        ({"lossy_codec": "int8", "format": "vllm-cpu-vec-bs128"}, "canonical byte order"),
        ({"lossy_codec": "int8", "dtype": "int8"}, "canonical byte order"),
    ],
)
def test_a_layout_refuses_a_lossy_codec_it_cannot_take(kwargs: dict, named: str) -> None:
    fields = {"dtype": "bfloat16", **SHAPE, **kwargs}
    with pytest.raises(ValueError, match=named):
        KVLayout(**fields)  # type: ignore[arg-type]


def test_codec_names_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown codec 'lz9'; choose one of"):
        codec_named("lz9")
    with pytest.raises(ValueError, match="option 'codec': unknown codec"):
        make_adapter({"type": "mock", "codec": "lz9"}, CompletionQueue().put)
    with pytest.raises(ValueError, match="fs adapters store payloads as they are"):
        make_adapter({"type": "fs", "path": "/tmp/unused", "codec": "zstd"}, CompletionQueue().put)
    assert sorted(CODECS) == ["int4", "int8", "none", "zstd"]


# ------------------------------------------------------------ bad copies


def _tamper_mock(adapter: L2Adapter, key: ObjectKey, change: Change) -> None:
    assert isinstance(adapter, MockAdapter)
    adapter.tamper(key, change)


def _coded(codec: str = "zstd", shape: KVLayout | None = None) -> tuple:
    shape = shape or layout()
    key, data = make_key(1), kv(shape)[0]
    reader = PayloadCodec(codec, {shape.digest(): shape})
    return key, shape, data, reader, encode_object(key, shape.digest(), data, reader)


def _refused(value: bytes, reader: PayloadCodec, shape: KVLayout, size: int) -> Corruption:
    out = np.full(size, 7, np.uint8)
    with pytest.raises(CorruptObject) as info:
        decode_object(value, make_key(1), shape.digest(), out, reader)
    return info.value.reason


def test_a_coded_object_round_trips_through_the_format() -> None:
    key, shape, data, reader, value = _coded()
    assert len(value) < data.nbytes
    out = np.zeros_like(data)
    decode_object(value, key, shape.digest(), out, reader)
    assert out.tobytes() == data.tobytes()


def test_a_truncated_compressed_payload_is_refused() -> None:
    _, shape, data, reader, value = _coded()
    assert _refused(value[:-10], reader, shape, data.nbytes) is Corruption.SHORT


def test_a_corrupted_compressed_payload_is_refused() -> None:
    _, shape, data, reader, value = _coded()
    bad = bytearray(value)
    bad[-5] ^= 0xFF
    assert _refused(bytes(bad), reader, shape, data.nbytes) is Corruption.CHECKSUM


def _with_header_field(value: bytes, offset: int, fmt: str, field: object) -> bytes:
    """``value`` with one header field replaced (the checksum covers the payload only)."""
    return value[:offset] + struct.pack(fmt, field) + value[offset + struct.calcsize(fmt) :]


def test_an_unknown_codec_is_refused() -> None:
    _, shape, data, reader, value = _coded()
    bad = _with_header_field(value, 42, "<B", 9)
    assert _refused(bad, reader, shape, data.nbytes) is Corruption.CODEC


def test_impossible_sizes_are_refused() -> None:
    _, shape, data, reader, value = _coded()
    bad = _with_header_field(value, 43, "<Q", data.nbytes + 2)  # the decoded length
    assert _refused(bad, reader, shape, data.nbytes) is Corruption.LENGTH
    # a payload that decodes to other than it promised: a zstd frame of fewer bytes
    other = encode_object(make_key(1), shape.digest(), data[:100], reader)
    bad = _with_header_field(other, 43, "<Q", data.nbytes)
    assert _refused(bad, reader, shape, data.nbytes) is Corruption.CODEC
    # lossy codes of the wrong size, under a header that checks out
    lossy = layout(lossy="int8")
    ldata = kv(lossy)[0]
    lreader = PayloadCodec("int8", {lossy.digest(): lossy})
    codes = Int8().encode(ldata, lossy)[:-64]
    header = encode_header(make_key(1), lossy.digest(), codes, codec=Int8.ident,
                           decoded_len=ldata.nbytes)  # fmt: skip
    bad = header + codes.tobytes()
    assert _refused(bad, lreader, lossy, ldata.nbytes) is Corruption.CODEC


def _zstd_copy(frame: bytes, decoded_len: int) -> bytes:
    """A stored object (header checks out) whose payload is ``frame`` as
    whole bytes (one plane), promising ``decoded_len`` bytes."""
    stored = np.frombuffer(bytes([1]) + frame, np.uint8)
    header = encode_header(make_key(1), "", stored, codec=Zstd.ident, decoded_len=decoded_len)
    return header + stored.tobytes()


def _zstd_refusal(value: bytes, size: int) -> str:
    out = np.full(size, 7, np.uint8)
    with pytest.raises(CorruptObject) as info:
        decode_object(value, make_key(1), "", out, PayloadCodec("zstd", {}))
    assert info.value.reason is Corruption.CODEC
    assert (out == 7).all()
    return str(info.value)


def test_a_zstd_frame_must_declare_the_objects_size() -> None:
    """The size a frame declares is what the decompressor allocates: one that
    declares more, or nothing, is refused before decompressing; so is a
    payload with bytes after its frame."""
    data = payload(4096, seed=1).tobytes()
    compress = zstandard.ZstdCompressor(level=1).compress
    assert "declares 8192 bytes" in _zstd_refusal(_zstd_copy(compress(data * 2), 4096), 4096)
    undeclared = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(data)
    assert "declares no size" in _zstd_refusal(_zstd_copy(undeclared, 4096), 4096)
    assert "unused data" in _zstd_refusal(_zstd_copy(compress(data) + b"\0", 4096), 4096)
    short = bytearray(compress(data[:2048]))  # a frame that declares 4096 bytes and holds 2048
    assert short[4] == 0x60  # its descriptor: a 2-byte size (less 256) follows, no window size
    short[5:7] = (4096 - 256).to_bytes(2, "little")
    assert "decompression error" in _zstd_refusal(_zstd_copy(bytes(short), 4096), 4096)
    out = np.zeros(4096, np.uint8)  # the frame the writer makes
    decode_object(_zstd_copy(compress(data), 4096), make_key(1), "", out, PayloadCodec("zstd", {}))
    assert out.tobytes() == data


_BOMB = """
import resource
import numpy as np, zstandard
from kvtier.keys import ObjectKey
from kvtier.l2.payload_codec import PayloadCodec
from kvtier.l2.format import CorruptObject, encode_header
from kvtier.l2.stored_value import decode_object

declared, size = 256 << 20, 64 << 10
compressor = zstandard.ZstdCompressor(level=1).compressobj(size=declared)
zeros = bytes(1 << 20)
frame = b"".join([compressor.compress(zeros) for _ in range(256)] + [compressor.flush()])
stored = np.frombuffer(bytes([1]) + frame, np.uint8)
key = ObjectKey(bytes(32), "m", 0)
value = encode_header(key, "", stored, codec=1, decoded_len=size) + stored.tobytes()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    decode_object(value, key, "", np.zeros(size, np.uint8), PayloadCodec("zstd", {}))
except CorruptObject as exc:
    print(exc.reason.value)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(len(frame), grown)
"""


def test_a_zstd_frame_declaring_256_mib_is_refused_in_bounded_memory() -> None:
    """An 8 KB frame of zeros that declares 256 MiB, for a 64 KiB object,
    under a header that checks out (as another node writing a shared store
    could make): refused, and the reader's peak RSS does not grow by what
    the frame declares (measured in a process of its own)."""
    child = [sys.executable, "-c", textwrap.dedent(_BOMB)]
    run = subprocess.run(child, capture_output=True, text=True, check=True)
    reason, sizes = run.stdout.split("\n")[:2]
    frame_bytes, grown_kib = map(int, sizes.split())
    assert reason == "codec"
    assert frame_bytes < 16 << 10
    assert grown_kib < 32 << 10  # the frame declares 256 MiB


def test_a_codec_missing_on_the_reading_node_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _, shape, data, _, value = _coded()
    import kvtier.l2.codecs as codecs

    def missing() -> None:
        raise RuntimeError("codec 'zstd' needs the zstandard package")

    monkeypatch.setattr(codecs, "_zstandard", missing)
    reader = PayloadCodec("none", {shape.digest(): shape})  # a node without zstandard
    assert _refused(value, reader, shape, data.nbytes) is Corruption.CODEC


def test_a_bad_compressed_copy_is_a_counted_miss_and_removed() -> None:
    shape = layout()
    queue = CompletionQueue()
    adapter = make_adapter({"type": "mock", "codec": "zstd"}, queue.put)
    adapter.share_layouts({shape.digest(): shape})
    h = Harness(adapter, queue, _tamper_mock)
    try:
        key, data = make_key(5), kv(shape)[0]
        assert h.store([key], [data], shape.digest()).ok == (True,)
        raw = h.raw(key)
        assert len(raw) < data.nbytes
        # a zstd frame that checks out but is not what the header says: rewritten whole
        frame = bytearray(raw)
        header_len = struct.unpack_from("<H", raw, 6)[0]
        frame[header_len:] = bytes(len(raw) - header_len)  # zeros: not a zstd frame
        h.tamper(key, lambda _: _rechecked(bytes(frame), header_len))
        out = np.zeros_like(data)
        assert h.load([key], [out], shape.digest()).ok == (False,)
        assert not out.any()
        assert h.counter("corrupt_objects") == 1
        assert h.lookup([key]).ok == (False,)  # the copy was removed
        assert h.store([key], [data], shape.digest()).ok == (True,)  # and it keeps serving
        assert h.load([key], [out], shape.digest()).ok == (True,)
        assert out.tobytes() == data.tobytes()
    finally:
        adapter.close()


def test_a_coded_copy_in_a_store_of_plain_payloads_is_a_counted_miss(tmp_path: Path) -> None:
    """An fs store takes payloads as they are: a coded copy there (written by
    another node, the payload's length and checksum right) is not its KV."""
    queue = CompletionQueue()
    adapter = make_adapter({"type": "fs", "path": str(tmp_path)}, queue.put)
    h = Harness(adapter, queue)
    try:
        key, data, other = make_key(1), payload(4096, seed=1), payload(4096, seed=2)
        assert h.store([key], [data], "").ok == (True,)
        assert isinstance(adapter, FSAdapter)
        header = encode_header(key, "", other, align=4096, codec=Zstd.ident, decoded_len=4096)
        adapter.path_of(key).write_bytes(header + other.tobytes())
        out = np.zeros_like(data)
        assert h.load([key], [out], "").ok == (False,)
        assert h.failures() == Counter({"corrupt_codec": 1})
        assert h.lookup([key]).ok == (False,)  # the copy was removed
    finally:
        adapter.close()


def _rechecked(value: bytes, header_len: int) -> bytes:
    """``value`` with its header's checksum made right for its payload."""
    digest = checksum(np.frombuffer(value, np.uint8, offset=header_len))
    return _with_header_field(value, 32, "<Q", digest)


# ------------------------------------------------------------ where it pays


def _loaded_often(spec: dict, loads: int = 6) -> dict:
    """Store real-like KV through a mock adapter and load it ``loads`` times;
    then store a new object. The adapter's status after."""
    shape = layout()
    queue = CompletionQueue()
    adapter = make_adapter({"type": "mock", "codec": "zstd", **spec}, queue.put)
    adapter.share_layouts({shape.digest(): shape})
    h = Harness(adapter, queue, _tamper_mock)
    try:
        keys = [make_key(i) for i in range(4)]
        data = [kv(shape, seed=i)[0] for i in range(4)]
        assert h.store(keys, data, shape.digest()).ok == (True,) * 4
        out = [np.zeros_like(d) for d in data]
        for _ in range(loads):
            assert h.load(keys, out, shape.digest()).ok == (True,) * 4
        assert [o.tobytes() for o in out] == [d.tobytes() for d in data]
        later = make_key(9)
        assert h.store([later], [data[0]], shape.digest()).ok == (True,)
        status = adapter.status()
        status["later_bytes"] = len(h.raw(later))
        status["object_bytes"] = data[0].nbytes
        return status
    finally:
        adapter.close()


def test_a_codec_switches_itself_off_where_reading_plain_is_faster(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """In memory, decoding zstd is slower than copying: new stores are plain,
    and the adapter's log says so once, with the rates behind it."""
    with caplog.at_level(logging.INFO, logger="kvtier.l2.payload_codec"):
        status = _loaded_often({"name": "in-memory"})
    (line,) = [r.getMessage() for r in caplog.records if "does not pay" in r.getMessage()]
    assert line.startswith("L2 in-memory: codec zstd does not pay, storing plain: a coded read")
    assert status["codec_pays"] == 0.0
    assert status["codec_plain_stores"] == 1
    assert status["later_bytes"] > status["object_bytes"]  # header + the plain payload


def test_a_codec_stays_on_where_the_link_is_slow() -> None:
    """At 20 MB/s the smaller read wins (this KV compresses by ~1.4x)."""
    status = _loaded_often({"bandwidth_bytes_per_s": 20e6}, loads=3)
    assert status["codec_pays"] == 1.0
    assert status["codec_plain_stores"] == 0
    assert status["later_bytes"] < status["object_bytes"]


def test_measured_whole_loads_overrule_the_model(caplog: pytest.LogCaptureFixture) -> None:
    """The model adds a part's transfer and decode; where the adapter's threads
    overlap them, whole loads of coded payloads can still come in faster.
    Once loads have been timed both ways, those decide."""
    codec = PayloadCodec("zstd", {}, where="redis")
    # 1 GB/s link, decode 0.7 GB/s, ratio 1.47: the model says a coded read is slower
    codec.learn_part(0.068, 68_000_000, 0.143, 100_000_000, 68_000_000)
    assert codec.status()["codec_pays"] == 0.0
    with caplog.at_level(logging.INFO, logger="kvtier.l2.payload_codec"):
        codec.load_done(0.20, 130_000_000, 130_000_000)  # a load of coded payloads
        codec.load_done(0.10, 130_000_000, 60_000_000)  # mixed: teaches nothing
        assert codec.status()["codec_pays"] == 0.0
        codec.load_done(0.25, 130_000_000, 0)  # a load of plain ones: slower
    status = codec.status()
    assert status["codec_pays"] == 1.0
    assert status["codec_coded_load_bytes_per_s"] == pytest.approx(0.65e9)
    assert status["codec_plain_load_bytes_per_s"] == pytest.approx(0.52e9)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "L2 redis: codec zstd pays, coding stores: loads deliver 0.65 GB/s coded, 0.52 GB/s plain"
    ]
    for _ in range(20):  # plain loads speed up (a faster link): the codec goes off again
        codec.load_done(0.10, 130_000_000, 0)
    assert codec.status()["codec_pays"] == 0.0


def test_a_codec_that_is_off_or_none_ignores_load_times() -> None:
    plain = PayloadCodec("none", {})
    plain.load_done(0.1, 1000, 0)
    assert plain.status() == {"codec_plain_stores": 0.0}
