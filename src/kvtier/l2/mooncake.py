"""``mooncake``: objects in Mooncake Store, the distributed memory pool,
through its Python client ``MooncakeDistributedStore``.

- ``setup`` with the master's address, ``protocol`` (``tcp`` here, ``rdma``
  on RDMA NICs) and the metadata mode (``P2PHANDSHAKE`` by default: every
  participant must use the same). ``global_segment_bytes`` is the memory this
  process lends to the pool (0: none; a ``mooncake_client`` holder lends it).
- Zero copy: the payload goes straight between the caller's buffer and the
  pool with ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``
  (header and payload as two parts of one object); the header part lives in
  a registered staging buffer, and the L1 arena is registered when the
  storage manager offers it (``register_memory``).
- One object per kvtier object under ``{key_prefix}{ObjectKey.to_str()}``:
  model and tenant salt are in every key. The header carries the shared
  format's checksum, checked on every load; a bad copy is a miss and is
  removed (``force``: a read lease does not keep a bad copy alive).
- Leases and replicas come from the store: ``replicas`` goes into each put's
  ``ReplicateConfig``; a get leases the object for the master's lease TTL.
- Error codes: a missing object (-704) is a miss; the master or holder
  being away (-900 and other RPC errors) fails the batch and starts the
  back-off.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.keys import KeySelector, ObjectKey
from kvtier.l2.base import AdapterConfig, Buffer, CompletionCallback, PurgeStep
from kvtier.l2.blocking import BackendUnavailable, BlockingAdapter
from kvtier.l2.format import (
    Corruption,
    CorruptObject,
    encode_header,
    header_length,
    parse_header,
    verify_payload,
)

log = logging.getLogger(__name__)

NOT_FOUND = -704
BUFFER_TOO_SMALL = -600
UNAVAILABLE = -900
HEADER_SLOT = 4096  # staging bytes per object for its header


@dataclass(frozen=True, slots=True, kw_only=True)
class MooncakeConfig(AdapterConfig):
    master: str  # "host:port" of mooncake_master
    # The client moves a batch's objects in parallel itself: one batch call at a
    # time per direction is fastest (concurrent calls measured 0.4-0.7x).
    io_threads: int = 1
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    rdma_devices: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_bytes: int = 0  # memory this process lends to the pool
    local_buffer_bytes: int = 64 << 20  # the client's own transfer buffer
    replicas: int = 1
    key_prefix: str = "kvtier/"
    max_batch: int = 256  # objects per batch call (bounds the header staging)

    def __post_init__(self) -> None:
        super(MooncakeConfig, self).__post_init__()
        if not self.master or ":" not in self.master:
            raise ValueError(f"option 'master' must be host:port, got {self.master!r}")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"option 'protocol' must be 'tcp' or 'rdma', got {self.protocol!r}")
        for name in ("replicas", "max_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"option '{name}' must be positive")


class MooncakeAdapter(BlockingAdapter):
    type_name = "mooncake"
    config_class = MooncakeConfig
    takes_codecs = False  # payloads go between L1 and the backend as they are

    def __init__(self, config: MooncakeConfig, on_complete: CompletionCallback) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        super().__init__(config, on_complete)
        self.mc_config = config
        self._store_client: Any = MooncakeDistributedStore()
        code = self._store_client.setup(
            config.local_hostname,
            config.metadata_server,
            config.global_segment_bytes,
            config.local_buffer_bytes,
            config.protocol,
            config.rdma_devices,
            config.master,
        )
        if code != 0:
            raise ValueError(
                f"Mooncake Store setup failed (code {code}); check option 'master' "
                f"({config.master}) and that mooncake_master is running"
            )
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = config.replicas
        # Header parts of in-flight batches: one slot per object, per I/O thread.
        slots = config.max_batch * (2 * config.io_threads)
        self._headers = np.zeros(slots * HEADER_SLOT, dtype=np.uint8)
        self._register(self._headers)
        self._free_slots = list(range(slots))
        self._slots_lock = threading.Condition()

    def name_of(self, key: ObjectKey) -> str:
        return self.mc_config.key_prefix + key.to_str()

    def register_memory(self, buffer: Buffer) -> None:
        """Register memory that payloads live in (the L1 arena) for zero copy."""
        self._register(buffer)

    # ----------------------------------------------------------- backend

    def _store(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str
    ) -> list[int | None]:
        written: list[int | None] = []
        for start in range(0, len(keys), self.mc_config.max_batch):
            part = range(start, min(len(keys), start + self.mc_config.max_batch))
            with self._slots(len(part)) as slots:
                ptrs, sizes = [], []
                for slot, i in zip(slots, part, strict=True):
                    header = encode_header(keys[i], layout, buffers[i], seal=self.seal)
                    staged = self._slot(slot, len(header))
                    staged[:] = np.frombuffer(header, dtype=np.uint8)
                    ptrs.append([staged.ctypes.data, buffers[i].ctypes.data])
                    sizes.append([len(header), buffers[i].nbytes])
                names = [self.name_of(keys[i]) for i in part]
                codes = self._put(names, ptrs, sizes)
            for code, size in zip(codes, sizes, strict=True):
                if code == 0:
                    written.append(sum(size))
                else:
                    self._count_failure("no_space" if code == -200 else "error")
                    written.append(None)
        return written

    def _put(self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Put, the newest copy winning: a put does not replace an object, so
        copies already there (another node may have written them) are removed
        first (one more round trip)."""
        present = self._client("batch_is_exist", names)
        stale = [name for name, code in zip(names, present, strict=True) if code == 1]
        if stale:
            self._client("batch_remove", stale, True)
        return self._client("batch_put_from_multi_buffers", names, ptrs, sizes, self._replicate)

    def _lookup(self, keys: Sequence[ObjectKey]) -> list[bool]:
        codes = self._client("batch_is_exist", [self.name_of(k) for k in keys])
        return [code == 1 for code in codes]

    def _load(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str
    ) -> list[bool]:
        loaded: list[bool] = []
        for start in range(0, len(keys), self.mc_config.max_batch):
            part = range(start, min(len(keys), start + self.mc_config.max_batch))
            with self._slots(len(part)) as slots:
                lengths = [header_length(keys[i]) for i in part]
                views = [self._slot(s, n) for s, n in zip(slots, lengths, strict=True)]
                codes = self._client(
                    "batch_get_into_multi_buffers",
                    [self.name_of(keys[i]) for i in part],
                    [
                        [v.ctypes.data, buffers[i].ctypes.data]
                        for v, i in zip(views, part, strict=True)
                    ],
                    [[n, buffers[i].nbytes] for n, i in zip(lengths, part, strict=True)],
                )
                for i, view, code in zip(part, views, codes, strict=True):
                    loaded.append(self._check(keys[i], view, buffers[i], layout, code))
        return loaded

    def purge(self, selector: KeySelector, cursor: str | None, limit: int) -> PurgeStep:
        """``remove_by_regex`` over the store's names: one call removes every
        match that no reader holds; a held one (a read lease) stays, and the
        purge goes on until a call removes nothing more."""
        try:
            removed = int(
                self._store_client.remove_by_regex(selector.regex(self.mc_config.key_prefix))
            )
        except RuntimeError as exc:
            raise BackendUnavailable(str(exc)) from exc
        if removed < 0:
            raise BackendUnavailable(f"remove_by_regex: code {removed}")
        return PurgeStep(removed, "" if removed else None)

    def _unlock(self, keys: Sequence[ObjectKey]) -> None:
        return None  # Mooncake's read leases expire on their own (the master's TTL)

    def _close_backend(self) -> None:
        self._store_client.close()

    def _backend_status(self) -> dict[str, object]:
        c = self.mc_config
        return {"master": c.master, "protocol": c.protocol, "replicas": c.replicas}

    # --------------------------------------------------------- internals

    def _check(
        self, key: ObjectKey, header: Buffer, payload: Buffer, layout: str, code: int
    ) -> bool:
        if code == NOT_FOUND:
            self._count_failure("not_found")
            return False
        expected = header.nbytes + payload.nbytes
        try:
            if code == BUFFER_TOO_SMALL or code > expected:
                raise CorruptObject(Corruption.LENGTH, "the stored object is longer")
            if code < 0:  # a failed transfer: a copy of another length fails this way
                stored = int(self._store_client.get_size(self.name_of(key)))
                if stored < 0 or stored == expected:
                    self._count_failure("error")
                    return False
                raise CorruptObject(
                    Corruption.SHORT if stored < expected else Corruption.LENGTH,
                    f"{stored} bytes stored, {expected} expected",
                )
            if code < expected:
                raise CorruptObject(Corruption.SHORT, f"{code} of {expected} bytes")
            parsed = parse_header(header.data, key, layout)
            if parsed.header_len != header.nbytes:
                raise CorruptObject(Corruption.SHORT, "header length")
            verify_payload(parsed, payload, self.seal)
        except CorruptObject as error:
            self._corrupt(key, error)
            self._client("batch_remove", [self.name_of(key)], True)
            return False
        return True

    def _client(self, method: str, *args: Any) -> list[int]:
        """Call the store; a batch whose every key failed for lack of the
        master or holder raises (back-off)."""
        try:
            codes: list[int] = list(getattr(self._store_client, method)(*args))
        except RuntimeError as exc:
            raise BackendUnavailable(str(exc)) from exc
        if codes and all(c <= UNAVAILABLE for c in codes):
            raise BackendUnavailable(f"{method}: code {codes[0]}")
        return codes

    def _register(self, buffer: Buffer) -> None:
        code = self._store_client.register_buffer(buffer.ctypes.data, buffer.nbytes)
        if code != 0:
            log.warning("L2 %s: register_buffer failed (%d); transfers copy", self.name, code)

    def _slot(self, slot: int, nbytes: int) -> Buffer:
        start = slot * HEADER_SLOT
        return self._headers[start : start + nbytes]

    def _slots(self, n: int) -> _Slots:
        return _Slots(self, n)


class _Slots:
    """Header staging slots held for one batch call."""

    def __init__(self, adapter: MooncakeAdapter, n: int) -> None:
        self.adapter, self.n, self.taken = adapter, n, list[int]()

    def __enter__(self) -> list[int]:
        lock = self.adapter._slots_lock
        with lock:
            lock.wait_for(lambda: len(self.adapter._free_slots) >= self.n)
            self.taken = [self.adapter._free_slots.pop() for _ in range(self.n)]
        return self.taken

    def __exit__(self, *exc: object) -> None:
        lock = self.adapter._slots_lock
        with lock:
            self.adapter._free_slots.extend(self.taken)
            lock.notify_all()
