"""Helpers for the controller tests: a small layout, payloads, a ``Stack`` that
builds and closes ``StorageManager`` instances, gates that hold adapter calls
until the test lets them through, and the end-of-scenario checks.

Nothing here asserts on time: waits are bounded polls on state (they fail
the test if the state never comes) and gates wait for a permit, not a clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.controllers import PrefetchConfig, StoreConfig
from kvtier.keys import ObjectKey
from kvtier.l1 import L1Config
from kvtier.l2.base import L2Adapter
from kvtier.l2.mock import MockAdapter
from kvtier.layout import KVLayout
from kvtier.storage import StorageConfig, StorageManager
from tests import storage_parts
from tests.ledger import assert_clean

LAYOUT = KVLayout(1, 1, 64, "float32", 16)
OBJ = LAYOUT.object_bytes()  # 8192 bytes: two L1 pages
PAGE = 4096
MiB = 1 << 20
WAIT_S = 10.0  # upper bound of every poll; reached only when a test fails


def payload(seed: int) -> npt.NDArray[np.uint8]:
    """The bytes of one object, distinct per seed."""
    return np.random.default_rng(seed).integers(0, 256, OBJ, dtype=np.uint8)


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` until it holds; fail the test if it never does."""
    give_up = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"gave up waiting for: {what}")
        time.sleep(0.002)


def mocks(storage: StorageManager) -> list[MockAdapter]:
    return [a for a in storage_parts.adapters(storage) if isinstance(a, MockAdapter)]


def adapter(storage: StorageManager, name: str) -> L2Adapter:
    (found,) = [a for a in storage_parts.adapters(storage) if a.name == name]
    return found


def counters(status: Mapping[str, object], name: str) -> int:
    value = status.get(name, 0)
    assert isinstance(value, int), (name, value)
    return value


def failures(a: L2Adapter) -> dict[str, int]:
    found = a.status()["failures"]
    assert isinstance(found, dict)
    return found


def prefetch_idle(storage: StorageManager) -> bool:
    status = storage.status()["prefetch"]
    return all(
        counters(status, gauge) == 0
        for gauge in ("active_requests", "backlog_requests", "inflight_objects", "inflight_bytes")
    )


def assert_settled(storage: StorageManager) -> None:
    """End of a scenario: write-back done, prefetch idle, no lookup lock held,
    the L1 ledger clean and no mock lease left."""
    assert storage.flush(timeout=WAIT_S)
    wait_until(lambda: prefetch_idle(storage), "the prefetch controller to go idle")
    assert storage.status()["held_lookup_locks"] == 0
    assert_clean(storage)
    # an abandoned lookup's leases come back with its late answer: a condition
    wait_until(
        lambda: all(mock.status()["leases"] == 0 for mock in mocks(storage)),
        "every mock lease returned",
    )


def seed_l2(
    storage: StorageManager,
    keys: Sequence[ObjectKey],
    *,
    keep: Sequence[ObjectKey] = (),
    seeds: Sequence[int] | None = None,
) -> dict[ObjectKey, npt.NDArray[np.uint8]]:
    """Store objects through L1 (write-back to every writable adapter), wait
    for the write-back, then drop from L1 all but ``keep``. Returns the bytes
    of each key (payload seed = its index in ``keys`` unless ``seeds``)."""
    seeds = list(range(len(keys))) if seeds is None else list(seeds)
    data = {key: payload(seed) for key, seed in zip(keys, seeds, strict=True)}
    storage.store(list(data), list(data.values()), LAYOUT)
    assert storage.flush(timeout=WAIT_S)
    gone = [k for k in keys if k not in set(keep)]
    storage.delete_l1(gone)
    assert [storage.in_l1(k) for k in keys] == [k in set(keep) for k in keys]
    return data


def read_back(storage: StorageManager, keys: Sequence[ObjectKey]) -> list[bytes]:
    """Copies of the bytes of objects a lookup locked."""
    return [view.tobytes() for view in storage.retrieve(keys)]


class Gate:
    """Replaces ``adapter.<method>`` (``_store``, ``_lookup`` or ``_load``) by a
    wrapper that counts the call and the bytes it carries, then holds it until
    the test lets it through. An adapter may split one task into several
    calls (parts), so tests reason about bytes, not calls.

    ``release_entered()`` lets through every call that has arrived so far;
    ``open()`` lets through every call, now and later."""

    def __init__(self, target: L2Adapter, method: str, *, is_open: bool = False) -> None:
        self._real = getattr(target, method)
        self._cond = threading.Condition()
        self._open = is_open
        self._released = 0  # calls with a ticket up to this may run
        self.calls = 0
        self.active_bytes = 0  # bytes of the calls that arrived and have not returned
        self.peak_bytes = 0
        self.keys: list[ObjectKey] = []
        setattr(target, method, self._call)

    def _call(self, keys: Sequence[ObjectKey], *rest: Any) -> Any:
        nbytes = sum(b.nbytes for b in rest[0]) if rest else 0
        with self._cond:
            self.calls += 1
            ticket = self.calls
            self.keys.extend(keys)
            self.active_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.active_bytes)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._open or ticket <= self._released, timeout=WAIT_S)
        try:
            return self._real(keys, *rest)
        finally:
            with self._cond:
                self.active_bytes -= nbytes

    def release_entered(self) -> None:
        with self._cond:
            self._released = self.calls
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[Gate], bool], what: str) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self), timeout=WAIT_S):
                raise AssertionError(f"gave up waiting for: {what}")


class Stack:
    """Builds StorageManagers for one test and closes every one at teardown
    (after opening every gate, so that no close waits on a held call)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self._open: list[StorageManager] = []
        self._gates: list[Gate] = []

    def fs(self, sub: str = "fs", **options: Any) -> dict[str, Any]:
        return {"type": "fs", "path": str(self.tmp_path / sub), **options}

    def build(
        self,
        *l2: Mapping[str, Any],
        l1_bytes: int = 1 * MiB,
        store: StoreConfig | None = None,
        prefetch: PrefetchConfig | None = None,
        **l1_options: Any,
    ) -> StorageManager:
        config = StorageConfig(
            l1=L1Config(size_bytes=l1_bytes, populate=False, **l1_options),
            l2=tuple(l2),
            store=store or StoreConfig(),
            prefetch=prefetch or PrefetchConfig(),
        )
        storage = StorageManager(config)
        self._open.append(storage)
        return storage

    def gate(self, target: L2Adapter, method: str, *, is_open: bool = False) -> Gate:
        gate = Gate(target, method, is_open=is_open)
        self._gates.append(gate)
        return gate

    def close(self, storage: StorageManager) -> None:
        self._open.remove(storage)
        storage.close()

    def close_all(self) -> None:
        for gate in self._gates:
            gate.open()
        while self._open:
            self.close(self._open[-1])
