"""kvtier's eviction policies, and the offline optimum, replayed over a
trace's block accesses the way ``kvtier serve``'s L1 sees them.

The cache holds whole blocks, one slot each. A request is served as the
server serves an engine (``simulate_policy``):

1. its **hit** is the run of leading blocks that are resident (a block
   after the first missing one is never read: the engine recomputes from
   there); those are touched, the prefix's head last, so it ends most
   recent;
2. the blocks that are not resident are **written as one batch**: room for
   all of them is made first, the policy choosing the victims, then they
   are admitted tail first. Resident blocks after the first miss are left
   alone (the server counts them as duplicate writes).

This is ``kvtier serve`` with ``l1.high_watermark=1.0`` (eviction only when a
write needs the room); with the default watermarks (0.8, 0.6) L1 keeps
60-80 % of its bytes, so it behaves as a cache of about 70 % of its size.
``benchmarks/bench_l1_replay.py`` replays a trace through a real server and
compares its hits with this simulation's.

**The offline optimum** (``optimum_hit_tokens``) is Belady's rule with the
same prefix semantics: every block of a request is considered in order;
one never used again is not kept (and leaves the cache if it was in it);
one that is not resident is admitted if there is room, or else in place of
the resident block whose next use is farthest, if that is farther than its
own (otherwise it is not admitted). Hits are counted as in 1. above. With
prefix semantics this is an upper reference rather than a proven bound: a
block kept past its parent's eviction can still be worth nothing.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence
from typing import cast

from kvtier.keys import ObjectKey
from kvtier.l1.policies import make_policy
from kvtier.planner.reuse import Access

NEVER = math.inf


def requests(touches: Sequence[Access]) -> Iterator[Sequence[Access]]:
    """``touches`` cut into requests (runs of one ``Access.request``)."""
    start = 0
    for index in range(1, len(touches) + 1):
        if index == len(touches) or touches[index].request != touches[start].request:
            yield touches[start:index]
            start = index


def _hit_run(request: Sequence[Access], resident: set[int] | dict[int, float]) -> int:
    count = 0
    while count < len(request) and request[count].block in resident:
        count += 1
    return count


def simulate_policy(touches: Sequence[Access], policy_name: str, capacity_blocks: int) -> int:
    """Hit tokens of kvtier's eviction policy ``policy_name`` (``lru``,
    ``gdsf``, ``probation``, ...) with room for ``capacity_blocks`` blocks,
    served as the module docstring says (GDSF's cost is a block's tokens)."""
    return sum(
        sum(access.tokens for access in request[:hits])
        for request, hits in hit_runs(touches, policy_name, capacity_blocks)
    )


def hit_runs(
    touches: Sequence[Access], policy_name: str, capacity_blocks: int
) -> Iterator[tuple[Sequence[Access], int]]:
    """Each request and its hit run (leading blocks resident) under
    ``policy_name``: what ``kvtier serve``'s lookups would answer."""
    # A policy orders keys and never looks inside them (the probation
    # policy fingerprints an int as itself): block ids stand in for keys.
    policy = make_policy(policy_name, capacity_blocks)
    resident: set[int] = set()
    for request in requests(touches):
        hits = _hit_run(request, resident)
        yield request, hits
        policy.touch(cast(ObjectKey, access.block) for access in reversed(request[:hits]))
        written: dict[int, Access] = {}
        for access in request[hits:]:
            if access.block not in resident:
                written[access.block] = access
        batch = list(written.values())
        if len(batch) > capacity_blocks:
            continue  # the server refuses a write larger than L1: nothing is stored
        room = len(resident) + len(batch) - capacity_blocks
        if room > 0:
            for victim in policy.select(room, lambda _key: True):
                resident.discard(cast(int, victim))
        for access in reversed(batch):
            resident.add(access.block)
            policy.admit(cast(ObjectKey, access.block), 1, cost=float(access.tokens))


def _next_uses(touches: Sequence[Access]) -> list[float]:
    """For each access, the request number of its block's next use (NEVER if none)."""
    upcoming: dict[int, float] = {}
    out = [NEVER] * len(touches)
    for index in range(len(touches) - 1, -1, -1):
        access = touches[index]
        later = upcoming.get(access.block, NEVER)
        out[index] = later if later != access.request else NEVER
        upcoming[access.block] = access.request
    return out


def optimum_hit_tokens(touches: Sequence[Access], capacity_blocks: int) -> int:
    """Hit tokens of the offline optimum (the module docstring's rule)."""
    next_use = _next_uses(touches)
    resident: dict[int, float] = {}  # block -> its next use
    farthest: list[tuple[float, int]] = []  # (-next use, block), stale entries skipped
    hit_tokens = 0
    position = 0
    for request in requests(touches):
        hits = _hit_run(request, resident)
        hit_tokens += sum(access.tokens for access in request[:hits])
        for offset, access in enumerate(request):
            upcoming = next_use[position + offset]
            block = access.block
            if upcoming == NEVER:
                resident.pop(block, None)
                continue
            if block not in resident and len(resident) >= capacity_blocks:
                while farthest and resident.get(farthest[0][1]) != -farthest[0][0]:
                    heapq.heappop(farthest)
                if not farthest or -farthest[0][0] <= upcoming:
                    continue
                del resident[heapq.heappop(farthest)[1]]
            resident[block] = upcoming
            heapq.heappush(farthest, (-upcoming, block))
        position += len(request)
    return hit_tokens


__all__ = ["hit_runs", "optimum_hit_tokens", "requests", "simulate_policy"]
