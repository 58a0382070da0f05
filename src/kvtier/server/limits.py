"""``ServerLimits``: every size a client can make the server hold, bounded.

The cache server is shared by every engine on a node, so no message may make
it allocate without bound, encode an integer that does not fit the wire, or
freeze a setting for everyone else. ``check_hello`` bounds what a HELLO
registers (layouts, ranks, the chunk size it would fix) before anything is
built from it; the session limits bound what registered clients keep
(clients, sessions, objects named by requests and held between them). Each
refusal is a ``RequestError`` whose message names the value and the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.keys.object_key import MAX_GROUP
from kvtier.layout import DTYPE_BYTES, KVLayout
from kvtier.protocol import messages as p
from kvtier.tenancy.folding import MIN_ROWS

MAX_TEXT_CHARS = 256  # client id, revision, LoRA id, layout format, request ids
MAX_MODEL_NAME_CHARS = 4096  # a hub id or a local path (PATH_MAX)
MAX_LAYOUTS = 16  # object groups per client
MAX_LAYERS = 4096
MAX_KV_HEADS = 4096
MAX_HEAD_DIM = 65536
MAX_RANKS = 1024
MAX_CHUNK_TOKENS = 1 << 16  # the largest chunk size a HELLO may fix


class RequestError(Exception):
    """A request the server refuses; becomes an ``Error`` reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class ServerLimits:
    session_ttl_s: float = 300.0  # a session untouched this long is ended
    client_ttl_s: float = 60.0  # a client silent this long (no ping) is dropped
    max_objects_per_request: int = 1 << 16  # chunks x ranks one LOOKUP/STORE may name
    max_wait_s: float = 30.0
    max_clients: int = 1024
    max_sessions_per_client: int = 4096
    max_reservations_per_client: int = 4096
    # Objects named by a client's sessions (pending lookups in full, answered
    # ones up to their hit), and by all clients: about 150 bytes each.
    max_session_objects_per_client: int = 1 << 20
    max_session_objects: int = 4 << 20
    max_pin_ttl_s: float = 7 * 86400.0  # a pin lasts at most this long (renew it)
    # Rows per tenant of the tables keyed by the namespaces clients name (the
    # savings ledger, the quality board): past it the least recent are summed
    # under "(other)", so no client can grow /status or /metrics without bound.
    max_namespace_rows: int = 256

    def __post_init__(self) -> None:
        for name in ("session_ttl_s", "client_ttl_s", "max_wait_s", "max_pin_ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"server limit {name!r} must be a positive number, got {value}")
        for name in (
            "max_objects_per_request",
            "max_clients",
            "max_sessions_per_client",
            "max_reservations_per_client",
            "max_session_objects_per_client",
            "max_session_objects",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"server limit {name!r} must be positive")
        if self.max_namespace_rows < MIN_ROWS:
            raise ValueError(
                f"server limit 'max_namespace_rows' must be at least {MIN_ROWS}, "
                f"got {self.max_namespace_rows}"
            )


def check_text(what: str, value: str, limit: int = MAX_TEXT_CHARS) -> None:
    if len(value) > limit:
        raise RequestError(
            "bad_request", f"{what} is {len(value)} characters; the limit is {limit}"
        )


def _check_range(what: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise RequestError("bad_request", f"{what} {value} is outside [{low}, {high}]")


def check_hello(hello: p.Hello) -> None:
    """Bound every field of a HELLO that the server will build from (the chunk
    size and the layouts' object sizes are checked once the chunk size is
    known: ``check_layouts``)."""
    if not hello.model:
        raise RequestError("bad_request", "hello names no model: send its hub id or path")
    check_text("model", hello.model, MAX_MODEL_NAME_CHARS)
    check_text("hash_model", hello.hash_model, MAX_MODEL_NAME_CHARS)
    for what, value in (
        ("client_id", hello.client_id),
        ("revision", hello.revision),
        ("lora", hello.lora),
    ):
        check_text(what, value)
    _check_range("num_ranks", hello.num_ranks, 1, MAX_RANKS)
    if not -1 <= hello.rank < hello.num_ranks:
        raise RequestError(
            "bad_request", f"rank {hello.rank} is outside [0, {hello.num_ranks}) (or -1)"
        )
    _check_range("block_alignment", hello.block_alignment, 1, MAX_CHUNK_TOKENS)
    if not 1 <= len(hello.layouts) <= MAX_LAYOUTS:
        raise RequestError(
            "bad_request", f"hello needs 1 to {MAX_LAYOUTS} layouts, got {len(hello.layouts)}"
        )
    groups = [spec.group for spec in hello.layouts]
    if len(set(groups)) != len(groups):
        raise RequestError("bad_request", f"two layouts share a group: {groups}")
    for spec in hello.layouts:
        where = f"layout of group {spec.group}:"
        _check_range(f"{where} group", spec.group, 0, MAX_GROUP - 1)
        _check_range(f"{where} num_layers", spec.num_layers, 1, MAX_LAYERS)
        _check_range(f"{where} kv_heads", spec.kv_heads, 1, MAX_KV_HEADS)
        _check_range(f"{where} head_dim", spec.head_dim, 1, MAX_HEAD_DIM)
        if spec.dtype not in DTYPE_BYTES:
            raise RequestError(
                "bad_request", f"{where} dtype {spec.dtype!r} is not one of {sorted(DTYPE_BYTES)}"
            )
        check_text(f"{where} format", spec.format)
        _check_range(f"{where} window_layers", spec.window_layers, 0, spec.num_layers)
        _check_range(f"{where} window_tokens", spec.window_tokens, 0, MAX_CHUNK_TOKENS)


def check_layouts(layouts: dict[int, KVLayout], chunk_size: int, l1_bytes: int) -> None:
    """Refuse a chunk size past ``MAX_CHUNK_TOKENS`` and layouts whose objects
    could never fit in L1."""
    if chunk_size > MAX_CHUNK_TOKENS:
        raise RequestError(
            "bad_request",
            f"block alignment makes the chunk size {chunk_size} tokens; the limit is "
            f"{MAX_CHUNK_TOKENS}",
        )
    for group, layout in layouts.items():
        size = layout.object_bytes()
        if size > l1_bytes:
            raise RequestError(
                "bad_request",
                f"one object of group {group} takes {size} bytes ({chunk_size} tokens), more than "
                f"the server's whole L1 ({l1_bytes} bytes); raise --l1-size on the server or "
                "lower --chunk-size",
            )
