"""vLLM's paged KV as kvtier objects: the layout, and moving pages in bulk.

vLLM 0.32 views every attention layer's KV as one logical tensor ``[num_blocks,
kv_heads, block_size, C]`` over a shared allocation, with K and V packed in
the last dimension (``C = 2 * head_dim``: K then V, as every dense backend
splits it) or, for MLA, one latent per token (``C = kv_lora_rank +
qk_rope_head_dim``, 576 for DeepSeek). Where the bytes lie is the KV-cache
layout's business (``vllm.v1.kv_cache_layout.KVCacheLayout``): a layer's
blocks may be contiguous pages (``LBHNC``, vLLM-CPU's only layout) or strided
across layers (``BL*``) or heads (``LHBNC``, ``BHLNC``), and inside a block
the heads come before the tokens (``HND``) or after them (``NHD``).

kvtier copies one block of one layer as one *page*: its ``[H, N, C]`` bytes in
the page order (``HND`` or ``NHD``), whatever the strides around it. An object
(one chunk of one rank) is ``[num_layers][blocks_per_chunk][page]``, and
``engine_format`` names what a page holds in the layout's ``format``, which
is in the namespace: pages are only read back by an engine that packs them
the same way. On CPU the format names the attention kernel's packing (``amx``,
``vec``, ...); on CUDA the page order (``vllm-cuda-NHD-bs16``), which is all
that differs between FlashAttention, FlashInfer, Triton and FlexAttention
pages in the model's dtype or fp8; MLA's names its backend
(``vllm-cpu-cpu_mla-bs16``, ``vllm-cuda-mla-bs64``). A tensor whose pages are
not what its format says (another order, kernel blocks smaller than vLLM's
blocks, padded or quantized contents) is refused when it is registered,
naming its shape and strides.

An MLA layout is of kind ``"latent"`` with one rank whatever the TP size (the
latent is the same on every rank), so a chunk is stored once (by rank 0,
``ClientPool.replica``) and loaded by every rank of any TP size.

``PagedKV`` holds the registered tensors and copies pages between blocks and
object buffers with bulk tensor operations: ``index_select`` (on CPU straight
into the arena) and ``index_copy_``, one per layer. On a GPU the copies run on
a side stream through pinned host buffers (one per direction): a store's
copies wait on an event recorded after the forward (``ready``), and a load's
landing is an event the engine's stream waits on, so the step never
synchronizes the device.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtier.engine.vllm.groups import NULL_BLOCK, CacheGroups
from kvtier.layout import KVLayout, windowed

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
        packing = layout_page_order(cache.get_resolved_kv_cache_layout())
    return f"vllm-{device}-{packing}-bs{cache.block_size}"


def layout_page_order(layout: Any) -> str:
    """The order of a block's heads, tokens and values in memory under one of
    vLLM's ``KVCacheLayout`` members: ``NHD`` where the tokens are outside the
    heads, else ``HND``."""
    inside = [dim for dim in layout.layer_view_order if dim != 0]  # the block's own dims
    return "NHD" if inside.index(2) < inside.index(1) else "HND"


def page_order(page_format: str) -> str:
    """The page order ``page_format`` stands for: ``NHD`` where it says so,
    else ``HND`` (vLLM-CPU's pages, and MLA's, which have one head)."""
    return "NHD" if "NHD" in page_format.split("-") else "HND"


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


def engine_kv_layout(
    vllm_config: Any, chunk_size: int, groups: CacheGroups | None = None
) -> KVLayout:
    """The one place a vLLM engine's KV becomes a ``KVLayout`` (per TP rank,
    except MLA's: one for all ranks; a sliding-window model's window layers
    keep what a hit needs, ``groups``); ValueError for what the connector
    does not handle."""
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
    layout = KVLayout(
        num_layers=model.get_num_layers(parallel),
        kv_heads=model.get_num_kv_heads(parallel),
        head_dim=model.get_head_size(),
        dtype=dtype,
        tokens_per_chunk=chunk_size,
        num_ranks=parallel.tensor_parallel_size,
        format=engine_format(vllm_config),
    )
    if groups is not None and groups.window:
        layout = windowed(layout, groups.window_layers(), groups.window_tokens())
    return layout


def layer_index(name: str) -> int:
    """The layer number in a name like ``model.layers.7.self_attn.attn``."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    if not numbers:
        raise ValueError(f"no layer index in the KV cache name {name!r}")
    return numbers[-1]


class PagedKV:
    """The engine's KV tensors, in layer order, as pages of bytes.

    An object is each layer's kept pages in layer order: every block of the
    chunk, or a window layer's last ``window_tokens // block_size``
    (``CacheGroups``). Block ids come one list per KV-cache group, and a layer
    is only read or written with its own group's."""

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layout: KVLayout,
        block_size: int,
        groups: CacheGroups | None = None,
    ) -> None:
        groups = groups or CacheGroups({}, (0,), block_size)
        names = owners(kv_caches, groups)
        self.layers = [kv_caches[name] for name in names]
        if len(self.layers) != layout.num_layers:
            raise ValueError(
                f"vLLM registered {len(self.layers)} KV tensors; the layout has "
                f"{layout.num_layers} layers"
            )
        self.device = self.layers[0].device
        self.block_size = block_size
        self.blocks_per_chunk = layout.tokens_per_chunk // block_size
        self.layer_groups = [groups.layer_groups.get(name, 0) for name in names]
        window_blocks = layout.window_tokens // block_size if layout.window_layers else 0
        self.kept = [
            range(self.blocks_per_chunk - window_blocks, self.blocks_per_chunk)
            if window_blocks and groups.windows[g]
            else range(self.blocks_per_chunk)
            for g in self.layer_groups
        ]
        kept_pages = sum(len(kept) for kept in self.kept)
        if layout.window_layers != sum(1 for k in self.kept if len(k) < self.blocks_per_chunk):
            raise ValueError(
                f"the layout {layout} has {layout.window_layers} window layers; vLLM's KV-cache "
                f"groups {groups.windows} give this engine another count"
            )
        page_bytes = layout.object_bytes() // kept_pages
        order = page_order(layout.format)
        # byte views [num_blocks, ., ., bytes] of each layer, a block's page in `order`
        self.pages = [page_view(t, order, page_bytes, layout.format) for t in self.layers]
        self.page_bytes = page_bytes
        self.object_bytes = layout.object_bytes()
        self._cuda = _CudaCopies() if self.device.type == "cuda" else None
        # the same byte views as numpy arrays, on CPU (they share the engine's memory)
        self._host_pages = [p.numpy() for p in self.pages] if self._cuda is None else []

    def ready(self) -> Any:
        """A mark, on the engine's stream, that this step's forward has written
        its pages (an event on a GPU, None on CPU): a later ``copy_out``
        (from any thread) copies after it."""
        return self._cuda.ready() if self._cuda is not None else None

    def storable(self, block_ids: Sequence[Sequence[int]]) -> bool:
        """Whether every page a chunk keeps is in a real block (``block_ids``:
        its blocks, per group): a window that slid past one lost it."""
        return all(
            block_ids[g][j] != NULL_BLOCK
            for g, kept in zip(self.layer_groups, self.kept, strict=True)
            for j in kept
        )

    def copy_out(
        self,
        block_ids: Sequence[Sequence[int]],
        dst: npt.NDArray[np.uint8],
        ready: Any = None,
        beside_forward: bool = False,
    ) -> None:
        """Write the pages one chunk keeps of its blocks (``blocks_per_chunk``
        of them per group, in order) into an object's bytes ``dst``. On a GPU
        the copies start after ``ready`` (``ready()``'s; now if None). On CPU a
        copy ``beside_forward`` (the save thread's) runs on its own thread
        alone: a torch op there would start an OpenMP team of its own beside
        the engine's, on the same cores."""
        out = torch.from_numpy(dst)
        ids: dict[tuple[int, range], list[int]] = {}  # per group and kept pages: the blocks
        for g, kept in zip(self.layer_groups, self.kept, strict=True):
            ids.setdefault((g, kept), [block_ids[g][j] for j in kept])
        if self._cuda is None and beside_forward:
            for layer, segment in self._segments(out):
                index = ids[self.layer_groups[layer], self.kept[layer]]
                np.take(self._host_pages[layer], index, axis=0, out=segment.numpy())
            return
        rows = {key: torch.tensor(index, device=self.device) for key, index in ids.items()}
        copies = [
            (self.pages[layer], rows[self.layer_groups[layer], self.kept[layer]], segment)
            for layer, segment in self._segments(out)
        ]
        if self._cuda is None:
            for pages, blocks, segment in copies:
                torch.index_select(pages, 0, blocks, out=segment)  # straight into the arena
            return
        self._cuda.gather(copies, out, ready)

    def values(self, chunk: npt.NDArray[np.uint8]) -> torch.Tensor:
        """An object's bytes as the engine's KV values, one row per layer
        (one row in all where layers keep different numbers of pages)."""
        rows = len(self.layers) if len({len(k) for k in self.kept}) == 1 else 1
        return torch.from_numpy(chunk).view(self.layers[0].dtype).view(rows, -1)

    def unfillable(self, blocks: Sequence[Mapping[int, int]]) -> bool:
        """Whether a load into ``blocks`` (per group: a block's position in the
        chunk -> the engine block) needs a page the chunk's object does not keep."""
        return any(
            not set(blocks[g]) <= set(kept)
            for g, kept in zip(self.layer_groups, self.kept, strict=True)
        )

    def scatter(self, chunk: npt.NDArray[np.uint8], blocks: Sequence[Mapping[int, int]]) -> None:
        """Write pages of one object into the engine: ``blocks`` maps, per
        group, a block's position in the chunk to the engine block it goes to
        (positions it leaves out are the engine's own, or not needed). On a
        GPU the engine's stream waits for them (``landed`` waits on the host)."""
        with warnings.catch_warnings():  # frames from the wire are read-only: only read them
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(chunk)
        picks: dict[tuple[int, range], tuple[torch.Tensor, list[int]]] = {}
        for g, kept in zip(self.layer_groups, self.kept, strict=True):  # once per group
            if (g, kept) not in picks:
                positions = sorted(j for j in blocks[g] if j in kept)
                index = torch.tensor([blocks[g][j] for j in positions], device=self.device)
                picks[g, kept] = index, [j - kept.start for j in positions]
        copies = []
        for layer, segment in self._segments(source):
            index, rows = picks[self.layer_groups[layer], self.kept[layer]]
            if rows:
                copies.append((self.pages[layer], index, segment[rows]))
        if self._cuda is not None:
            self._cuda.put(copies)
            return
        for pages, targets, picked in copies:
            pages.index_copy_(0, targets, picked)

    def landed(self) -> None:
        """Wait (on the host) until every page ``scatter`` wrote has landed:
        for loads the engine's stream does not wait on (another thread's)."""
        if self._cuda is not None:
            self._cuda.landed()

    def _segments(self, data: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Each layer's part of an object's bytes, as ``[kept pages, page...]``."""
        page_shape = self.pages[0].shape[1:]
        parts, offset = [], 0
        for layer, kept in enumerate(self.kept):
            size = len(kept) * self.page_bytes
            parts.append((layer, data[offset : offset + size].view(len(kept), *page_shape)))
            offset += size
        return parts


def owners(kv_caches: Mapping[str, torch.Tensor], groups: CacheGroups) -> list[str]:
    """The layers whose KV an object holds, in layer order: those of vLLM's
    KV-cache groups (whose tensors may overlay each other's); without groups,
    one layer per tensor (a layer sharing another's KV is not stored twice)."""
    if groups.layer_groups:
        return sorted((n for n in kv_caches if n in groups.layer_groups), key=layer_index)
    names: dict[int, str] = {}
    for name in sorted(kv_caches, key=layer_index):
        tensor = kv_caches[name]
        if all(kv_caches[other].data_ptr() != tensor.data_ptr() for other in names.values()):
            names[layer_index(name)] = name
    return [names[i] for i in sorted(names)]


def page_view(tensor: torch.Tensor, order: str, page_bytes: int, page_format: str) -> torch.Tensor:
    """One layer's ``[B, H, N, C]`` tensor as bytes ``[B, ., ., C bytes]`` with a
    block's dims in ``order`` (``HND``: ``[B, H, N, .]``; ``NHD``: ``[B, N, H, .]``);
    ValueError naming the shape and strides when its pages are not pages of
    ``page_bytes`` bytes in that order."""
    shape, strides = tuple(tensor.shape), tensor.stride()

    def refuse(why: str) -> ValueError:
        return ValueError(
            f"the kvtier connector cannot copy pages of format {page_format} from a KV tensor "
            f"{shape} ({tensor.dtype}, strides {strides}): {why}"
        )

    if tensor.dim() != 4 or tensor.stride(-1) != 1:
        raise refuse("it is not [blocks, heads, tokens, values] with the values contiguous")
    _, heads, tokens, _ = shape
    if heads > 1 and tokens > 1 and (strides[1] > strides[2]) != (order == "HND"):
        actual = "HND" if strides[1] > strides[2] else "NHD"
        raise refuse(f"its blocks are {actual} inside, the format says {order}")
    if tensor[0].numel() * tensor.element_size() != page_bytes:
        raise refuse(
            f"a block holds {tensor[0].numel() * tensor.element_size()} bytes, the layout's pages "
            f"{page_bytes} (kernel blocks smaller than vLLM's, or padded or quantized values)"
        )
    paged = tensor.view(torch.uint8)
    return paged if order == "HND" else paged.transpose(1, 2)


PageCopy = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a layer's pages, block ids, bytes


class _CudaCopies:
    """Page copies on a GPU: a side stream, a pinned host buffer per direction
    (each reused only once its last copy has left it), and events."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()
        self._out = _Pinned()
        self._in = _Pinned()
        self._landing: Any = None  # the last load's event

    def ready(self) -> Any:
        event = torch.cuda.Event()
        event.record()  # on the engine's stream, after the forward's writes
        return event

    def gather(self, copies: list[PageCopy], out: torch.Tensor, ready: Any) -> None:
        ready = ready if ready is not None else self.ready()
        with self._out.lock:
            host = self._out.take(out.numel())
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                offset = 0
                for pages, index, segment in copies:
                    part = host[offset : offset + segment.numel()].view(segment.shape)
                    part.copy_(pages.index_select(0, index), non_blocking=True)
                    offset += segment.numel()
                done = torch.cuda.Event()
                done.record(self.stream)
            done.synchronize()  # this thread waits on the copies' event, not the device
            out.copy_(host)

    def put(self, copies: list[PageCopy]) -> None:
        with self._in.lock:
            host = self._in.take(sum(rows.numel() for _, _, rows in copies))
            parts, offset = [], 0
            for _, _, rows in copies:
                part = host[offset : offset + rows.numel()].view(rows.shape)
                part.copy_(rows)
                parts.append(part)
                offset += rows.numel()
            with torch.cuda.stream(self.stream):
                for (pages, index, _), part in zip(copies, parts, strict=True):
                    pages.index_copy_(0, index, part.to(pages.device, non_blocking=True))
                done = torch.cuda.Event()
                done.record(self.stream)
            self._in.in_flight = self._landing = done
        torch.cuda.current_stream().wait_event(done)  # attention reads the blocks after it

    def landed(self) -> None:
        if self._landing is not None:
            self._landing.synchronize()


class _Pinned:
    """A pinned host buffer, grown as needed, and the event of its last copy."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight: Any = None
        self._buffer: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        if self.in_flight is not None:
            self.in_flight.synchronize()  # its last copy has left it
            self.in_flight = None
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._buffer[:nbytes]


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
