"""What a cache-server request names, checked, and what its handler returns.

Every handler of ``CacheServer`` (and of ``HandoffRequests``) turns the
hashes, group and ranges a client sent into object keys and a layout
through these checks; each refusal is a ``RequestError`` naming the value
and what to change. A handler answers with an ``Outcome``: the reply now,
``Deferred`` (bulk work for the transport's pool, then the reply on the loop
thread) or ``Awaiting`` (the reply once a lookup settles).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.controllers import PrefetchHandle
from kvtier.keys import HASH_BYTES, ObjectKey, chunk_keys
from kvtier.layout import KVLayout, windowed
from kvtier.protocol import messages as p
from kvtier.server.limits import RequestError
from kvtier.server.sessions import Client, Session

Frames = list[npt.NDArray[np.uint8]]
Buffer = bytes | memoryview
Answer = tuple[p.Reply, Frames]


@dataclass(frozen=True, slots=True)
class Deferred:
    """An operation whose bulk work runs off the loop thread: ``work()`` on a
    pool thread (thread-safe: storage only), then ``finish(result)`` back on
    the loop thread, which makes the reply."""

    work: Callable[[], Any]
    finish: Callable[[Any], Answer]


@dataclass(frozen=True, slots=True)
class Awaiting:
    """An operation answered once a lookup settles: ``finish()`` makes the
    reply then, on the loop thread (no thread waits for the lookup)."""

    lookup: PrefetchHandle
    finish: Callable[[], Answer]


Outcome = Answer | Deferred | Awaiting
Handler = Callable[[Client, Any, Sequence[Buffer]], Outcome]


def request_keys(
    client: Client, hashes: list[bytes], group: int, limit: int
) -> list[list[ObjectKey]]:
    """The objects a request names: every (chunk, rank) of the client's
    namespace; hashes are checked first (length, no repeats, at most
    ``limit`` objects)."""
    ranks = client.num_ranks if client.rank < 0 else 1
    if len(hashes) * ranks > limit:
        raise RequestError(
            "bad_request",
            f"{len(hashes)} chunks x {ranks} ranks in one request; the limit is {limit} "
            "objects: split the request",
        )
    wrong = [i for i, h in enumerate(hashes) if len(h) != HASH_BYTES]
    if wrong:
        raise RequestError(
            "bad_request",
            f"hash {wrong[0]} has {len(hashes[wrong[0]])} bytes; chunk hashes have {HASH_BYTES}",
        )
    if len(set(hashes)) != len(hashes):
        raise RequestError("bad_request", "a chunk hash appears twice in one request")
    keys = chunk_keys(hashes, client.model, client.num_ranks, group, client.salt)
    return keys if client.rank < 0 else [[chunk[client.rank]] for chunk in keys]


def group_layout(client: Client, group: int) -> KVLayout:
    """The layout the client registered for ``group``."""
    layout = client.layouts.get(group)
    if layout is None:
        raise RequestError("bad_request", f"group {group} was not registered in hello")
    return layout


def hello_layout(spec: p.LayoutSpec, chunk_size: int, num_ranks: int) -> KVLayout:
    """A HELLO's layout; a refusal naming the field when it is not one."""
    try:
        layout = KVLayout(
            spec.num_layers,
            spec.kv_heads,
            spec.head_dim,
            spec.dtype,
            chunk_size,
            kind=spec.kind,  # type: ignore[arg-type]
            num_ranks=num_ranks,
            format=spec.format,
            lossy_codec=spec.lossy_codec,
        )
        if spec.window_layers or spec.window_tokens:
            layout = windowed(layout, spec.window_layers, spec.window_tokens)
        return layout
    except ValueError as exc:
        raise RequestError("bad_request", f"layout of group {spec.group}: {exc}") from None


def check_range(session: Session, start: int, end: int, what: str) -> None:
    """Chunks [start, end) of an answered lookup's hit, all still locked."""
    if not session.answered:
        raise RequestError("not_ready", f"{what}: the lookup has not been answered yet")
    if not 0 <= start < end <= len(session.locked):
        raise RequestError(
            "bad_range",
            f"{what} range [{start}, {end}) is outside the hit of {len(session.locked)}",
        )
    if not all(session.locked[start:end]):
        raise RequestError("released", f"{what}: part of [{start}, {end}) was released")


def chunk_offsets(keys: list[list[ObjectKey]]) -> list[tuple[int, list[ObjectKey]]]:
    """Each chunk's first index in the flattened key list, with its keys."""
    out, at = [], 0
    for chunk in keys:
        out.append((at, chunk))
        at += len(chunk)
    return out


__all__ = [
    "Answer",
    "Awaiting",
    "Buffer",
    "Deferred",
    "Frames",
    "Handler",
    "Outcome",
    "check_range",
    "chunk_offsets",
    "group_layout",
    "hello_layout",
    "request_keys",
]
