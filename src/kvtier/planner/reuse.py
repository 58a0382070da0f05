"""A trace's prefix-reuse curve: hit tokens against cache capacity.

The cache holds blocks (one slot each, a partial last block included, as in
a paged cache); a request touches its blocks in prefix order, and a block is
a hit if it is resident when touched. For LRU the curve is exact at every
capacity from one pass (Mattson et al., 1970): an access's *stack depth* is 1
plus the distinct blocks touched since the same block's previous access, and
it hits in an LRU cache of ``C`` blocks exactly when its depth is ``<= C``.
Depths come from a Fenwick tree over access positions that marks each
block's latest access: the distinct blocks since position ``p`` are the marks
after ``p``. O(accesses * log accesses).

Prefix-chained ids make LRU hits a prefix of each request: block *i* was
touched right after block *i - 1* every time, so its depth is never smaller.
Other eviction orders have no stack property: ``kvtier.planner.policy_sim``
runs kvtier's own policies, and the offline optimum, at chosen capacities.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvtier.traces.mooncake import MooncakeRecord

MINUTE_S = 60.0


@dataclass(frozen=True, slots=True)
class Access:
    """One block touched by one request."""

    block: int  # the trace's hash id
    tokens: int  # the block's tokens (the last one of a request may be partial)
    minute: int  # minutes since the trace's start
    request: int = 0  # the request's place in the trace


@dataclass(frozen=True, slots=True)
class ReuseCurve:
    """The stack depth of every re-access, and what it is worth.

    ``depths`` (blocks), ``tokens`` and ``minutes`` are parallel arrays over
    re-accesses, sorted by depth; first accesses are misses at any capacity.
    """

    requests: int
    accesses: int
    distinct_blocks: int
    input_tokens: int
    duration_s: float
    depths: np.ndarray
    tokens: np.ndarray
    minutes: np.ndarray
    _cumulative: np.ndarray  # tokens of the re-accesses up to each depth

    @property
    def ceiling_tokens(self) -> int:
        """Hit tokens with an infinite cache: every re-access hits."""
        return int(self._cumulative[-1]) if len(self._cumulative) else 0

    def hit_tokens(self, capacity_blocks: int) -> int:
        """Hit tokens of an LRU cache of ``capacity_blocks`` blocks."""
        count = int(np.searchsorted(self.depths, capacity_blocks, side="right"))
        return int(self._cumulative[count - 1]) if count else 0

    def hit_ratio(self, capacity_blocks: int) -> float:
        return self.hit_tokens(capacity_blocks) / self.input_tokens

    def blocks_for(self, hit_tokens: float) -> int | None:
        """The smallest LRU capacity (blocks) that hits ``hit_tokens`` tokens;
        None if even an infinite cache does not."""
        count = int(np.searchsorted(self._cumulative, hit_tokens, side="left"))
        if count >= len(self._cumulative):
            return None if hit_tokens > 0 else 0
        return int(self.depths[count])

    def tokens_per_minute(self, low_blocks: int, high_blocks: int) -> np.ndarray:
        """Tokens per trace minute of the accesses an LRU cache of
        ``high_blocks`` hits and one of ``low_blocks`` misses (a lower tier's
        reads under an upper tier of ``low_blocks``)."""
        start = int(np.searchsorted(self.depths, low_blocks, side="right"))
        stop = int(np.searchsorted(self.depths, high_blocks, side="right"))
        bins = int(self.duration_s // MINUTE_S) + 1
        return np.bincount(
            self.minutes[start:stop], weights=self.tokens[start:stop], minlength=bins
        )


def accesses(records: Iterable[MooncakeRecord], first: int = 0) -> list[Access]:
    """Every block touch of ``records``, in request order then prefix order;
    requests are numbered from ``first``."""
    return [
        Access(block, tokens, int(record.timestamp_ms / 1000 // MINUTE_S), number)
        for number, record in enumerate(records, first)
        for block, tokens in zip(record.hash_ids, record.block_lengths(), strict=True)
    ]


def reuse_curve(touches: list[Access], requests: int, duration_s: float) -> ReuseCurve:
    """The exact LRU curve of ``touches`` (see the module docstring)."""
    size = len(touches)
    tree = [0] * (size + 1)  # Fenwick tree over positions 1..size

    def add(position: int, delta: int) -> None:
        while position <= size:
            tree[position] += delta
            position += position & -position

    def marks_up_to(position: int) -> int:
        total = 0
        while position > 0:
            total += tree[position]
            position -= position & -position
        return total

    latest: dict[int, int] = {}  # block -> position of its latest access
    depths: list[int] = []
    hits: list[int] = []
    live = 0  # marks in the tree: distinct blocks so far
    for position, touch in enumerate(touches, 1):
        previous = latest.get(touch.block)
        if previous is not None:
            depths.append(live - marks_up_to(previous) + 1)
            hits.append(position - 1)
            add(previous, -1)
        else:
            live += 1
        add(position, 1)
        latest[touch.block] = position
    order = np.argsort(np.asarray(depths, dtype=np.int64), kind="stable")
    tokens = np.asarray([touches[i].tokens for i in hits], dtype=np.int64)[order]
    return ReuseCurve(
        requests=requests,
        accesses=size,
        distinct_blocks=len(latest),
        input_tokens=sum(t.tokens for t in touches),
        duration_s=duration_s,
        depths=np.asarray(depths, dtype=np.int64)[order],
        tokens=tokens,
        minutes=np.asarray([touches[i].minute for i in hits], dtype=np.int64)[order],
        _cumulative=np.cumsum(tokens),
    )


__all__ = ["Access", "ReuseCurve", "accesses", "reuse_curve"]
