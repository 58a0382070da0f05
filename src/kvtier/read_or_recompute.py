"""Read or recompute: the one cost model behind ``kvtier plan``'s
verdict and the prefetch controller's choice per request.

Loading ``n`` bytes from a tier costs ``latency + n / bandwidth`` (decode
included: it runs on the tier's load threads, inside the measured time);
recomputing a chunk costs the engine's prefill seconds per token times its
tokens. Loading pays where it is the cheaper of the two.

``LinkEstimate`` learns a tier's cost online: each lookup (a round trip
without payload) is a latency sample, each load a bandwidth sample (its
bytes over its time beyond the latency); both are exponentially weighted.
``cheapest_prefix`` picks how far into a prompt to load: the prefix whose
loads, run in parallel across tiers, save the most prefill time.
``coded_read_pays`` is the same question for a codec: whether a smaller
read plus its decode beats the plain read.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["load", "recompute"]

EWMA = 0.2
MIN_LOADS = 2  # loads seen before a tier's estimate is used
MIN_TRANSFER_S = 1e-6


def verdict(load_s: float, recompute_s: float) -> Verdict:
    return "load" if load_s < recompute_s else "recompute"


@dataclass(frozen=True, slots=True)
class LinkCost:
    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        """Seconds to load ``nbytes`` in one batch (0 for nothing)."""
        return self.latency_s + nbytes / self.bytes_per_s if nbytes else 0.0


class LinkEstimate:
    """A tier's ``LinkCost``, learned from its tasks (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latency: float | None = None
        self._rate: float | None = None
        self._loads = 0

    def round_trip(self, seconds: float) -> None:
        with self._lock:
            self._latency = ewma(self._latency, seconds)

    def load(self, seconds: float, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            transfer = max(seconds - (self._latency or 0.0), MIN_TRANSFER_S)
            self._rate = ewma(self._rate, nbytes / transfer)
            self._loads += 1

    def cost(self) -> LinkCost | None:
        """None until ``MIN_LOADS`` loads were seen."""
        with self._lock:
            if self._rate is None or self._loads < MIN_LOADS:
                return None
            return LinkCost(self._latency or 0.0, self._rate)


def cheapest_prefix(
    chunk_bytes: Sequence[Mapping[str, int]],
    costs: Mapping[str, LinkCost | None],
    recompute_s_per_chunk: float,
) -> int:
    """How many of ``chunk_bytes`` (per chunk: bytes to load from each tier,
    in prompt order) to load: the count whose loads (the tiers in parallel)
    save the most prefill time over recomputing them; ties load more. A tier
    whose cost is not known yet counts as free (it is loaded, and learned)."""
    best, best_gain = 0, 0.0
    totals: dict[str, int] = {}
    for n, chunk in enumerate(chunk_bytes, start=1):
        for tier, nbytes in chunk.items():
            totals[tier] = totals.get(tier, 0) + nbytes
        load = max(
            (cost.seconds(b) for t, b in totals.items() if (cost := costs.get(t)) is not None),
            default=0.0,
        )
        gain = n * recompute_s_per_chunk - load
        if gain >= best_gain:
            best, best_gain = n, gain
    return best


def coded_read_pays(ratio: float, link_bytes_per_s: float, decode_bytes_per_s: float) -> bool:
    """Whether reading a payload coded to ``ratio`` of its size and decoding
    it beats reading it plain over the same link (per byte of payload)."""
    return ratio / link_bytes_per_s + 1 / decode_bytes_per_s < 1 / link_bytes_per_s


def ewma(old: float | None, sample: float) -> float:
    """An exponentially weighted mean (``EWMA`` on the new sample)."""
    return sample if old is None else (1 - EWMA) * old + EWMA * sample


__all__ = [
    "LinkCost",
    "LinkEstimate",
    "Verdict",
    "cheapest_prefix",
    "coded_read_pays",
    "ewma",
    "verdict",
]
