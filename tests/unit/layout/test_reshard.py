"""Re-sharding a chunk between TP rank layouts: byte-exact against the objects
each receiver's ranks would store themselves, for TP 1, 2 and 4 both ways;
what cannot be converted is refused."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from kvtier.layout import KVLayout
from kvtier.layout.reshard import check_convertible, head_rows, rank_heads, reshard, tp_layout

LAYERS, DIM, TOKENS = 3, 8, 16


def model_kv(heads: int, seed: int = 0) -> np.ndarray:
    """One chunk of a model's K and V: [layers, 2, heads, tokens, dim] float32."""
    return np.random.default_rng(seed).standard_normal((LAYERS, 2, heads, TOKENS, DIM), np.float32)


def engine_objects(kv: np.ndarray, tp: int) -> tuple[KVLayout, list[np.ndarray]]:
    """What an engine with TP ``tp`` stores for ``kv``: each rank's heads in
    kvtier's canonical order, as vLLM splits heads (a contiguous range per
    rank; with more ranks than heads, each rank a replica of one head)."""
    heads = kv.shape[2]
    if tp <= heads:
        held = [list(range(r * heads // tp, (r + 1) * heads // tp)) for r in range(tp)]
    else:
        held = [[r * heads // tp] for r in range(tp)]
    layout = KVLayout(LAYERS, len(held[0]), DIM, "float32", TOKENS, num_ranks=tp)
    objects = [np.ascontiguousarray(kv[:, :, h]).view(np.uint8).reshape(-1) for h in held]
    return layout, objects


@pytest.mark.parametrize("heads", [4, 8, 2])
@pytest.mark.parametrize(("source_tp", "target_tp"), list(itertools.permutations([1, 2, 4], 2)))
def test_resharding_gives_the_receivers_own_objects(
    heads: int, source_tp: int, target_tp: int
) -> None:
    kv = model_kv(heads)
    source, objects = engine_objects(kv, source_tp)
    target, expected = engine_objects(kv, target_tp)
    converted = reshard(objects, source, target, heads)
    assert [c.tobytes() for c in converted] == [e.tobytes() for e in expected]
    assert all(c.nbytes == target.object_bytes() for c in converted)


def test_the_same_split_is_a_copy() -> None:
    source, objects = engine_objects(model_kv(4), 2)
    assert [c.tobytes() for c in reshard(objects, source, source, 4)] == [
        o.tobytes() for o in objects
    ]


def test_an_mla_latent_is_replicated_on_every_rank() -> None:
    latent = np.arange(LAYERS * TOKENS * DIM, dtype=np.float32).view(np.uint8)
    source = KVLayout(LAYERS, 1, DIM, "float32", TOKENS, kind="latent", num_ranks=1)
    target = dataclasses.replace(source, num_ranks=4)
    assert [c.tobytes() for c in reshard([latent], source, target, 1)] == [latent.tobytes()] * 4


def test_rank_heads_follows_the_tp_split() -> None:
    layout = KVLayout(LAYERS, 2, DIM, "float32", TOKENS, num_ranks=4)
    assert rank_heads(layout, 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    replicas = KVLayout(LAYERS, 1, DIM, "float32", TOKENS, num_ranks=4)
    assert rank_heads(replicas, 2) == [[0], [0], [1], [1]]
    with pytest.raises(ValueError, match="not a tensor-parallel split of 6 KV heads"):
        rank_heads(layout, 6)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"dtype": "float16"}, "dtype"),
        ({"head_dim": 16}, "head_dim"),
        ({"tokens_per_chunk": 32}, "tokens_per_chunk"),
        ({"num_layers": 2}, "num_layers"),
        ({"format": "vllm-cpu-vec-bs8"}, "format"),
    ],
)
def test_what_is_not_a_rank_split_is_refused(change: dict[str, object], named: str) -> None:
    source, objects = engine_objects(model_kv(4), 2)
    target = dataclasses.replace(source, num_ranks=1, kv_heads=4, **change)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=named):
        reshard(objects, source, target, 4)


def test_replicas_that_disagree_are_refused() -> None:
    source, objects = engine_objects(model_kv(2), 4)
    objects[1] = objects[1].copy()
    objects[1][0] ^= 1  # rank 1's replica of head 0 differs from rank 0's
    target, _ = engine_objects(model_kv(2), 1)
    with pytest.raises(ValueError, match="replicas of KV head 0 differ"):
        reshard(objects, source, target, 2)


def test_wrong_object_counts_and_sizes_are_refused() -> None:
    source, objects = engine_objects(model_kv(4), 2)
    target, _ = engine_objects(model_kv(4), 4)
    with pytest.raises(ValueError, match="1 objects for a layout of 2 ranks"):
        reshard(objects[:1], source, target, 4)
    with pytest.raises(ValueError, match="rank 1's object has"):
        reshard([objects[0], objects[1][:-4]], source, target, 4)


BLOCK = 4  # tokens per vLLM block: a chunk of TOKENS is 4 blocks


def engine_pages(kv: np.ndarray, tp: int) -> tuple[KVLayout, list[np.ndarray]]:
    """What vLLM's CPU build stores for ``kv`` under TP ``tp``: per rank,
    ``[layers][blocks][its heads][one head's block]``, a head's block packed
    in a way that depends only on the head (here K and V of each token
    interleaved, then the block reversed: any packing within a head)."""
    heads = kv.shape[2]
    layers, _, _, tokens, dim = kv.shape
    blocks = kv.reshape(layers, 2, heads, tokens // BLOCK, BLOCK, dim)
    packed = blocks.transpose(0, 3, 2, 4, 1, 5)[:, :, :, ::-1]  # [layers][block][head][...]
    layout, _ = engine_objects(kv, tp)
    layout = dataclasses.replace(layout, format=f"vllm-cpu-vec-bs{BLOCK}")
    held = rank_heads(layout, heads)
    objects = [np.ascontiguousarray(packed[:, :, h]).view(np.uint8).reshape(-1) for h in held]
    return layout, objects


@pytest.mark.parametrize(("source_tp", "target_tp"), list(itertools.permutations([1, 2, 4], 2)))
def test_vllm_cpu_pages_are_resharded_by_heads(source_tp: int, target_tp: int) -> None:
    kv = model_kv(4, seed=1)
    source, objects = engine_pages(kv, source_tp)
    target, expected = engine_pages(kv, target_tp)
    assert head_rows(source) == (LAYERS * TOKENS // BLOCK, 2 * BLOCK * DIM * 4)
    converted = reshard(objects, source, target, 4)
    assert [c.tobytes() for c in converted] == [e.tobytes() for e in expected]


@pytest.mark.parametrize(
    ("fmt", "why"),
    [
        ("vllm-cuda-NHD-bs16", "engine format 'vllm-cuda-NHD-bs16' cannot be re-sharded"),
        ("vllm-cpu-vec-bs3", "cannot be re-sharded"),  # 16 tokens are not whole blocks of 3
    ],
)
def test_pages_not_cut_by_heads_are_refused(fmt: str, why: str) -> None:
    source, objects = engine_objects(model_kv(4), 2)
    source = dataclasses.replace(source, format=fmt)
    target = dataclasses.replace(source, num_ranks=1, kv_heads=4)
    with pytest.raises(ValueError, match=why):
        reshard(objects, source, target, 4)


def test_tp_layout_is_the_layout_each_tp_size_has() -> None:
    layout, _ = engine_objects(model_kv(4), 1)
    for tp in (1, 2, 4, 8):
        other = tp_layout(layout, 4, tp)
        assert (other.num_ranks, other.kv_heads) == (tp, max(1, 4 // tp))
        check_convertible(layout, other, 4)
    with pytest.raises(ValueError, match="TP 3 does not split 4 KV heads"):
        tp_layout(layout, 4, 3)
    with pytest.raises(ValueError, match="not a tensor-parallel split of 6 KV heads"):
        check_convertible(layout, tp_layout(layout, 4, 2), 6)
