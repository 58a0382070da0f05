"""The sampled shadow check: a production check that served KV is right.

A fraction of the requests that hit have their last hit chunk computed by
the engine anyway, on top of the prefix before it, and the computed KV is
compared with the copy kvtier served. The last chunk is the one whose KV
depends on all the others (attention reads the whole prefix), and it costs
one chunk of compute. Nothing in the cache can see a wrong
object that passes its checksums (a model served under another one's name,
weights changed without a new revision, a bug in a layout conversion); the
engine can, because it knows what the KV must be. A mismatch is logged and
counted, never served silently twice unnoticed.

The comparison tolerates what recomputation legitimately changes: the chunk
was first computed in another batch shape, so its floats may differ in the
last bits. Per slice (a layer, or a layer's K or V) the error is
``max |served - computed| / max |computed|``; a chunk mismatches when any
slice's error exceeds ``tolerance`` (or is not finite). Wrong KV is off by
the order of the values themselves (an error near 1); a recomputation in
float32 by 1e-6, in bfloat16 by about 1e-2.

Used by the transformers wrapper (``hf.KVTierModel(shadow=...)``), which
recomputes in the same call, and by the vLLM connector (``kvtier.shadow_fraction``),
which lets vLLM compute the chunk instead of loading it and compares at save.
"""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ShadowStats:
    checked_chunks: int = 0
    mismatched_chunks: int = 0
    unavailable_chunks: int = 0  # sampled, but the served copy could not be read back
    worst_error: float = 0.0  # the largest relative error seen


class Verdict(NamedTuple):
    error: float  # the largest per-slice relative error
    mismatched: bool


class ShadowCheck:
    """Samples requests and compares chunks; see the module docstring.
    Thread-safe."""

    def __init__(self, fraction: float, tolerance: float = 0.02, seed: int | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"shadow fraction must be in [0, 1], got {fraction}")
        if not tolerance > 0:
            raise ValueError(f"shadow tolerance must be positive, got {tolerance}")
        self.fraction = fraction
        self.tolerance = tolerance
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._stats = ShadowStats()

    def sample(self) -> bool:
        """Whether to check this request (a ``fraction`` of the calls)."""
        if self.fraction == 0.0:
            return False
        with self._lock:
            return self._random.random() < self.fraction

    def compare(self, served: torch.Tensor, computed: torch.Tensor, what: str) -> Verdict:
        """Compare one chunk, ``[slices, ...]`` each, and count it."""
        if served.shape != computed.shape:
            raise ValueError(f"shadow check of {what}: shapes {served.shape} != {computed.shape}")
        error = relative_error(served, computed)
        bad = not error <= self.tolerance  # NaN is bad too
        if bad:
            log.warning(
                "kvtier shadow check: %s differs from its recomputation (relative error %.3g > "
                "%.3g): the cache served wrong KV for it",
                what,
                error,
                self.tolerance,
            )
        with self._lock:
            s = self._stats
            self._stats = ShadowStats(
                s.checked_chunks + 1,
                s.mismatched_chunks + bad,
                s.unavailable_chunks,
                max(s.worst_error, error) if error == error else float("inf"),
            )
        return Verdict(error, bad)

    def unavailable(self) -> None:
        """A sampled chunk whose served copy could not be read back."""
        with self._lock:
            s = self._stats
            self._stats = ShadowStats(
                s.checked_chunks, s.mismatched_chunks, s.unavailable_chunks + 1, s.worst_error
            )

    def stats(self) -> ShadowStats:
        with self._lock:
            return self._stats


def relative_error(served: torch.Tensor, computed: torch.Tensor) -> float:
    """The largest per-slice ``max |served - computed| / max |computed|``
    (slices along the first dimension)."""
    a = served.float().flatten(1)
    b = computed.float().flatten(1)
    scale = b.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    return float(((a - b).abs().amax(dim=1) / scale).max())
