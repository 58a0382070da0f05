"""Shared helpers for the L2 adapter tests: drive an adapter task by task.

``Harness`` wraps one adapter and the ``CompletionQueue`` its callback feeds.
Its ``store``/``lookup``/``load`` submit one task and return that task's
result, failing the test if a result is delivered twice or never (the wait is
a guard against hangs, not a timing assertion).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from kvtier.keys import ObjectKey
from kvtier.l2 import CompletionQueue, L2Adapter, TaskId, TaskResult
from kvtier.l2.base import Buffer

WAIT_S = 30.0  # a guard against a hang; a healthy task completes in milliseconds
Change = Callable[[bytes], bytes]
Tamper = Callable[[L2Adapter, ObjectKey, Change], None]


def payload(n: int, seed: int) -> Buffer:
    """``n`` random bytes, different per seed."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def drain(queue: CompletionQueue) -> list[TaskResult]:
    """Every result already delivered, without waiting."""
    results = []
    while (result := queue.get(timeout=0)) is not None:
        results.append(result)
    return results


class Harness:
    def __init__(self, adapter: L2Adapter, queue: CompletionQueue, tamper: Tamper | None = None):
        self.adapter = adapter
        self.queue = queue
        self._tamper = tamper
        self._early: dict[TaskId, TaskResult] = {}
        self.delivered: Counter[TaskId] = Counter()

    # ----------------------------------------------------------- tasks

    def wait(self, task: TaskId) -> TaskResult:
        """The result of ``task``, keeping any other result that arrives first."""
        while task not in self._early:
            result = self.queue.get(timeout=WAIT_S)
            if result is None:
                pytest.fail(f"task {task} delivered no result within {WAIT_S} s")
            self._record(result)
        return self._early.pop(task)

    def store(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str = ""
    ) -> TaskResult:
        return self.wait(self.adapter.submit_store(keys, buffers, layout))

    def lookup(self, keys: Sequence[ObjectKey]) -> TaskResult:
        return self.wait(self.adapter.submit_lookup(keys))

    def load(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str = ""
    ) -> TaskResult:
        return self.wait(self.adapter.submit_load(keys, buffers, layout))

    def drain(self) -> list[TaskResult]:
        results = drain(self.queue)
        for result in results:
            self._record(result)
        return results

    def _record(self, result: TaskResult) -> None:
        self.delivered[result.task] += 1
        if self.delivered[result.task] > 1:
            pytest.fail(f"task {result.task} delivered twice: {result}")
        self._early[result.task] = result

    # ---------------------------------------------------------- backend

    def tamper(self, key: ObjectKey, change: Change) -> None:
        assert self._tamper is not None, "no tamper hook for this adapter"
        self._tamper(self.adapter, key, change)

    def raw(self, key: ObjectKey) -> bytes:
        """The bytes stored for ``key`` in the backend (through the tamper hook)."""
        seen: list[bytes] = []

        def keep(data: bytes) -> bytes:
            seen.append(bytes(data))
            return data

        self.tamper(key, keep)
        return seen[0]

    # ----------------------------------------------------------- status

    def failures(self) -> Counter[str]:
        failures = self.adapter.status()["failures"]
        assert isinstance(failures, dict)
        return Counter(failures)

    def counter(self, name: str) -> int:
        value = self.adapter.status().get(name, 0)
        assert isinstance(value, int)
        return value
