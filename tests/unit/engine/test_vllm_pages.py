"""``PagedKV`` on the KV tensors of every vLLM 0.32 page layout, built by vLLM's own
allocator (``get_kv_cache_config_from_groups`` and ``allocate_kv_cache``, the
functions its GPU workers call) on CPU tensors of the exact shapes and strides
a GPU engine gets: dense attention in the model's dtype and in fp8, and MLA's
latents, under each ``KVCacheLayout``. A smoke test repeats the round trip on
CUDA tensors where a GPU is present."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.attention.backends.utils import get_flashinfer_layout_string
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvtier.engine.vllm.groups import CacheGroups
from kvtier.engine.vllm.pages import PagedKV, engine_format, layout_page_order
from kvtier.layout import KVLayout, windowed

pytestmark = pytest.mark.engine  # needs vLLM (no engine runs)

LAYERS = 3
BLOCK = 16
CHUNK = 4 * BLOCK
NUM_BLOCKS = 12
# name: (vLLM's spec of a layer, kvtier's layout of a chunk, the layout's kind)
SPECS: dict[str, tuple[Any, KVLayout]] = {
    "dense-bf16": (
        FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=8, dtype=torch.bfloat16),
        KVLayout(LAYERS, 4, 8, "bfloat16", CHUNK),
    ),
    "dense-fp8": (
        FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float8_e4m3fn
        ),
        KVLayout(LAYERS, 2, 16, "float8_e4m3fn", CHUNK),
    ),
    "mla": (
        MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
        KVLayout(LAYERS, 1, 576, "bfloat16", CHUNK, kind="latent"),
    ),
}


def vllm_caches(
    spec: Any, layout: KVCacheLayout, device: str = "cpu", kernel_block: int | None = None
) -> dict[str, torch.Tensor]:
    """The layers' KV tensors as a vLLM worker allocates them, filled with noise."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    config = SimpleNamespace(
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=None,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
    )
    memory = spec.page_size_bytes * LAYERS * NUM_BLOCKS
    kv_cache_config = get_kv_cache_config_from_groups(
        config, [KVCacheGroupSpec(names, spec)], memory
    )
    kernel_blocks = None if kernel_block is None else [kernel_block]
    caches = allocate_kv_cache(kv_cache_config, torch.device(device), layout, kernel_blocks)
    backing = caches[names[0]].untyped_storage()
    noise = torch.randint(0, 120, (backing.nbytes(),), dtype=torch.uint8)  # finite in fp8 too
    torch.empty(0, dtype=torch.uint8, device=device).set_(backing).copy_(noise)
    return caches


def paged_kv(caches: dict[str, torch.Tensor], chunk: KVLayout, layout: KVCacheLayout) -> PagedKV:
    page_format = f"vllm-cuda-{layout_page_order(layout)}-bs{BLOCK}"
    return PagedKV(caches, dataclasses.replace(chunk, format=page_format), BLOCK)


def test_page_orders_are_vllms_own_names_for_the_layouts() -> None:
    for layout in KVCacheLayout:
        inside = "HND" if layout is KVCacheLayout.LHBNC else get_flashinfer_layout_string(layout)
        assert layout_page_order(layout) == inside, layout.name


@pytest.mark.parametrize(
    ("layout", "mla", "page_format"),
    [
        (KVCacheLayout.LBNHC, False, "vllm-cuda-NHD-bs16"),
        (KVCacheLayout.BHLNC, False, "vllm-cuda-HND-bs16"),
        (KVCacheLayout.LBNHC, True, "vllm-cuda-mla-bs16"),
    ],
)
def test_a_gpu_engines_format_names_its_page_order(
    layout: KVCacheLayout, mla: bool, page_format: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cuda")
    config = SimpleNamespace(
        model_config=SimpleNamespace(use_mla=mla),
        cache_config=SimpleNamespace(block_size=BLOCK, get_resolved_kv_cache_layout=lambda: layout),
    )
    assert engine_format(config) == page_format


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
@pytest.mark.parametrize("kind", list(SPECS))
def test_pages_round_trip_byte_exact_in_every_layout(layout: KVCacheLayout, kind: str) -> None:
    spec, chunk = SPECS[kind]
    caches = vllm_caches(spec, layout)
    tensors = list(caches.values())
    shape = (NUM_BLOCKS, spec.num_kv_heads, BLOCK)
    assert all(tuple(t.shape[:3]) == shape for t in tensors)
    paged = paged_kv(caches, chunk, layout)
    before = [t.view(torch.uint8).clone() for t in tensors]
    stored = np.zeros(paged.object_bytes, np.uint8)
    paged.copy_out([[7, 2, 5, 0]], stored)
    beside = np.zeros_like(stored)
    paged.copy_out([[7, 2, 5, 0]], beside, beside_forward=True)  # the save thread's copy
    assert np.array_equal(beside, stored)
    paged.scatter(stored, [{0: 1, 1: 3, 2: 4, 3: 6}])
    for layer, tensor in enumerate(tensors):
        after = tensor.view(torch.uint8)
        for source, target in ((7, 1), (2, 3), (5, 4), (0, 6)):
            assert torch.equal(after[target], before[layer][source])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (1, 3, 4, 6)]
        assert torch.equal(after[untouched], before[layer][untouched])
    again = np.zeros_like(stored)
    paged.copy_out([[1, 3, 4, 6]], again)
    assert np.array_equal(again, stored)


@pytest.mark.parametrize("kind", ["dense-bf16", "dense-fp8"])
def test_layouts_with_one_page_order_store_the_same_bytes(kind: str) -> None:
    """A page is its block's bytes in the page order, whatever the strides
    around it: the layouts that share an order share objects (one format),
    and the two orders never do (two formats)."""
    spec, chunk = SPECS[kind]
    reference = vllm_caches(spec, KVCacheLayout.LBHNC)
    objects: dict[str, set[bytes]] = {"HND": set(), "NHD": set()}
    for layout in KVCacheLayout:
        caches = vllm_caches(spec, layout)
        for name, tensor in caches.items():
            tensor.copy_(reference[name])  # the same logical KV
        stored = np.zeros(paged_kv(caches, chunk, layout).object_bytes, np.uint8)
        paged_kv(caches, chunk, layout).copy_out([[3, 8, 1, 10]], stored)
        objects[layout_page_order(layout)].add(stored.tobytes())
    assert len(objects["HND"]) == 1 and len(objects["NHD"]) == 1
    assert objects["HND"] != objects["NHD"]


def test_pages_in_another_order_than_the_format_are_refused_by_name() -> None:
    spec, chunk = SPECS["dense-bf16"]
    caches = vllm_caches(spec, KVCacheLayout.LBNHC)
    hnd = dataclasses.replace(chunk, format=f"vllm-cuda-HND-bs{BLOCK}")
    with pytest.raises(ValueError, match=r"vllm-cuda-HND-bs16 .*strides .*NHD inside"):
        PagedKV(caches, hnd, BLOCK)


def test_kernel_blocks_smaller_than_vllms_blocks_are_refused_by_name() -> None:
    spec, chunk = SPECS["dense-bf16"]
    caches = vllm_caches(spec, KVCacheLayout.LBHNC, kernel_block=BLOCK // 2)
    with pytest.raises(ValueError, match=r"\(24, 4, 8, 16\).*kernel blocks"):
        paged_kv(caches, chunk, KVCacheLayout.LBHNC)


def test_a_tensor_that_is_not_four_dimensional_is_refused_by_name() -> None:
    _, chunk = SPECS["dense-bf16"]
    legacy = torch.zeros(2, NUM_BLOCKS, BLOCK, 4, 8, dtype=torch.bfloat16)  # K/V first
    caches = {f"model.layers.{i}.attn": legacy.clone() for i in range(LAYERS)}
    with pytest.raises(ValueError, match=r"\(2, 12, 16, 4, 8\).*not \[blocks, heads"):
        paged_kv(caches, chunk, KVCacheLayout.LBHNC)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC], ids=str)
@pytest.mark.parametrize("kind", ["dense-bf16", "mla"])
def test_pages_round_trip_on_a_gpu(layout: KVCacheLayout, kind: str) -> None:
    """The side stream, the pinned buffers and the events, on CUDA tensors."""
    spec, chunk = SPECS[kind]
    caches = vllm_caches(spec, layout, device="cuda")
    paged = paged_kv(caches, chunk, layout)
    before = [t.view(torch.uint8).cpu() for t in caches.values()]
    stored = np.zeros(paged.object_bytes, np.uint8)
    paged.copy_out([[7, 2, 5, 0]], stored, paged.ready())
    paged.scatter(stored, [{0: 1, 1: 3, 2: 4, 3: 6}])
    paged.landed()
    for layer, tensor in enumerate(caches.values()):
        after = tensor.view(torch.uint8).cpu()
        for source, target in ((7, 1), (2, 3), (5, 4), (0, 6)):
            assert torch.equal(after[target], before[layer][source])


# ------------------------------------------- sliding-window layers (hybrid groups)

HEADS, HEAD = 2, 8
WINDOW = 40  # a hit needs the last 39 tokens: 3 blocks of 16 of a chunk's 4


def hybrid_caches(window: int = WINDOW, full: Any = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """Gemma-3-style: layers 0-2 slide over ``window`` tokens, layer 3 attends
    to everything; one KV-cache group per layer, overlaying one allocation,
    as vLLM's hybrid manager groups them."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    sliding = SlidingWindowSpec(
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_size=HEAD,
        dtype=torch.float32,
        sliding_window=window,
    )
    full = full or FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
    )
    groups = [KVCacheGroupSpec([name], sliding) for name in names[:3]]
    groups.append(KVCacheGroupSpec([names[3]], full))
    config = SimpleNamespace(
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC,
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=None,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
    )
    memory = 40 * full.page_size_bytes  # 40 blocks, shared by the groups
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, memory)
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
    return kv_cache_config, caches


def hybrid_paged(caches: dict[str, torch.Tensor], kv_cache_config: Any) -> PagedKV:
    groups = CacheGroups.of(kv_cache_config, BLOCK)
    full = KVLayout(4, HEADS, HEAD, "float32", CHUNK, format=f"vllm-cpu-vec-bs{BLOCK}")
    layout = windowed(full, groups.window_layers(), groups.window_tokens())
    return PagedKV(caches, layout, BLOCK, groups)


def test_window_layers_keep_the_blocks_a_hit_at_the_chunks_end_needs() -> None:
    kv_cache_config, caches = hybrid_caches()
    groups = CacheGroups.of(kv_cache_config, BLOCK)
    assert groups.windows == (WINDOW, WINDOW, WINDOW, 0)
    assert groups.window_layers() == 3 and groups.window_tokens() == 48
    assert len({t.data_ptr() for t in caches.values()}) == 1  # the groups overlay each other
    paged = hybrid_paged(caches, kv_cache_config)
    assert [k for k in paged.kept] == [range(1, 4)] * 3 + [range(4)]
    page = HEADS * BLOCK * 2 * HEAD * 4
    assert paged.object_bytes == (3 * 3 + 4) * page  # against 16 pages stored whole


def test_each_layer_moves_with_its_own_groups_block_ids() -> None:
    """The groups' tensors are one allocation: a layer read with another
    group's block ids would read that group's KV."""
    kv_cache_config, caches = hybrid_caches()
    backing = next(iter(caches.values())).untyped_storage()
    torch.empty(0, dtype=torch.uint8).set_(backing).copy_(
        torch.randint(0, 255, (backing.nbytes(),), dtype=torch.uint8)
    )
    paged = hybrid_paged(caches, kv_cache_config)
    block_ids = [[0, 1, 2, 3], [0, 4, 5, 6], [0, 7, 8, 9], [10, 11, 12, 13]]  # 0: slid out
    assert paged.storable(block_ids)
    before = {name: t.view(torch.uint8).clone() for name, t in caches.items()}
    stored = np.zeros(paged.object_bytes, np.uint8)
    paged.copy_out(block_ids, stored)
    targets = [{1: 14, 2: 15, 3: 16}, {1: 17, 2: 18, 3: 19}, {1: 20, 2: 21, 3: 22}]
    targets.append({0: 23, 1: 24, 2: 25, 3: 26})
    assert not paged.unfillable(targets)
    paged.scatter(stored, targets)
    for layer, name in enumerate(caches):
        for position, target in targets[layer].items():
            source = block_ids[layer][position]
            after = caches[name].view(torch.uint8)[target]  # random bytes: compare bytes
            assert torch.equal(after, before[name][source]), (layer, position)
    assert not paged.storable([[0, 0, 2, 3], *block_ids[1:]])  # a kept block slid out
    assert paged.unfillable([{0: 30, 1: 14, 2: 15, 3: 16}, *targets[1:]])  # not kept


@pytest.mark.parametrize(
    ("full", "names"),
    [
        (
            ChunkedLocalAttentionSpec(
                block_size=BLOCK,
                num_kv_heads=HEADS,
                head_size=HEAD,
                dtype=torch.float32,
                attention_chunk_size=64,
            ),
            "ChunkedLocalAttentionSpec",
        ),
        (
            SlidingWindowSpec(
                block_size=BLOCK,
                num_kv_heads=HEADS,
                head_size=HEAD,
                dtype=torch.float32,
                sliding_window=2 * WINDOW,
            ),
            r"one sliding-window size, not \[40, 80\]",
        ),
    ],
)
def test_cache_groups_the_connector_cannot_hold_are_refused_by_name(full: Any, names: str) -> None:
    kv_cache_config, _ = hybrid_caches(full=full)
    with pytest.raises(ValueError, match=names):
        CacheGroups.of(kv_cache_config, BLOCK)
