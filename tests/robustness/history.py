"""The history of one robustness run: every operation a client made and
every fault injected, with its arguments, its outcome, its times and a digest
of the bytes it moved.

An operation is recorded when it is invoked and completed when it returns, so
an operation that never returns stays open in the history (``end`` None): the
checker counts it as a hang. Times are ``time.monotonic()`` seconds from the
run's start. Histories are saved as JSON lines, one operation per line, and
the checker reads them back the same way.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import blake3


def digest(data: bytes | memoryview) -> str:
    """The digest recorded for a payload (16 hex digits of BLAKE3)."""
    return blake3.blake3(data).hexdigest()[:16]


@dataclass(slots=True)
class Op:
    """One operation or fault. ``outcome``: "ok", "miss", "refused", "error"
    (the client's own words are in ``result``); ``bound_s``: the longest it
    may take by the documented timeouts (0: not timed)."""

    index: int
    client: str
    kind: str
    args: dict[str, Any]
    start: float
    end: float | None = None
    outcome: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    bound_s: float = 0.0

    @property
    def duration(self) -> float | None:
        return None if self.end is None else self.end - self.start


class History:
    """Operations in invocation order; any thread may record."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.ops: list[Op] = []
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def __getstate__(self) -> dict[str, Any]:  # pickled without its lock (a campaign's pool)
        return {"seed": self.seed, "ops": self.ops, "_t0": self._t0}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self._t0

    @contextmanager
    def record(self, client: str, kind: str, bound_s: float = 0.0, **args: Any) -> Iterator[Op]:
        """Record the operation as invoked; the block fills in its outcome and
        result, and its end is stamped when the block leaves (an exception
        leaves it as an "error" with the exception's text)."""
        with self._lock:
            op = Op(len(self.ops), client, kind, args, self.now(), bound_s=bound_s)
            self.ops.append(op)
        try:
            yield op
        except Exception as exc:
            op.outcome, op.result = "error", {**op.result, "exception": repr(exc)}
            raise
        finally:
            op.end = self.now()

    def save(self, path: Path) -> None:
        with path.open("w") as out:
            out.write(json.dumps({"seed": self.seed}) + "\n")
            for op in list(self.ops):
                out.write(json.dumps(asdict(op)) + "\n")

    @classmethod
    def load(cls, path: Path) -> History:
        lines = path.read_text().splitlines()
        history = cls(json.loads(lines[0])["seed"])
        history.ops = [Op(**json.loads(line)) for line in lines[1:]]
        return history
