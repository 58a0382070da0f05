"""Payload codecs (``kvtier.l2.codecs``): lossless ones are bit-exact, lossy
ones stay within their quantization step and are used only where the layout
asks for them, and a copy that cannot be decoded is a miss, never a crash or
a wrong tensor."""

from __future__ import annotations

import logging
import struct

import numpy as np
import pytest

from kvtier.keys import ObjectKey
from kvtier.l2 import CompletionQueue, L2Adapter, make_adapter
from kvtier.l2.codecs import CODECS, Int4, Int8, PayloadCodec, Zstd, codec_named
from kvtier.l2.format import (
    Corruption,
    CorruptObject,
    checksum,
    decode_object,
    encode_header,
    encode_object,
)
from kvtier.l2.mock import MockAdapter
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
    x = x.astype(np.float32)
    if shape.dtype == "bfloat16":
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8).reshape(-1), (bits.astype(np.uint32) << 16).view(np.float32)
    typed = x.astype(shape.dtype)
    return typed.view(np.uint8).reshape(-1), typed.astype(np.float32)


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
    y = floats(out, shape).reshape(x.shape)
    levels = (1 << codec.bits) - 1
    # keys: a step per (layer, head, channel) over a group of tokens
    g = 32 if codec.bits == 4 else shape.tokens_per_chunk
    k = x[:, 0].reshape(3, 2, -1, g, 64)
    k_step = (k.max(axis=3, keepdims=True) - k.min(axis=3, keepdims=True)) / levels
    k_err = np.abs(y[:, 0].reshape(k.shape) - k)
    # values: a step per (layer, head, token) over a group of channels
    g = 32 if codec.bits == 4 else 64
    v = x[:, 1].reshape(3, 2, 64, -1, g)
    v_step = (v.max(axis=4, keepdims=True) - v.min(axis=4, keepdims=True)) / levels
    v_err = np.abs(y[:, 1].reshape(v.shape) - v)
    # half a step, plus float16 scales and the output dtype's rounding
    slack = {"float32": 1e-3, "float16": 2e-3, "bfloat16": 8e-3}[dtype]
    assert np.all(k_err <= k_step * 0.51 + slack * np.abs(k) + 1e-3)
    assert np.all(v_err <= v_step * 0.51 + slack * np.abs(v) + 1e-3)
    width = shape.dtype_bytes
    assert data.nbytes / stored.nbytes >= ratio * width / 2


def test_a_constant_group_decodes_exactly() -> None:
    shape = layout("float32", "int8")
    data = np.full(shape.object_bytes() // 4, 1.5, np.float32).view(np.uint8)
    out = np.zeros_like(data)
    Int8().decode(Int8().encode(data, shape), shape, out)
    assert np.array_equal(out.view(np.float32), data.view(np.float32))


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
    with caplog.at_level(logging.INFO, logger="kvtier.l2.codecs"):
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
    with caplog.at_level(logging.INFO, logger="kvtier.l2.codecs"):
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
