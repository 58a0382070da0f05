"""``PageFormat``: what one SGLang host page is, as a kvtier layout, and the
kvtier chunk hash of each SGLang page key.

SGLang names a page by a SHA-256 chain over its tokens (seeded by the
request's ``extra_key``/``cache_salt``), with no model, layout or rank in it.
kvtier's key for that page is ``blake3(namespace root || SGLang key)``, where
the namespace (``kvtier.keys.namespace``) carries the model, revision, the
tenant's salt and the layout digest; the layout carries the page size, the
host layout (``format`` "sglang-layer_first" / "sglang-page_first"...), the
dtype, KV heads per rank, head dim, layers and the TP split (MLA: one rank,
a single copy that every TP rank reads). So an SGLang page is only ever read
by a reader of the same model, tenant and byte layout; vLLM's pages, in
kvtier's canonical order or vLLM's own format, never share a key with it.

One SGLang page is one kvtier object: the cache server's chunk size must be
SGLang's page size (``kvtier serve --chunk-size PAGE_SIZE``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from kvtier.engine.identity import ModelIdentity
from kvtier.layout import DTYPE_BYTES, KVLayout


@dataclass(frozen=True, slots=True)
class PageFormat:
    """One host page of an SGLang pool on one TP rank.

    ``layout``: the kvtier layout of one page (``tokens_per_chunk`` = page
    size). ``rank``: the kvtier rank whose objects this engine reads and
    writes; ``writer``: whether it writes them (an MLA replica rank reads
    rank 0's copy and writes nothing). ``page_bytes``: one flat page."""

    layout: KVLayout
    rank: int
    writer: bool
    page_bytes: int

    @classmethod
    def of(cls, host_pool: Any, tp_rank: int, tp_size: int, rank_replicated: bool) -> PageFormat:
        """The format of ``host_pool`` (SGLang's ``HostKVCache``). ValueError,
        naming the pool's layout or dtype, for a page kvtier cannot describe
        (its flat page is not layers x page size x heads x head dim)."""
        dtype = str(host_pool.dtype).removeprefix("torch.")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"kvtier backend: host pool dtype {dtype!r} is not supported")
        page = host_pool.get_dummy_flat_data_page()
        page_bytes = int(page.numel()) * int(page.element_size())
        page_size, layers = int(host_pool.page_size), int(host_pool.layer_num)
        fmt = f"sglang-{host_pool.layout}"
        if rank_replicated:
            per_token = int(page.numel()) // (layers * page_size)
            layout = KVLayout(layers, 1, per_token, dtype, page_size, "latent", 1, fmt)
            rank, writer = 0, tp_rank == 0
        else:
            heads, head_dim = int(host_pool.head_num), int(host_pool.head_dim)
            layout = KVLayout(layers, heads, head_dim, dtype, page_size, "kv", tp_size, fmt)
            rank, writer = tp_rank, True
        if layout.object_bytes() != page_bytes:
            raise ValueError(
                f"kvtier backend: an SGLang page of layout {host_pool.layout!r} is {page_bytes} "
                f"bytes, not the {layout.object_bytes()} of {layout}; this host pool is not "
                "supported"
            )
        return cls(layout, rank, writer, page_bytes)


@dataclass(frozen=True, slots=True)
class PageKeys:
    """kvtier chunk hashes of SGLang page keys in one namespace."""

    root: bytes  # blake3 of the namespace's canonical JSON

    @classmethod
    def of(cls, identity: ModelIdentity, layout: KVLayout) -> PageKeys:
        return cls(blake3(identity.namespace(layout).canonical_json()).digest())

    def hashes(self, keys: Sequence[str]) -> list[bytes]:
        """One 32-byte chunk hash per SGLang key, in order."""
        return [blake3(self.root + key.encode()).digest() for key in keys]
