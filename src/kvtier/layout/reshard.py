"""Re-sharding one chunk's objects between tensor-parallel rank layouts
(and vLLM CPU block sizes).

A prefill engine with TP ``p`` stores each chunk as ``p`` objects (one per
rank); a decode engine with TP ``d`` reads ``d``. Tensor parallelism splits
attention by KV heads: with ``H`` KV heads and TP ``t``, rank ``r`` holds
heads ``[r * H / t, (r + 1) * H / t)`` when ``t <= H``, and one replica of
head ``r // (t / H)`` when ``t > H`` (vLLM's rule, as for its QKV
projection). An MLA latent is replicated on every rank. ``reshard`` rebuilds
the chunk's heads from the source objects and cuts them as the receiver's
ranks hold them, byte for byte.

An object can be cut by heads when each head's bytes are contiguous runs
of it (``head_rows``): kvtier's canonical byte order (``[layers][K, V]
[kv_heads][tokens][head_dim]``), and vLLM's CPU pages (formats
``vllm-cpu-<isa>-bs<B>``, as ``kvtier.engine.vllm.pages`` names them): vLLM's
CPU backend keeps every layer as ``[blocks][kv_heads][B, 2 x head_dim]`` and
packs K and V within one head's part of a block, by rules that depend on the
instruction set, block size, head size and dtype (all in the format and the
layout) and not on how many heads a rank holds. Any other engine format is
refused, as is any difference besides the rank split (layers, head size,
dtype, chunk size, codec) and, between vLLM CPU pages kvtier can re-page
(``kvtier.layout.repage``), the block size: the heads are cut at the
source's block size, then each object is re-paged at the receiver's.
Replicas that disagree are refused too: the source is inconsistent, and
loading either copy could be wrong KV.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvtier.layout import KVLayout
from kvtier.layout.repage import page_block, repage

Bytes = npt.NDArray[np.uint8]
_HEAD_MAJOR_PAGES = re.compile(r"vllm-cpu-[^-]+-bs(\d+)")  # vLLM's CPU pages: head-major


def head_rows(layout: KVLayout) -> tuple[int, int]:
    """How one object of ``layout`` splits by KV heads: ``(outer, row)`` for
    bytes ``[outer][kv_heads][row]``; ValueError for a format that does not."""
    factor = 2 if layout.kind == "kv" else 1
    if not layout.format:  # [layers][K, V][heads][tokens x head_dim]
        return layout.num_layers * factor, layout.tokens_per_chunk * layout.head_dim * (
            layout.dtype_bytes
        )
    pages = _HEAD_MAJOR_PAGES.fullmatch(layout.format)
    block = int(pages[1]) if pages else 0
    if not block or layout.tokens_per_chunk % block:
        raise ValueError(
            f"objects in the engine format {layout.format!r} cannot be re-sharded (kvtier's "
            "canonical byte order and vLLM's CPU pages can); both sides must use the same TP"
        )
    blocks = layout.tokens_per_chunk // block  # [layers][blocks][heads][block x K, V]
    return layout.num_layers * blocks, factor * block * layout.head_dim * layout.dtype_bytes


def tp_layout(layout: KVLayout, total_kv_heads: int, ranks: int) -> KVLayout:
    """The same model's layout under TP ``ranks`` (vLLM's split: a share of
    the heads per rank, or one replica each when the ranks outnumber them)."""
    if layout.kind == "latent":
        return dataclasses.replace(layout, num_ranks=ranks)
    if ranks <= 0 or (total_kv_heads % ranks and ranks % total_kv_heads):
        raise ValueError(f"TP {ranks} does not split {total_kv_heads} KV heads")
    return dataclasses.replace(layout, num_ranks=ranks, kv_heads=max(1, total_kv_heads // ranks))


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
    outer, row = head_rows(source)
    heads = 1 if source.kind == "latent" else total_kv_heads
    chunk: Bytes = np.empty((outer, heads, row), np.uint8)
    filled = np.zeros(heads, bool)
    for rank, held in enumerate(rank_heads(source, total_kv_heads)):
        if objects[rank].nbytes != source.object_bytes():
            raise ValueError(
                f"rank {rank}'s object has {objects[rank].nbytes} bytes; the layout says "
                f"{source.object_bytes()}"
            )
        part = np.asarray(objects[rank]).reshape(outer, len(held), row)
        for j, head in enumerate(held):
            if filled[head] and not np.array_equal(chunk[:, head], part[:, j]):
                raise ValueError(f"the replicas of KV head {head} differ: refusing to load either")
            chunk[:, head] = part[:, j]
            filled[head] = True
    cut = [
        np.ascontiguousarray(chunk[:, held]).reshape(-1)
        for held in rank_heads(target, total_kv_heads)
    ]
    if source.format == target.format:
        return cut
    paged = dataclasses.replace(target, format=source.format)  # the cut's block size
    return [repage(obj, paged, target) for obj in cut]


def check_convertible(source: KVLayout, target: KVLayout, total_kv_heads: int) -> None:
    """ValueError naming why ``source``'s objects cannot become ``target``'s."""
    _check_convertible(source, target)
    rank_heads(source, total_kv_heads)
    rank_heads(target, total_kv_heads)


def _check_convertible(source: KVLayout, target: KVLayout) -> None:
    head_rows(source)
    convertible = {"kv_heads", "num_ranks"}
    if source.format != target.format:
        try:  # both pages of a packing kvtier can re-page
            page_block(source)
            page_block(target)
        except ValueError as error:
            shown = [layout.format or "canonical" for layout in (source, target)]
            message = f"the page formats differ ({shown[0]!r} vs {shown[1]!r}): {error}"
            raise ValueError(message) from None
        convertible.add("format")
    for field in dataclasses.fields(KVLayout):
        name = field.name
        if name not in convertible and getattr(source, name) != getattr(target, name):
            raise ValueError(
                f"the layouts differ in {name} ({getattr(source, name)!r} vs "
                f"{getattr(target, name)!r}): only the rank split and the block size of "
                "vLLM's CPU pages can be converted"
            )


__all__ = ["check_convertible", "head_rows", "rank_heads", "reshard", "tp_layout"]
