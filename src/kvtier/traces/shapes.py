"""Mooncake-format traces of chosen shapes, generated: what a router or a
cache policy is checked on besides the one production trace we have.

Each shape stresses one property of real traffic (``SHAPES``):

- ``short``: many short prompts (a third or more under 1 K tokens): short
  chats, most behind one of a few system prompts (Zipf), some with none;
- ``unshared``: no shared first block: every session starts with its own
  context, and reuse is only a session's own history, turn after turn;
- ``long``: long contexts (mean >= 15 K tokens, p95 >= 45 K): questions on
  documents of 8-64 K tokens drawn with Zipf popularity;
- ``agent``: agent-like sessions: many short turns (a tool result, a step)
  on one long prefix (a tool catalogue and instructions, 8-24 K tokens, one
  of a few);
- ``mixed``: sessions of every shape above in one trace;
- ``oneoff``: mostly one-off prompts (single-turn questions on their own
  2-16 K-token contexts, half behind a system prompt), with one session in
  five going on for a few turns: a scan of blocks never read again, with
  some reuse a cache must not lose to it.

A session arrives at a Poisson rate over ``duration_s``; each turn comes an
exponential think time after the previous one (the shape's mean) and
extends the previous prompt with its answer and a new message, as a chat
does. Blocks are prefix-chained as in Mooncake's traces: a block id is
shared only by prompts that agree on every token up to its end, so a turn
keeps the previous prompt's full blocks and its partial last block becomes
a new one. A pure function of the spec: the same seed, the same trace.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.traces.mooncake import TRACE_BLOCK_TOKENS

MIXED_OF = ("short", "unshared", "long", "agent")  # what a mixed trace's sessions are
SHAPES = (*MIXED_OF, "mixed", "oneoff")
Record = dict[str, object]  # one Mooncake line: timestamp, input_length, output_length, hash_ids


# sessions by default: about 3-6 K requests a trace
SESSIONS = {
    "short": 1500,
    "unshared": 800,
    "long": 1500,
    "agent": 250,
    "mixed": 700,
    "oneoff": 2500,
}


@dataclass(frozen=True, slots=True)
class ShapeSpec:
    shape: str
    sessions: int = 0  # 0: the shape's default (SESSIONS)
    duration_s: float = 1200.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"--shape must be one of {', '.join(SHAPES)}, got {self.shape!r}")
        if not self.sessions:
            object.__setattr__(self, "sessions", SESSIONS[self.shape])
        if self.sessions < 1:
            raise ValueError(f"--sessions must be >= 1, got {self.sessions}")
        if not self.duration_s > 0:
            raise ValueError(f"--duration-s must be > 0, got {self.duration_s}")


@dataclass(frozen=True, slots=True)
class _Session:
    """How one session of a shape draws its prompts (lengths in tokens)."""

    prefix: tuple[int, ...]  # shared hash ids it starts with (a system prompt, a document)
    first: int  # its own tokens after the prefix in the first turn
    turns: int
    message: tuple[float, float]  # each later message: lognormal (median tokens, sigma)
    answer: tuple[float, float]  # each answer, likewise
    think_s: float  # mean seconds between turns


class _Ids:
    """Fresh hash ids."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def take(self, blocks: int) -> tuple[int, ...]:
        return tuple(next(self._next) for _ in range(blocks))


def _lognormal(rng: random.Random, median: float, sigma: float, low: int = 1) -> int:
    return max(low, round(median * math.exp(rng.gauss(0.0, sigma))))


def _zipf(rng: random.Random, items: list[tuple[int, ...]], s: float = 1.1) -> tuple[int, ...]:
    weights = [1 / (i + 1) ** s for i in range(len(items))]
    return rng.choices(items, weights)[0]


class _Pools:
    """The shared prefixes a trace's sessions draw from (made once per trace)."""

    def __init__(self, rng: random.Random, ids: _Ids) -> None:
        self.systems = [ids.take(rng.randint(1, 3)) for _ in range(12)]
        # 8-64 K tokens, median 18 K
        self.documents = [ids.take(min(_lognormal(rng, 36, 0.55, low=16), 128)) for _ in range(300)]
        self.tools = [ids.take(rng.randint(16, 48)) for _ in range(6)]


def _session(shape: str, rng: random.Random, pools: _Pools) -> _Session:
    if shape == "mixed":
        shape = rng.choice(MIXED_OF)
    if shape == "oneoff":
        prefix = _zipf(rng, pools.systems) if rng.random() < 0.5 else ()
        turns = 1 if rng.random() < 0.8 else rng.randint(2, 5)
        return _Session(
            prefix, _lognormal(rng, 5000, 0.7, low=2000), turns, (200, 0.8), (250, 0.7), 30.0
        )
    if shape == "short":
        prefix = _zipf(rng, pools.systems) if rng.random() < 0.7 else ()
        return _Session(
            prefix, _lognormal(rng, 250, 1.0), rng.randint(1, 4), (120, 0.9), (180, 0.8), 40.0
        )
    if shape == "unshared":
        return _Session(
            (), _lognormal(rng, 3000, 0.9), rng.randint(2, 6), (300, 1.0), (300, 0.8), 60.0
        )
    if shape == "long":
        prefix = pools.systems[0] + _zipf(rng, pools.documents, 0.9)
        return _Session(
            prefix, _lognormal(rng, 200, 0.6), rng.randint(1, 3), (150, 0.6), (250, 0.6), 45.0
        )
    prefix = _zipf(rng, pools.tools, 0.8)  # agent
    return _Session(
        prefix, _lognormal(rng, 600, 0.7), rng.randint(8, 30), (250, 0.9), (120, 0.7), 4.0
    )


def _turns(session: _Session, start_s: float, rng: random.Random, ids: _Ids) -> Iterator[Record]:
    """The session's requests: each prompt the previous one, its answer and
    a new message; the blocks it shares with the previous prompt are that
    prompt's full ones."""
    blocks = list(session.prefix)
    length = len(blocks) * TRACE_BLOCK_TOKENS  # shared prefixes are whole blocks
    at, grow = start_s, session.first
    for _ in range(session.turns):
        full = length // TRACE_BLOCK_TOKENS  # the previous prompt's whole blocks stay
        length += grow
        blocks = blocks[:full] + list(ids.take(math.ceil(length / TRACE_BLOCK_TOKENS) - full))
        answer = _lognormal(rng, *session.answer)
        yield {
            "timestamp": round(at * 1000),
            "input_length": length,
            "output_length": answer,
            "hash_ids": list(blocks),
        }
        at += rng.expovariate(1 / session.think_s) + 1.0
        grow = answer + _lognormal(rng, *session.message)


def shape_trace(spec: ShapeSpec) -> list[Record]:
    """``spec``'s trace, in time order (see the module docstring)."""
    rng = random.Random(f"{spec.shape}/{spec.seed}")
    ids = _Ids()
    pools = _Pools(rng, ids)
    records: list[Record] = []
    for _ in range(spec.sessions):
        session = _session(spec.shape, rng, pools)
        start = rng.uniform(0.0, spec.duration_s)
        records.extend(
            r for r in _turns(session, start, rng, ids) if _ms(r) < spec.duration_s * 1000
        )
    return sorted(records, key=_ms)


def _ms(record: Record) -> float:
    value = record["timestamp"]
    assert isinstance(value, int)
    return value


def write_mooncake(path: Path, records: Iterable[Record]) -> None:
    """``records`` as a Mooncake-format trace file, one JSON object a line."""
    with path.open("w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")


__all__ = ["SHAPES", "ShapeSpec", "shape_trace", "write_mooncake"]
