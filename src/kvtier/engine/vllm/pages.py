"""vLLM's paged KV as kvtier objects: the layout, and moving pages in bulk.

vLLM 0.32 gives every attention layer one tensor ``[num_blocks, kv_heads,
block_size, 2 * head_dim]`` (one block of one layer is a contiguous *page*).
How K and V are packed inside a page is the attention backend's business: on
CPU it depends on the instruction set (``amx``, ``vec``, ...), on CUDA on the
KV-cache layout. So kvtier never looks inside a page: an object (one chunk of
one rank) is ``[num_layers][blocks_per_chunk][page]``, and ``engine_format``
names the packing in the layout's ``format``, which is in the namespace: pages
are only read back by an engine that packs them the same way.

An MLA model (DeepSeek-V2/V3-class) caches one latent per token and layer
(``kv_lora_rank`` + ``qk_rope_head_dim`` values, 576 for DeepSeek): a page is
``[block_size][latent]`` rows, the same on every TP rank. Its layout is of
kind ``"latent"`` with one rank whatever the TP size, so a chunk is stored
once (by rank 0, ``ClientPool.replica``) and loaded by every rank of any TP
size; its format names the MLA backend (``vllm-cpu-cpu_mla-bs16``).

``PagedKV`` holds the registered tensors and copies pages between blocks and
object buffers with bulk tensor operations: ``index_select`` (on CPU straight
into the arena) and ``index_copy_``, one per layer. On a GPU the pages go
through a pinned host buffer with non-blocking copies; the copy into the arena
waits on an event recorded after them, and a load waits for its copies before
attention can read the blocks.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtier.layout import KVLayout

KV_DTYPES = {
    "auto": None,
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def engine_format(vllm_config: Any) -> str:
    """How this engine packs a page, e.g. ``vllm-cpu-amx-bs128``."""
    from vllm.platforms import current_platform

    cache = vllm_config.cache_config
    device = current_platform.device_type
    if vllm_config.model_config.use_mla:
        packing = _mla_backend(vllm_config, device)
    elif device == "cpu":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        packing = _get_attn_isa(
            vllm_config.model_config.dtype,
            cache.block_size,
            vllm_config.model_config.get_head_size(),
            cache.cache_dtype,
        )
    else:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        packing = str(get_kv_cache_layout())
    return f"vllm-{device}-{packing}-bs{cache.block_size}"


def _mla_backend(vllm_config: Any, device: str) -> str:
    """The MLA backend vLLM 0.32 picks, by its own rule: on CPU, AMX_MLA where
    the CPU has AMX tiles unless CPU_MLA is asked for (their pages have not
    been checked to match, so they are different formats); elsewhere every
    MLA backend keeps plain ``[block][latent]`` rows in the model's dtype."""
    if device != "cpu":
        return "mla"
    import platform

    asked = getattr(vllm_config.attention_config.backend, "name", None)
    amx = platform.machine() in ("x86_64", "AMD64") and torch.cpu._is_amx_tile_supported()
    return "amx_mla" if amx and asked != "CPU_MLA" else "cpu_mla"


def latent_format(page_format: str) -> bool:
    """Whether ``page_format`` (``engine_format``'s) holds MLA latents."""
    parts = page_format.split("-")
    return len(parts) > 2 and parts[2].endswith("mla")


def engine_kv_layout(vllm_config: Any, chunk_size: int) -> KVLayout:
    """The one place a vLLM engine's KV becomes a ``KVLayout`` (per TP rank,
    except MLA's: one for all ranks); ValueError for what the connector does
    not handle."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    if model.use_mla and cache.cache_dtype != "auto":
        raise ValueError(
            f"the kvtier connector keeps MLA latents in the model's dtype only; kv_cache_dtype "
            f"{cache.cache_dtype} packs them in a format it does not handle: use 'auto'"
        )
    if parallel.pipeline_parallel_size != 1:
        raise ValueError("the kvtier connector does not handle pipeline parallelism yet")
    if chunk_size % cache.block_size:
        raise ValueError(
            f"the cache server's chunk size {chunk_size} is not a multiple of the block size "
            f"{cache.block_size}; restart it with --chunk-size a multiple of {cache.block_size}"
        )
    if cache.cache_dtype not in KV_DTYPES:
        raise ValueError(f"the kvtier connector does not handle kv_cache_dtype {cache.cache_dtype}")
    dtype = KV_DTYPES[cache.cache_dtype] or str(model.dtype).removeprefix("torch.")
    if model.use_mla:
        return KVLayout(
            num_layers=model.get_num_layers(parallel),
            kv_heads=1,
            head_dim=model.get_head_size(),  # kv_lora_rank + qk_rope_head_dim
            dtype=dtype,
            tokens_per_chunk=chunk_size,
            kind="latent",
            format=engine_format(vllm_config),
        )
    return KVLayout(
        num_layers=model.get_num_layers(parallel),
        kv_heads=model.get_num_kv_heads(parallel),
        head_dim=model.get_head_size(),
        dtype=dtype,
        tokens_per_chunk=chunk_size,
        num_ranks=parallel.tensor_parallel_size,
        format=engine_format(vllm_config),
    )


def layer_index(name: str) -> int:
    """The layer number in a name like ``model.layers.7.self_attn.attn``."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    if not numbers:
        raise ValueError(f"no layer index in the KV cache name {name!r}")
    return numbers[-1]


class PagedKV:
    """The engine's KV tensors, in layer order, as pages of bytes."""

    def __init__(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVLayout, block_size: int
    ) -> None:
        tensors: dict[int, torch.Tensor] = {}
        for name in sorted(kv_caches, key=layer_index):
            tensor = kv_caches[name]
            if all(t.data_ptr() != tensor.data_ptr() for t in tensors.values()):  # shared KV
                tensors[layer_index(name)] = tensor
        self.layers = [tensors[i] for i in sorted(tensors)]
        if len(self.layers) != layout.num_layers:
            raise ValueError(
                f"vLLM registered {len(self.layers)} KV tensors; the layout has "
                f"{layout.num_layers} layers"
            )
        first = self.layers[0]
        self.device = first.device
        self.block_size = block_size
        self.blocks_per_chunk = layout.tokens_per_chunk // block_size
        self.page_bytes = first[0].numel() * first.element_size()
        expected = layout.object_bytes() // (layout.num_layers * self.blocks_per_chunk)
        for tensor in self.layers:
            if not tensor.is_contiguous() or tensor[0].numel() * tensor.element_size() != expected:
                raise ValueError(
                    f"a KV tensor {tuple(tensor.shape)} ({tensor.dtype}) does not hold contiguous "
                    f"pages of {expected} bytes, as the layout {layout} says"
                )
        # byte views [num_blocks, page_bytes] of each layer
        self.pages = [t.view(torch.uint8).view(t.shape[0], -1) for t in self.layers]
        self.object_bytes = layout.object_bytes()
        self._pinned: torch.Tensor | None = None

    def copy_out(self, block_ids: Sequence[int], dst: npt.NDArray[np.uint8]) -> None:
        """Write the pages of one chunk's blocks (``blocks_per_chunk`` of them, in
        order) into an object's bytes ``dst``: ``[layers][block][page]``."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        out = torch.from_numpy(dst).view(len(self.pages), self.blocks_per_chunk, -1)
        if self.device.type == "cpu":
            for layer, pages in enumerate(self.pages):
                torch.index_select(pages, 0, ids, out=out[layer])  # straight into the arena
            return
        host = self._host_buffer(out.numel()).view(out.shape)
        for layer, pages in enumerate(self.pages):
            host[layer].copy_(pages.index_select(0, ids), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # the forward's writes, then these copies, have landed
        out.copy_(host)

    def values(self, chunk: npt.NDArray[np.uint8]) -> torch.Tensor:
        """An object's bytes as the engine's KV values, one row per layer."""
        return torch.from_numpy(chunk).view(self.layers[0].dtype).view(len(self.layers), -1)

    def scatter(self, chunk: npt.NDArray[np.uint8], blocks: Mapping[int, int]) -> None:
        """Write pages of one object into the engine: ``blocks`` maps a block's
        position in the chunk to the engine block it goes to."""
        with warnings.catch_warnings():  # frames from the wire are read-only: only read them
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(chunk).view(len(self.pages), self.blocks_per_chunk, -1)
        positions = sorted(blocks)
        ids = torch.tensor([blocks[j] for j in positions], dtype=torch.long, device=self.device)
        picked = source[:, positions]
        if self.device.type != "cpu":
            host = self._host_buffer(picked.numel()).view(picked.shape)
            host.copy_(picked)
            picked = host.to(self.device, non_blocking=True)
        for layer, pages in enumerate(self.pages):
            pages.index_copy_(0, ids, picked[layer])
        if self.device.type != "cpu":
            torch.cuda.current_stream().synchronize()  # visible before attention reads it

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        if self._pinned is None or self._pinned.numel() < nbytes:
            self._pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._pinned[:nbytes]


def write_tokens(
    pages: torch.Tensor,
    block_ids: Sequence[int],
    keys: torch.Tensor,
    values: torch.Tensor,
    block: int,
) -> None:
    """Write the K and V of tokens ``0 .. n-1`` (``[kv_heads][n][head_dim]``)
    into one layer of vLLM-CPU ``vec``/``vec16`` pages (``[blocks][kv_heads]
    [block x 2 x head_dim]``, the packing ``kvtier.layout.repage`` describes):
    token ``t`` into block ``block_ids[t // block]`` at slot ``t % block``;
    slots past ``n`` in the last block are left as they are."""
    heads, tokens, dim = keys.shape
    blocks = pages.shape[0]
    paired = pages.view(blocks, heads, 2, dim * block)
    k_t = paired[:, :, 0].view(blocks, heads, dim, block)  # K transposed, per page
    v = paired[:, :, 1].view(blocks, heads, block, dim)
    positions = torch.arange(tokens)
    where = torch.tensor(list(block_ids), dtype=torch.long)[positions // block]
    slot = positions % block
    k_t[where, :, :, slot] = keys.transpose(0, 1).to(pages.dtype)
    v[where, :, slot, :] = values.transpose(0, 1).to(pages.dtype)
