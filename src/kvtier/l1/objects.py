"""The records and result codes of the L1 state machine (see ``L1Manager``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

from kvtier.keys import ObjectKey

WriterTag = NewType("WriterTag", str)


class ObjectState(enum.Enum):
    STAGING = "staging"  # reserved by one writer tag, invisible to readers
    RESIDENT = "resident"  # published and readable; read-locked while read_locks > 0
    DOOMED = "doomed"  # purged while held: unreadable, freed when its last holder lets go


class L1Result(enum.Enum):
    """Per-key outcome of an L1 transition. Expected outcomes, never exceptions."""

    SUCCESS = "success"
    NOT_FOUND = "not_found"  # no such resident object / no such staging reservation
    NOT_WRITABLE = "not_writable"  # reserve_write on a key that is already resident
    # resident under another layout digest: a miss for a reader, not writable
    # for a writer (the first layout to publish a key keeps it)
    WRONG_LAYOUT = "wrong_layout"
    OUT_OF_MEMORY = "out_of_memory"  # no room even after evicting what may be evicted
    LOCKED = "locked"  # delete (kept) or purge (doomed) of a read-locked or I/O-fenced object
    WRONG_STATE = "wrong_state"  # e.g. finish_read on an unlocked object
    # past the owner's hard limit, or a batch past its soft limit (writes);
    # past its pin limit (pins)
    OVER_QUOTA = "over_quota"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a reserved object lives in the arena, with the transition's result."""

    result: L1Result
    offset: int | None = None
    size: int = 0


@dataclass(slots=True, eq=False)
class L1Object:
    """One object's memory and state. Owned by ``L1Manager``, mutated under its lock."""

    key: ObjectKey
    offset: int
    size: int  # payload bytes, as asked
    reserved: int  # bytes taken in the arena (whole pages)
    state: ObjectState
    tag: WriterTag | None = None
    cost: float | None = None
    layout: str = ""  # the layout digest its bytes follow ("" if the writer gave none)
    read_locks: int = 0
    lease_expiry: float | None = None
    armed_at: float | None = None  # due time of this object's live entry in the lease heap
    io_fences: int = 0
    reclaimed: bool = False  # lease expired while fenced: free when the fence lifts
    admitted_at: float = 0.0  # when it became resident (the manager's clock)


@dataclass(slots=True, eq=False)
class IOFence:
    """Proof that an I/O targets these objects; their memory is not reused until
    ``L1Manager.unfence`` is called, even if their leases expire meanwhile."""

    objects: list[L1Object] = field(default_factory=list)
    released: bool = False
