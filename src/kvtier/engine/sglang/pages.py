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

Every other part of SGLang's parallel layout that changes a page's bytes is
in the format too (``EngineShard``): a pipeline stage holds its own layers
(``-pp1of2-layers14-28``: stage, stage count and the layers ``[start, start +
layer_num)`` of its host pool) and an attention context-parallel rank its own
slice of each page (``-cp1of2``). Two stages with the same layer count are
two layouts, so one never reads the other's pages. Decode context
parallelism (``dcp_size`` > 1) is refused: its pages are per-rank slices of a
wider logical page that this format does not describe.

One SGLang page is one kvtier object: the cache server's chunk size must be
SGLang's page size. ``kvtier serve --chunk-size`` is a minimum that the first
engine to register rounds up to its page (or block) size and then fixes, so
SGLang engines of another page size need a cache server of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from kvtier.engine.identity import ModelIdentity
from kvtier.layout import DTYPE_BYTES, KVLayout


@dataclass(frozen=True, slots=True)
class EngineShard:
    """Where one SGLang scheduler process sits in its engine's parallel
    layout, as SGLang's ``HiCacheStorageConfig`` states it: the parts that
    decide which bytes its host pages hold.

    ``tp_rank``/``tp_size``: the (attention) TP rank; ``rank_replicated``:
    every TP rank holds the same KV (MLA). ``pp_rank``/``pp_size``: the
    pipeline stage. ``cp_rank``/``cp_size``: the attention context-parallel
    rank (each holds its own slice of every page)."""

    tp_rank: int = 0
    tp_size: int = 1
    rank_replicated: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    @classmethod
    def of(cls, storage_config: Any) -> EngineShard:
        """The shard of SGLang's ``storage_config``. ValueError, naming SGLang's
        option, for decode context parallelism (``--dcp-size`` > 1)."""
        dcp_size = int(storage_config.dcp_size)
        if dcp_size != 1:
            raise ValueError(
                f"kvtier backend: decode context parallelism (--dcp-size {dcp_size}) is not "
                "supported: each rank's pages are a slice of a wider logical page that kvtier's "
                "page keys do not describe; run SGLang with --dcp-size 1 to use kvtier"
            )
        return cls(
            tp_rank=int(storage_config.tp_rank),
            tp_size=int(storage_config.tp_size),
            rank_replicated=bool(storage_config.is_mla_model),
            pp_rank=int(storage_config.pp_rank),
            pp_size=int(storage_config.pp_size),
            cp_rank=int(storage_config.attn_cp_rank),
            cp_size=int(storage_config.attn_cp_size),
        )

    @property
    def label(self) -> str:
        """``tp0``, ``tp1-pp1``, ``tp0-pp1-cp1``...: this shard in a client id."""
        label = f"tp{self.tp_rank}"
        if self.pp_size > 1:
            label += f"-pp{self.pp_rank}"
        if self.cp_size > 1:
            label += f"-cp{self.cp_rank}"
        return label

    def format_suffix(self, host_pool: Any) -> str:
        """What this shard adds to the page format (the layout digest): ``""``
        for one stage and one context-parallel rank, so those keys are as
        they always were. ValueError for a pipeline stage whose host pool does
        not say which layers it holds."""
        suffix = ""
        start = getattr(host_pool, "start_layer", None)
        if self.pp_size > 1 or start:
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise ValueError(
                    f"kvtier backend: pipeline stage {self.pp_rank} of {self.pp_size}: SGLang's "
                    f"host pool gives no first layer (start_layer {start!r}), so its pages "
                    "cannot be told from another stage's; run SGLang with --pp-size 1 to use kvtier"
                )
            end = start + int(host_pool.layer_num)
            suffix += f"-pp{self.pp_rank}of{self.pp_size}-layers{start}-{end}"
        if self.cp_size > 1:
            suffix += f"-cp{self.cp_rank}of{self.cp_size}"
        return suffix


@dataclass(frozen=True, slots=True)
class PageFormat:
    """One host page of an SGLang pool on one TP rank.

    ``layout``: the kvtier layout of one page (``tokens_per_chunk`` = page
    size; ``format`` names the host layout and the engine shard). ``rank``:
    the kvtier rank whose objects this engine reads and writes; ``writer``:
    whether it writes them (an MLA replica rank reads rank 0's copy and writes
    nothing). ``page_bytes``: one flat page."""

    layout: KVLayout
    rank: int
    writer: bool
    page_bytes: int

    @classmethod
    def of(cls, host_pool: Any, shard: EngineShard) -> PageFormat:
        """The format of ``host_pool`` (SGLang's ``HostKVCache``) on ``shard``.
        ValueError, naming the pool's layout or dtype, for a page kvtier cannot
        describe (its flat page is not layers x page size x heads x head dim)."""
        dtype = str(host_pool.dtype).removeprefix("torch.")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"kvtier backend: host pool dtype {dtype!r} is not supported")
        page = host_pool.get_dummy_flat_data_page()
        page_bytes = int(page.numel()) * int(page.element_size())
        page_size, layers = int(host_pool.page_size), int(host_pool.layer_num)
        fmt = f"sglang-{host_pool.layout}{shard.format_suffix(host_pool)}"
        if shard.rank_replicated:
            per_token = int(page.numel()) // (layers * page_size)
            layout = KVLayout(layers, 1, per_token, dtype, page_size, "latent", 1, fmt)
            rank, writer = 0, shard.tp_rank == 0
        else:
            heads, head_dim = int(host_pool.head_num), int(host_pool.head_dim)
            layout = KVLayout(layers, heads, head_dim, dtype, page_size, "kv", shard.tp_size, fmt)
            rank, writer = shard.tp_rank, True
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


def chunk_size_mismatch(chunk_size: int | None, page_size: int) -> str:
    """What the backend logs when the server's chunk size is not SGLang's
    page size. ``--chunk-size PAGE`` on the server alone does not help when
    another engine fixed the size: the option is a minimum, rounded up to the
    page or block size of the first engine that registers and then frozen; what
    helps is a server whose chunk size comes out as this page size."""
    return (
        f"kvtier backend: the cache server's chunk size is {chunk_size} tokens and SGLang's "
        f"page size is {page_size}; one SGLang page is one kvtier object, so every page "
        "misses. kvtier serve's --chunk-size is a minimum: the first engine that registers "
        "rounds it up to its page or block size and fixes it until the server restarts. Use "
        f"a cache server whose chunk size comes out as {page_size}: kvtier serve "
        f"--chunk-size {page_size}, shared only with engines whose page or block size "
        f"divides {page_size}; SGLang engines of another page size need a server of their "
        f"own. Or run this engine with --page-size {chunk_size}"
    )
