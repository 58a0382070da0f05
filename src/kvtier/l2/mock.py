"""``mock``: an in-memory L2 with injected latency, bandwidth limits and faults.

The tool for testing every failure path of the tiers above it. Objects are
kept in the shared object format (``kvtier.l2.format``), so corruption is
detected exactly as it is for real backends. Faults can be set in the config
and changed at run time through ``adapter.faults``:

=====================  ==========================================================
``fail_store_rate``     fraction of stored keys that fail (reason "error")
``fail_load_rate``      fraction of loaded keys that fail (reason "error")
``corrupt_rate``        fraction of stored copies with one payload byte flipped
``hang_s``              every task sleeps this long, then fails as a timeout
``unreachable``         every task (and reconnect) fails as unreachable
=====================  ==========================================================

A lookup leases what it finds until ``unlock``; ``status()["leases"]`` lets
tests check that callers unlock exactly what they looked up. Capacity and
tenant caps are kept as the fs adapter keeps them (``kvtier.l2.local_index``).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.keys import KeySelector, ObjectKey
from kvtier.l2.base import AdapterConfig, Buffer, CompletionCallback, PurgeStep
from kvtier.l2.blocking import BackendUnavailable, BlockingAdapter
from kvtier.l2.format import CorruptObject
from kvtier.l2.local_index import LocalIndex
from kvtier.l2.stored_value import decode_object, encode_object


@dataclass(frozen=True, slots=True, kw_only=True)
class MockConfig(AdapterConfig):
    latency_s: float = 0.0  # added to every task
    # 0: unlimited; else one link of this rate that parallel parts share
    bandwidth_bytes_per_s: float = 0.0
    capacity_bytes: int = 0  # 0: unlimited; else oldest objects are dropped
    fail_store_rate: float = 0.0
    fail_load_rate: float = 0.0
    corrupt_rate: float = 0.0
    hang_s: float = 0.0
    unreachable: bool = False
    seed: int = 0


@dataclass(slots=True)
class MockFaults:
    """The faults in force; tests change these fields while the adapter runs."""

    fail_store_rate: float = 0.0
    fail_load_rate: float = 0.0
    corrupt_rate: float = 0.0
    hang_s: float = 0.0
    unreachable: bool = False


class MockAdapter(BlockingAdapter):
    type_name = "mock"
    config_class = MockConfig
    shared_by_default = False  # in this process

    def __init__(self, config: MockConfig, on_complete: CompletionCallback) -> None:
        super().__init__(config, on_complete)
        self.mock_config = config
        self.faults = MockFaults(
            config.fail_store_rate,
            config.fail_load_rate,
            config.corrupt_rate,
            config.hang_s,
            config.unreachable,
        )
        self._rng = random.Random(config.seed)
        self._data_lock = threading.Lock()  # guards _objects, _index, _leases, _rng
        self._objects: dict[ObjectKey, bytes] = {}
        self._index = LocalIndex(config.capacity_bytes)  # what _objects holds, in order
        self._leases: Counter[ObjectKey] = Counter()
        self._link_lock = threading.Lock()
        self._link_free = 0.0  # when the link has sent what was queued on it

    # -------------------------------------------------------- test hooks

    def tamper(self, key: ObjectKey, change: Callable[[bytes], bytes]) -> None:
        """Replace a stored copy by ``change(copy)`` (to plant bad data)."""
        with self._data_lock:
            value = change(self._objects[key])
        self._put(key, value)

    def wipe(self) -> None:
        """Forget every object, as a store restarted without persistence does."""
        with self._data_lock:
            self._objects.clear()
            self._index.clear()

    def keys(self) -> list[ObjectKey]:
        with self._data_lock:
            return self._index.keys()

    def held_sizes(self) -> list[tuple[ObjectKey, int]]:
        with self._data_lock:
            return self._index.items()

    def set_owners(self, owner_of: Callable[[str], str], caps: Mapping[str, int]) -> bool:
        with self._data_lock:
            evicted = self._index.set_owners(owner_of, caps)
            for key in evicted.keys:
                del self._objects[key]
        self._counters.add("quota_evictions", len(evicted.own))
        return True

    def delete(self, keys: Sequence[ObjectKey]) -> int:
        with self._data_lock:
            held = [k for k in keys if k in self._objects]
            for key in held:
                self._drop(key)
        return len(held)

    def purge(self, selector: KeySelector, cursor: str | None, limit: int) -> PurgeStep:
        with self._data_lock:
            matched = [k for k in self._index if selector.matches(k)]
            for key in matched[:limit]:
                self._drop(key)
        return PurgeStep(min(len(matched), limit), "" if len(matched) > limit else None)

    # ----------------------------------------------------------- backend

    def _store(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str
    ) -> list[int | None]:
        pairs = zip(keys, buffers, strict=True)
        values = [encode_object(k, layout, b, self.codec, self.seal) for k, b in pairs]
        self._delay(sum(len(v) for v in values))  # what goes over the wire
        written: list[int | None] = []
        for key, buffer, encoded in zip(keys, buffers, values, strict=True):
            if self._chance(self.faults.fail_store_rate):
                self._count_failure("error")
                written.append(None)
                continue
            value = bytearray(encoded)
            cap = self.mock_config.capacity_bytes
            if cap and len(value) > cap:
                self._count_failure("capacity")
                written.append(None)
                continue
            with self._data_lock:
                refused = self._index.refuses(key, len(value))
            if refused:
                self._count_failure("over_quota")
                written.append(None)
                continue
            if buffer.nbytes and self._chance(self.faults.corrupt_rate):
                value[-1 - self._rng.randrange(min(buffer.nbytes, len(value)))] ^= 0xFF
            self._put(key, bytes(value))
            written.append(len(value))
        return written

    def _lookup(self, keys: Sequence[ObjectKey]) -> list[bool]:
        self._delay(0)
        with self._data_lock:
            found = [key in self._objects for key in keys]
            self._leases.update(k for k, f in zip(keys, found, strict=True) if f)
        return found

    def _load(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str
    ) -> list[bool]:
        with self._data_lock:
            values = [self._objects.get(key) for key in keys]
        self._delay(sum(len(v) for v in values if v is not None))
        loaded = []
        for key, buffer, value in zip(keys, buffers, values, strict=True):
            if value is None:
                self._count_failure("not_found")
                loaded.append(False)
            elif self._chance(self.faults.fail_load_rate):
                self._count_failure("error")
                loaded.append(False)
            else:
                loaded.append(self._decode(key, value, layout, buffer))
        return loaded

    def _unlock(self, keys: Sequence[ObjectKey]) -> None:
        with self._data_lock:
            for key in keys:
                if self._leases[key] > 0:
                    self._leases[key] -= 1
                if self._leases[key] == 0:
                    del self._leases[key]

    def _reconnect(self) -> None:
        if self.faults.unreachable:
            raise BackendUnavailable("mock backend is unreachable")

    def _backend_status(self) -> dict[str, object]:
        with self._data_lock:
            return {
                "objects": len(self._objects),
                "used_bytes": self._index.used,
                "leases": sum(self._leases.values()),
            }

    # ---------------------------------------------------------- internals

    def _decode(self, key: ObjectKey, value: bytes, layout: str, buffer: Buffer) -> bool:
        try:
            decode_object(value, key, layout, buffer, self.codec, self.seal)
        except CorruptObject as error:
            self._corrupt(key, error)
            with self._data_lock:
                if self._objects.get(key) is value:
                    self._drop(key)
            return False
        return True

    def _put(self, key: ObjectKey, value: bytes) -> None:
        with self._data_lock:
            self._objects[key] = value
            evicted = self._index.admit(key, len(value))
            for victim in evicted.keys:
                del self._objects[victim]
        self._counters.add("quota_evictions", len(evicted.own))
        self._counters.add("evictions", len(evicted.oldest))

    def _drop(self, key: ObjectKey) -> None:
        del self._objects[key]
        self._index.forget(key)

    def _chance(self, rate: float) -> bool:
        if rate <= 0:
            return False
        with self._data_lock:
            return self._rng.random() < rate

    def _delay(self, nbytes: int) -> None:
        if self.faults.unreachable:
            raise BackendUnavailable("mock backend is unreachable")
        if self.faults.hang_s:
            time.sleep(self.faults.hang_s)
            raise TimeoutError(f"mock backend hung for {self.faults.hang_s} s")
        rate = self.mock_config.bandwidth_bytes_per_s
        done = time.monotonic() + self.mock_config.latency_s
        if rate:
            with self._link_lock:  # parts queue on the one link
                self._link_free = max(self._link_free, time.monotonic()) + nbytes / rate
                done = max(done, self._link_free)
        pause = done - time.monotonic()
        if pause > 0:
            time.sleep(pause)
