"""Re-sharding one chunk's objects between tensor-parallel rank layouts.

A prefill engine with TP ``p`` stores each chunk as ``p`` objects (one per
rank); a decode engine with TP ``d`` reads ``d``. Tensor parallelism splits
attention by KV heads: with ``H`` KV heads and TP ``t``, rank ``r`` holds
heads ``[r * H / t, (r + 1) * H / t)`` when ``t <= H``, and one replica of
head ``r // (t / H)`` when ``t > H`` (vLLM's rule, as for its QKV
projection). An MLA latent is replicated on every rank. ``reshard`` rebuilds
the chunk's heads from the source objects and cuts them as the receiver's
ranks hold them, byte for byte.

Only kvtier's canonical byte order (``[layers][K, V][kv_heads][tokens]
[head_dim]``) can be re-sharded: an engine's own page format (vLLM-CPU's
packed blocks, ``KVLayout.format``) is refused, as is any difference besides
the rank split (layers, head size, dtype, chunk size, codec). Replicas that
disagree are refused too: the source is inconsistent, and loading either
copy could be wrong KV.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvtier.layout import KVLayout

Bytes = npt.NDArray[np.uint8]


def rank_heads(layout: KVLayout, total_kv_heads: int) -> list[list[int]]:
    """The model's KV heads each rank of ``layout`` holds; ValueError if the
    layout is not a TP split of ``total_kv_heads`` heads."""
    ranks, per_rank = layout.num_ranks, layout.kv_heads
    if layout.kind == "latent":
        return [[0] for _ in range(ranks)]
    if per_rank * ranks == total_kv_heads:
        return [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(ranks)]
    if per_rank == 1 and ranks > total_kv_heads and ranks % total_kv_heads == 0:
        replicas = ranks // total_kv_heads
        return [[r // replicas] for r in range(ranks)]
    raise ValueError(
        f"a layout of {ranks} ranks x {per_rank} KV heads is not a tensor-parallel split of "
        f"{total_kv_heads} KV heads"
    )


def reshard(
    objects: Sequence[Bytes], source: KVLayout, target: KVLayout, total_kv_heads: int
) -> list[Bytes]:
    """One chunk's objects under ``target``'s ranks, from its objects under
    ``source``'s (rank order); ValueError naming what cannot be converted."""
    _check_convertible(source, target)
    if len(objects) != source.num_ranks:
        raise ValueError(f"{len(objects)} objects for a layout of {source.num_ranks} ranks")
    factor = 2 if source.kind == "kv" else 1
    heads = 1 if source.kind == "latent" else total_kv_heads
    row = source.tokens_per_chunk * source.head_dim * source.dtype_bytes  # one head's bytes
    chunk: Bytes = np.empty((source.num_layers, factor, heads, row), np.uint8)
    filled = np.zeros(heads, bool)
    for rank, held in enumerate(rank_heads(source, total_kv_heads)):
        if objects[rank].nbytes != source.object_bytes():
            raise ValueError(
                f"rank {rank}'s object has {objects[rank].nbytes} bytes; the layout says "
                f"{source.object_bytes()}"
            )
        part = np.asarray(objects[rank]).reshape(source.num_layers, factor, len(held), row)
        for j, head in enumerate(held):
            if filled[head] and not np.array_equal(chunk[:, :, head], part[:, :, j]):
                raise ValueError(f"the replicas of KV head {head} differ: refusing to load either")
            chunk[:, :, head] = part[:, :, j]
            filled[head] = True
    return [
        np.ascontiguousarray(chunk[:, :, held]).reshape(-1)
        for held in rank_heads(target, total_kv_heads)
    ]


def _check_convertible(source: KVLayout, target: KVLayout) -> None:
    for layout in (source, target):
        if layout.format:
            raise ValueError(
                f"objects in the engine format {layout.format!r} cannot be re-sharded (only "
                "kvtier's canonical byte order can); both sides must use the same format and TP"
            )
    split = {"kv_heads", "num_ranks"}
    for field in dataclasses.fields(KVLayout):
        if field.name not in split and getattr(source, field.name) != getattr(target, field.name):
            raise ValueError(
                f"the layouts differ in {field.name} ({getattr(source, field.name)!r} vs "
                f"{getattr(target, field.name)!r}): only the rank split can be converted"
            )


__all__ = ["rank_heads", "reshard"]
