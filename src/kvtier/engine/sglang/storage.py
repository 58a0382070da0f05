"""``KvtierStorage``: SGLang's HiCache third tier (``HiCacheStorage``) on the
node's ``kvtier serve``, so SGLang pages live in kvtier's L1 and L2 tiers
like any other objects (checksums, tenants, quotas, metrics, events).

Life cycle, driven by SGLang's ``HiCacheController``::

    __init__(storage_config, kwargs)   settings checked (ValueError names the key),
         │                             no connection yet
         ▼
    register_mem_pool_host(pool)       page format checked, CacheClient made
         │                             (registers under the tenant's salt)
         ▼
    batch_exists / batch_get_v1 / batch_set_v1 (and the v0 get/set/exists)
         │   from SGLang's prefetch and backup threads, any number at once
         ▼
    close()

Contracts:

- ``batch_exists(keys)``: how many leading pages the server has (a prefix).
- ``batch_get_v1(keys, host_indices)``: page i goes to host index
  ``host_indices[i * page_size]``; True for each leading page copied, False
  from the first miss on.
- ``batch_set_v1``: True per page now in the cache (stored now or already).
- Failures are misses: a dead, restarting or refusing server, a timeout or an
  unexpected object size gives 0 / False, logged once per kind and counted in
  ``status()``; no exception reaches SGLang's threads, and nothing is held (each
  call is one server session, ended before it returns, so lookup locks are
  released whatever happened).
- A page whose size does not match the registered layout is refused
  (``ValueError`` from ``register_mem_pool_host``/the v0 ``set``, naming it).
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found, unused-ignore]
    HiCacheStorage,
)

from kvtier.engine.identity import ModelIdentity
from kvtier.engine.sglang.pages import EngineShard, PageFormat, PageKeys, chunk_size_mismatch
from kvtier.engine.sglang.settings import BackendSettings
from kvtier.protocol.client import CacheClient, ClientConfig, ObjectBytes
from kvtier.protocol.messages import LayoutSpec

log = logging.getLogger(__name__)

# The SGLang interface this backend was written and tested against: the config
# fields it reads and the page-level methods it overrides.
_CONFIG_FIELDS = (
    "tp_rank",
    "tp_size",
    "pp_rank",
    "pp_size",
    "attn_cp_rank",
    "attn_cp_size",
    "dcp_size",
    "is_mla_model",
    "model_name",
    "extra_config",
)
_INTERFACE = ("batch_get_v1", "batch_set_v1", "batch_exists", "register_mem_pool_host")
T = TypeVar("T")


def _check_interface(storage_config: Any) -> None:
    import sglang  # type: ignore[import-not-found, unused-ignore]

    missing = [f for f in _CONFIG_FIELDS if not hasattr(storage_config, f)]
    missing += [m for m in _INTERFACE if not hasattr(HiCacheStorage, m)]
    if missing:
        raise ValueError(
            f"kvtier backend: SGLang {getattr(sglang, '__version__', '?')} has a different "
            f"HiCache storage interface (no {', '.join(missing)}); kvtier supports SGLang 0.5.23"
        )


@dataclass(frozen=True, slots=True)
class _Session:
    """One call's server session (``KvtierStorage._session``)."""

    client: CacheClient
    format: PageFormat
    request_id: str
    hashes: list[bytes]  # kvtier's chunk hash of each SGLang key


class KvtierStorage(HiCacheStorage):  # type: ignore[misc, unused-ignore]
    """See the module docstring. Thread safety: any thread may call any
    method; ``_lock`` guards only ``_failures`` (the client is thread-safe)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        _check_interface(storage_config)
        self.settings = BackendSettings.from_extra_config(
            storage_config.extra_config, storage_config.model_name
        )
        self.shard = EngineShard.of(storage_config)
        self.identity = ModelIdentity(
            model=self.settings.model, revision=self.settings.revision, salt=self.settings.salt
        )
        self.client_id = f"sglang-{self.shard.label}-{uuid.uuid4().hex[:8]}"
        self.format: PageFormat | None = None
        self.keys: PageKeys | None = None
        self.client: CacheClient | None = None
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._failures: dict[str, int] = {}

    # ----------------------------------------------------------- set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool, check its page format and connect (a
        server that is away makes the client degraded, not an error: it
        registers when the server comes)."""
        super().register_mem_pool_host(mem_pool_host)
        self.format = PageFormat.of(mem_pool_host, self.shard)
        self.keys = PageKeys.of(self.identity, self.format.layout)
        label = self.identity.label
        self.client = CacheClient(
            ClientConfig(
                address=self.settings.address,
                model=label.model,
                hash_model=self.identity.model,
                layouts=(LayoutSpec.of(self.format.layout),),
                num_ranks=self.format.layout.num_ranks,
                rank=self.format.rank,
                block_alignment=self.format.layout.tokens_per_chunk,
                revision=self.identity.revision,
                salt=label.salt,
                auth_token=self.settings.auth_token,
                client_id=self.client_id,
                request_timeout_s=self.settings.request_timeout_s,
            )
        )

    def close(self) -> None:
        """Disconnect; later calls miss. A second close does nothing."""
        client, self.client = self.client, None
        if client is not None:
            client.close()

    # -------------------------------------------------------- page level

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading pages of ``keys`` the server has (0 on any failure)."""
        return self._guard("exists", lambda: self._exists(keys), 0)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Copy each leading hit page into the host pool; see the module docstring."""
        return self._guard("get", lambda: self._get(keys, host_indices), [False] * len(keys))

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pages at ``host_indices`` under ``keys``."""
        if self.format is not None and not self.format.writer:
            return [True] * len(keys)  # an MLA replica: TP rank 0 writes the one copy
        return self._guard("set", lambda: self._set(keys, host_indices), [False] * len(keys))

    # ------------------------------------------------- v0 (value copies)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """The page of ``key`` as a flat tensor (written into ``target_location``
        when given), or None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """One flat page or None per key: the leading hits, then None."""
        targets = list(target_locations or [None] * len(keys))
        return self._guard("get", lambda: self._get_values(keys, targets), [None] * len(keys))

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store one flat page per key; True if all are in the cache. A value
        whose size is not one page raises ValueError naming it."""
        pages = [self._page_bytes(key, value) for key, value in zip(keys, values, strict=True)]
        if self.format is not None and not self.format.writer:
            return True

        def fill(i: int, dst: ObjectBytes) -> None:
            np.copyto(dst, pages[i])

        return self._guard("set", lambda: self._store(keys, fill), 0) == len(keys)

    # -------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        """The failures counted so far, by kind, and the client's state."""
        with self._lock:
            failures = dict(self._failures)
        client = self.client
        return {
            "connected": client is not None and not client.degraded,
            "failures": failures,
            "page_bytes": self.format.page_bytes if self.format else None,
        }

    def get_stats(self) -> dict[str, Any]:
        return self.status()

    # ------------------------------------------------------------ internals

    def _guard(self, kind: str, call: Callable[[], T], miss: T) -> T:
        """``call()``, or ``miss`` if it raised: logged the first time per kind."""
        try:
            return call()
        except Exception:
            with self._lock:
                first = kind not in self._failures
                self._failures[kind] = self._failures.get(kind, 0) + 1
            if first:
                log.exception("kvtier backend: %s failed; answered as a miss", kind)
            return miss

    def _ready(self) -> tuple[CacheClient, PageFormat, PageKeys] | None:
        """The client, format and keys, or None (not registered, or the server
        is away or has another chunk size: every call misses)."""
        client, fmt, keys = self.client, self.format, self.keys
        if client is None or fmt is None or keys is None or client.degraded:
            return None
        if client.chunk_size != fmt.layout.tokens_per_chunk:
            with self._lock:
                first = "chunk_size" not in self._failures
                self._failures["chunk_size"] = self._failures.get("chunk_size", 0) + 1
            if first:
                log.error(chunk_size_mismatch(client.chunk_size, fmt.layout.tokens_per_chunk))
            return None
        return client, fmt, keys

    @contextmanager
    def _session(self, keys: Sequence[str]) -> Iterator[_Session | None]:
        """One server session for ``keys`` (None when there is nothing to ask
        or nobody to ask), ended when the block leaves, whatever happened:
        that releases its lookup's locks."""
        ready = self._ready()
        if ready is None or not keys:
            yield None
            return
        client, fmt, page_keys = ready
        request_id = f"{self.client_id}-{next(self._ids)}"
        try:
            yield _Session(client, fmt, request_id, page_keys.hashes(keys))
        finally:
            client.end_session(request_id, wait=False)

    def _exists(self, keys: Sequence[str]) -> int:
        return self._retrieve(keys, None)

    def _retrieve(
        self, keys: Sequence[str], consume: Callable[[int, ObjectBytes], None] | None
    ) -> int:
        """Look up the leading hits of ``keys`` and (given ``consume``) retrieve
        them, handing object i to ``consume``; the number found, or retrieved
        (0 on any failure)."""
        with self._session(keys) as session:
            if session is None:
                return 0
            client, request_id = session.client, session.request_id
            wait_s = client.config.request_timeout_s
            state = client.lookup(request_id, session.hashes, wait_s=wait_s)
            hits = min(state.hit_chunks or 0, len(keys))
            if hits == 0 or consume is None:
                return hits
            deliver, page_bytes = consume, session.format.page_bytes  # bound for ``checked``
            sizes_ok = [True]

            def checked(i: int, view: ObjectBytes) -> None:
                if view.nbytes != page_bytes:
                    sizes_ok[0] = False
                    return
                deliver(i, view)

            ok = client.retrieve_with(request_id, 0, hits, checked)
            return hits if ok and sizes_ok[0] else 0

    def _page_starts(self, count: int, host_indices: torch.Tensor) -> list[int] | None:
        """The host index where each of ``count`` pages starts (page i at
        ``host_indices[i * page_size]``); None before the pool is registered."""
        if self.format is None:
            return None
        page_size = self.format.layout.tokens_per_chunk
        return [int(host_indices[i * page_size]) for i in range(count)]

    def _get(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        pool, starts = self.mem_pool_host, self._page_starts(len(keys), host_indices)
        if starts is None:
            return [False] * len(keys)

        def consume(i: int, view: ObjectBytes) -> None:
            page = torch.from_numpy(view).view(pool.dtype)
            pool.set_from_flat_data_page(starts[i], page)

        hits = self._retrieve(keys, consume)
        return [i < hits for i in range(len(keys))]

    def _get_values(self, keys: Sequence[str], targets: Sequence[Any]) -> list[torch.Tensor | None]:
        pool = self.mem_pool_host
        out: list[torch.Tensor | None] = [None] * len(keys)

        def consume(i: int, view: ObjectBytes) -> None:
            target = targets[i]
            if target is None:
                target = pool.get_dummy_flat_data_page()
            target.view(-1).view(torch.uint8).copy_(torch.from_numpy(view))
            out[i] = target

        hits = self._retrieve(keys, consume)
        return out[:hits] + [None] * (len(keys) - hits)

    def _set(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        pool, starts = self.mem_pool_host, self._page_starts(len(keys), host_indices)
        if starts is None:
            return [False] * len(keys)

        def fill(i: int, dst: ObjectBytes) -> None:
            page = pool.get_data_page(starts[i], flat=True)
            torch.from_numpy(dst).copy_(page.contiguous().view(torch.uint8))

        stored = self._store(keys, fill)
        return [stored == len(keys)] * len(keys)

    def _store(self, keys: Sequence[str], fill: Callable[[int, ObjectBytes], None]) -> int:
        with self._session(keys) as session:
            if session is None:
                return 0
            sizes = [session.format.page_bytes] * len(keys)
            return session.client.store_with(session.request_id, session.hashes, sizes, fill)

    def _page_bytes(self, key: str, value: Any) -> ObjectBytes:
        """``value`` (a flat page tensor) as bytes; ValueError if it is not one page."""
        fmt = self.format
        data = np.ascontiguousarray(value.contiguous().view(torch.uint8).numpy()).reshape(-1)
        if fmt is not None and data.nbytes != fmt.page_bytes:
            raise ValueError(
                f"kvtier backend: the page of key {key!r} is {data.nbytes} bytes; the registered "
                f"layout's pages are {fmt.page_bytes}"
            )
        return data
