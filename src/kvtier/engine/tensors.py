"""Object bytes and transformers caches as torch tensors, for the
transformers integration (``kvtier.engine.hf``, ``kvtier.engine.segments``).

An object (one chunk of one rank) is ``[num_layers][K, V][kv_heads]
[tokens_per_chunk][head_dim]`` in the model's dtype, C order: the same for
every engine, so engines can share KV.
"""

from __future__ import annotations

import warnings

import numpy as np
import numpy.typing as npt
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvtier.engine.link import CacheLink
from kvtier.layout import KVLayout


def object_tensor(
    view: npt.NDArray[np.uint8], layout: KVLayout, dtype: torch.dtype
) -> torch.Tensor:
    """An object's bytes as ``[layers, 2, kv_heads, tokens_per_chunk, head_dim]``
    (a view); ValueError for bytes of another size."""
    if view.nbytes != layout.object_bytes():
        raise ValueError(
            f"an object has {view.nbytes} bytes; the layout says {layout.object_bytes()}"
        )
    with warnings.catch_warnings():  # frames from the wire are read-only: only read them
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(view)
    return data.view(dtype).view(
        layout.num_layers, 2, layout.kv_heads, layout.tokens_per_chunk, layout.head_dim
    )


def cache_layers(cache: DynamicCache, layout: KVLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V, ``[1, kv_heads, tokens, head_dim]``; ValueError
    for a cache that does not hold them so."""
    expected = (1, layout.kv_heads, layout.head_dim)
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise ValueError(f"a cache layer ({type(layer).__name__}) holds no K/V tensors")
        shape = tuple(keys.shape)
        if (shape[0], shape[1], shape[3]) != expected or values.shape != keys.shape:
            raise ValueError(
                f"the model's cache holds K {shape} / V {tuple(values.shape)}; "
                f"kv_layout expected [1, {layout.kv_heads}, tokens, {layout.head_dim}]"
            )
        layers.append((keys, values))
    return layers


def read_chunks(
    link: CacheLink,
    request_id: str,
    chunks: int,
    tokens: int,
    layout: KVLayout,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """The first ``tokens`` tokens of the request's hit chunks ``[0, chunks)``
    as ``[layers, 2, 1, kv_heads, tokens, head_dim]`` (the link releases the
    chunks); None if the load failed or an object has the wrong size (a
    miss, never wrong KV)."""
    c = layout.tokens_per_chunk
    kv = torch.empty(
        (layout.num_layers, 2, 1, layout.kv_heads, tokens, layout.head_dim), dtype=dtype
    )

    def consume(i: int, view: npt.NDArray[np.uint8]) -> None:
        end = min(tokens, (i + 1) * c)
        chunk = object_tensor(view, layout, dtype)
        kv[:, :, 0, :, i * c : end].copy_(chunk[:, :, :, : end - i * c])

    try:
        return kv if link.load(request_id, 0, chunks, consume) else None
    except ValueError:
        return None


def dynamic_cache(keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    """A ``DynamicCache`` holding these layers' K and V (adopted, not copied)."""
    cache = DynamicCache()
    for n, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k[:, :, :0], v[:, :, :0], n)  # creates the layer, copies nothing
        layer = cache.layers[n]
        if isinstance(layer, DynamicLayer):
            layer.keys, layer.values = k, v
        else:
            cache.update(k, v, n)
    return cache


__all__ = ["cache_layers", "dynamic_cache", "object_tensor", "read_chunks"]
