"""``PrefetchRequest``: one lookup while the prefetch worker handles it,
and how far its hit reaches.

The worker (``kvtier.controllers.prefetch``) owns every field. A hit is the
longest prefix of chunks whose every object is read-locked in L1 (``locked``),
never past ``limit``; the first chunk it lacks says why it ends there
(``miss_reason``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvtier.controllers.lookups import MissReason, PrefetchHandle
from kvtier.keys import ObjectKey
from kvtier.l1 import Placement
from kvtier.layout import KVLayout


@dataclass(eq=False)
class PrefetchRequest:
    chunks: tuple[tuple[ObjectKey, ...], ...]
    layouts: Mapping[int, KVLayout]
    deadline: float
    handle: PrefetchHandle
    limit: int  # no hit can extend past this chunk
    recompute_s_per_chunk: float | None = None  # the engine's; None: always load
    locked: dict[ObjectKey, Placement] = field(default_factory=dict)
    tier: dict[ObjectKey, str] = field(default_factory=dict)
    waiting_lookups: set[str] = field(default_factory=set)
    found: dict[str, set[ObjectKey]] = field(default_factory=dict)
    pending_loads: set[ObjectKey] = field(default_factory=set)
    down: set[str] = field(default_factory=set)  # adapters whose lookup could not answer
    missed: dict[ObjectKey, MissReason] = field(default_factory=dict)  # why an object missed
    ended: MissReason | None = None  # why the request was answered early, if it was
    parked: bool = False  # waiting in the backlog with its L1 locks given back
    done: bool = False
    digests: dict[int, str] = field(init=False)  # each group's layout digest, as L1 checks it

    def __post_init__(self) -> None:
        self.digests = {group: layout.digest() for group, layout in self.layouts.items()}

    @property
    def objects(self) -> int:
        return sum(map(len, self.chunks))

    def all_locked(self) -> bool:
        """Every object of the chunks a hit can reach is locked."""
        return all(k in self.locked for c in self.chunks[: self.limit] for k in c)

    def loadable_prefix(self) -> int:
        """Chunks up to the first one with an L1-missing object of unknown
        layout, or one that L1 holds under another layout (no copy of this
        layout can be admitted beside it)."""
        for index, chunk in enumerate(self.chunks):
            for key in chunk:
                if key in self.locked:
                    continue
                wrong = self.missed.get(key) is MissReason.LAYOUT_MISMATCH
                if key.group not in self.layouts or wrong:
                    return index
        return len(self.chunks)

    def wrong_layout(self, key: ObjectKey) -> None:
        """L1 holds ``key`` under another layout: a miss from there on."""
        self.missed[key] = MissReason.LAYOUT_MISMATCH

    def sources(
        self, loading: Callable[[ObjectKey], str | None]
    ) -> list[dict[ObjectKey, str | None]]:
        """Per chunk of the prefix a hit can reach, where each object not yet
        locked comes from: the first adapter (cascade order) whose lookup
        found it, or None when another request is loading it already
        (``loading(key)``: the layout digest an object in flight is loaded
        under, None if it is not; under another layout than this request's,
        it is a miss). Ends before the first chunk with an object no adapter
        has (that object's miss is recorded)."""
        planned: list[dict[ObjectKey, str | None]] = []
        for chunk in self.chunks[: self.limit]:
            sources: dict[ObjectKey, str | None] = {}
            for key in chunk:
                if key in self.locked:
                    continue
                in_flight = loading(key)
                if in_flight is not None:
                    if in_flight != self.digests.get(key.group, ""):
                        self.wrong_layout(key)
                        return planned
                    sources[key] = None
                    continue
                source = next((n for n, keys in self.found.items() if key in keys), None)
                if source is None:
                    self.missed[key] = (
                        MissReason.BACKEND_DOWN if self.down else MissReason.NOT_FOUND
                    )
                    return planned
                sources[key] = source
            planned.append(sources)
        return planned

    def bytes_by_source(self, planned: list[dict[ObjectKey, str | None]]) -> list[dict[str, int]]:
        """Per planned chunk, the bytes each adapter would load of it."""
        out: list[dict[str, int]] = []
        for sources in planned:
            nbytes: dict[str, int] = {}
            for key, source in sources.items():
                if source is not None:
                    size = self.layouts[key.group].object_bytes()
                    nbytes[source] = nbytes.get(source, 0) + size
            out.append(nbytes)
        return out

    def hit_chunks(self) -> int:
        """The longest prefix of chunks, up to ``limit``, whose every object is locked."""
        hit = 0
        for chunk in self.chunks[: self.limit]:
            if not all(key in self.locked for key in chunk):
                break
            hit += 1
        return hit

    def miss_reason(self, hit: int) -> MissReason | None:
        """Why chunk ``hit`` (the first the answer lacks) missed; None for a full hit."""
        if hit == len(self.chunks):
            return None
        for key in self.chunks[hit]:
            if key not in self.locked and key in self.missed:
                return self.missed[key]
        if self.ended is not None:
            return self.ended
        return MissReason.NOT_IN_L1  # no L2 was asked: none, or no layout for its group


__all__ = ["PrefetchRequest"]
