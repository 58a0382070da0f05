"""Re-paging vLLM CPU pages between block sizes (``kvtier.layout.repage``),
alone and with a TP re-sharding: byte for byte what an engine of the other
block size stores. ``cpu_pages`` is the packing written out plainly (per
layer, block and head: K transposed, then V); ``test_vllm_pages.py`` checks
it against vLLM's own kernel."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvtier.layout import KVLayout
from kvtier.layout.repage import page_block, repage
from kvtier.layout.reshard import check_convertible, reshard, tp_layout

LAYERS, HEADS, DIM, TOKENS = 2, 4, 8, 64


def cpu_pages(kv: np.ndarray, block: int) -> bytes:
    """One rank's object of ``kv`` ([layers, K/V, heads, tokens, dim]) as vLLM's
    CPU backend pages it at ``block`` tokens a block."""
    layers, _, heads, tokens, _ = kv.shape
    out = bytearray()
    for layer in range(layers):
        for start in range(0, tokens, block):
            for head in range(heads):
                k = kv[layer, 0, head, start : start + block]
                v = kv[layer, 1, head, start : start + block]
                out += np.ascontiguousarray(k.T).tobytes() + v.tobytes()
    return bytes(out)


def rank_pages(kv: np.ndarray, tp: int, block: int) -> list[bytes]:
    """What each rank of TP ``tp`` stores of ``kv`` as vLLM's CPU pages."""
    share = kv.shape[2] // tp
    return [cpu_pages(kv[:, :, r * share : (r + 1) * share], block) for r in range(tp)]


def pages_layout(block: int, dtype: str = "float32", dim: int = DIM) -> KVLayout:
    isa = "vec16" if block == 16 else "vec"
    return KVLayout(LAYERS, HEADS, dim, dtype, TOKENS, format=f"vllm-cpu-{isa}-bs{block}")


def random_kv(dtype: str = "float32") -> np.ndarray:
    rng = np.random.default_rng(3)
    kv = rng.standard_normal((LAYERS, 2, HEADS, TOKENS, DIM)).astype(np.float32)
    if dtype == "float16":
        return kv.astype(np.float16)
    if dtype == "bfloat16":  # the upper halves of fp32 words: any 16-bit pattern will do
        return (kv.view(np.uint32) >> 16).astype(np.uint16)
    return kv


def as_array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("source", "target"), [(16, 32), (32, 16), (16, 64), (64, 32), (8, 64)])
def test_repaging_gives_what_the_other_block_size_stores(
    dtype: str, source: int, target: int
) -> None:
    kv = random_kv(dtype)
    got = repage(
        as_array(cpu_pages(kv, source)), pages_layout(source, dtype), pages_layout(target, dtype)
    )
    assert got.tobytes() == cpu_pages(kv, target)


def test_the_same_block_size_is_the_same_bytes() -> None:
    kv = random_kv()
    layout = pages_layout(32)
    assert repage(as_array(cpu_pages(kv, 32)), layout, layout).tobytes() == cpu_pages(kv, 32)


@pytest.mark.parametrize(("source_tp", "target_tp"), [(1, 2), (2, 1), (4, 2)])
def test_resharding_and_repaging_together(source_tp: int, target_tp: int) -> None:
    """TP and block size both differ: the heads are cut, then re-paged."""
    kv = random_kv()
    source = tp_layout(pages_layout(16), HEADS, source_tp)
    target = tp_layout(pages_layout(32), HEADS, target_tp)
    check_convertible(source, target, HEADS)

    got = reshard([as_array(o) for o in rank_pages(kv, source_tp, 16)], source, target, HEADS)
    assert [g.tobytes() for g in got] == rank_pages(kv, target_tp, 32)


def test_pages_kvtier_does_not_know_are_refused_naming_why() -> None:
    vec = pages_layout(32)
    amx = dataclasses.replace(vec, format="vllm-cpu-amx-bs32")
    with pytest.raises(ValueError, match="'vllm-cpu-amx-bs32' cannot be converted"):
        check_convertible(vec, amx, HEADS)
    canonical = dataclasses.replace(vec, format="")
    with pytest.raises(ValueError, match="'canonical' cannot be converted"):
        check_convertible(canonical, vec, HEADS)
    with pytest.raises(ValueError, match="not whole blocks of 128 tokens"):
        page_block(pages_layout(128))  # a 64-token chunk
    other = dataclasses.replace(pages_layout(16), head_dim=16)
    with pytest.raises(ValueError, match="differ in head_dim"):
        check_convertible(other, vec, HEADS)
    with pytest.raises(ValueError, match="bytes for an object of"):
        repage(np.zeros(10, np.uint8), pages_layout(16), vec)
